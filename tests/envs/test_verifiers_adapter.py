"""The verifiers adapter over test doubles written the way verifiers documents a MultiTurnEnv (the package
itself is not installed here): a newer-style game (async env_response returning a string, `state["done"]`,
an async rubric function) and an older-style one ((message, state) tuples, is_completed(messages, state)).
Both play, replay and refuse an edited feedback turn like a native environment."""

from __future__ import annotations

import pytest

from asyncrl import envs
from asyncrl.envs.verifiers_adapter import VerifiersAdapter
from asyncrl.models import tinymodel

from .scripted import ScriptedPolicy


class Rubric:
    def __init__(self, funcs, weights=None):
        self.funcs, self.weights = funcs, weights


async def solved(completion, answer) -> float:
    return 1.0 if any(m["role"] == "assistant" and m["content"].strip() == answer for m in completion) else 0.0


def turns_used(state) -> float:
    return -0.1 * state["turn"]


class HotColdNew:
    """Guess a digit; "higher" / "lower" after each wrong guess (newer verifiers style)."""

    max_turns = 4
    system_prompt = "guess my digit"
    dataset = [{"prompt": [{"role": "user", "content": "go"}], "answer": "7"}]
    rubric = Rubric([solved, turns_used], [1.0, 1.0])

    async def env_response(self, messages, state, **kwargs):
        guess = messages[-1]["content"].strip()
        if guess == state["answer"]:
            state["done"] = True
            return []
        if not guess.isdigit():
            return "say a digit"
        return "higher" if int(guess) < int(state["answer"]) else "lower"


class HotColdOld(HotColdNew):
    """The same game in the older API: (message, state) and is_completed(messages, state)."""

    def is_completed(self, messages, state, **kwargs):
        return messages[-1]["role"] == "assistant" and messages[-1]["content"].strip() == state["answer"]

    def env_response(self, messages, state, **kwargs):
        guess = messages[-1]["content"].strip()
        return {"role": "user", "content": "higher" if int(guess) < int(state["answer"]) else "lower"}, state


@pytest.fixture(scope="module")
def tok():
    return tinymodel.build_tokenizer()


@pytest.mark.parametrize("game", [HotColdNew, HotColdOld])
def test_a_verifiers_game_plays_and_replays(tok, game):
    env = VerifiersAdapter(game(), name="hotcold")
    (record,) = env.records()
    (s,) = envs.run_episodes(env, envs.Renderer(tok), [(record, 1)], ScriptedPolicy(tok, ["3", "8", "7"]),
                             stop_token_ids=(tok.eos_token_id,), max_new_tokens=4)
    assert s.turns == 3 and s.finish_reason == "stop"
    assert s.reward == pytest.approx(1.0 - 0.3)
    feedback = [tok.decode(s.tokens[a:b]) for a, b, e in envs.segments(s.env_mask) if e]
    assert feedback == [" higher ", " lower "]
    kw = dict(record=record, seed=1, prompt_ids=s.prompt_ids, stop_token_ids=(tok.eos_token_id,), max_new_tokens=4)
    assert envs.replay(env, envs.Renderer(tok), tokens=s.tokens, env_mask=s.env_mask, **kw).reward == s.reward
    a, b, _ = envs.segments(s.env_mask)[3]  # " lower " becomes " higher "
    forged = s.tokens[:a] + tok(" higher ", add_special_tokens=False)["input_ids"] + s.tokens[b:]
    with pytest.raises(envs.EpisodeMismatch):
        envs.replay(env, envs.Renderer(tok), tokens=forged, env_mask=s.env_mask[:a] + [1] * 8 + s.env_mask[b:], **kw)


def test_max_turns_comes_from_the_verifiers_env(tok):
    env = VerifiersAdapter(HotColdNew(), name="hotcold")
    assert env.limits.max_turns == 4
    (s,) = envs.run_episodes(env, envs.Renderer(tok), [(env.records()[0], 1)], ScriptedPolicy(tok, ["1"]),
                             stop_token_ids=(tok.eos_token_id,), max_new_tokens=4)
    assert s.turns == 4 and s.reward == pytest.approx(0.0 - 0.4)
