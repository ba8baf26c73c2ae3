"""docs/environments.md's copyable example runs as written: played by a scripted policy, replayed, refused
when a hint is edited."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from asyncrl import envs
from asyncrl.models import tinymodel

from .scripted import ScriptedPolicy

DOC = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


def example_env():
    block = next(b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if "class GuessEnv" in b)
    scope: dict = {}
    exec(compile(block, str(DOC), "exec"), scope)  # the documented code, verbatim
    return scope["GuessEnv"]()


def test_the_documented_example_plays_and_replays():
    env, tok = example_env(), tinymodel.build_tokenizer()
    record = {"high": 9}
    secret = env.reset(record, 5).state["secret"]
    guesses = [str(g) for g in range(1, 10)]
    (s,) = envs.run_episodes(env, envs.Renderer(tok), [(record, 5)], ScriptedPolicy(tok, guesses),
                             stop_token_ids=(tok.eos_token_id,), max_new_tokens=4)
    assert s.turns == min(secret, env.limits.max_turns)
    assert s.reward == (pytest.approx(1.0 / secret) if secret <= env.limits.max_turns else 0.0)
    kw = dict(record=record, seed=5, prompt_ids=s.prompt_ids, stop_token_ids=(tok.eos_token_id,), max_new_tokens=4)
    assert envs.replay(env, envs.Renderer(tok), tokens=s.tokens, env_mask=s.env_mask, **kw).reward == s.reward
    if secret > 1:
        a, b, _ = envs.segments(s.env_mask)[1]  # " higher. " -> " lower. "
        forged = tok(" lower. ", add_special_tokens=False)["input_ids"]
        with pytest.raises(envs.EpisodeMismatch):
            envs.replay(env, envs.Renderer(tok), tokens=s.tokens[:a] + forged + s.tokens[b:],
                        env_mask=s.env_mask[:a] + [1] * len(forged) + s.env_mask[b:], **kw)
