"""Replay cost at ingest: how long the coordinator takes to verify one multi-turn episode, and what that is
next to one learner step on the same episodes (issue 41).

    .venv/bin/python -m bench.env_replay --json-out runs/bench/env_replay.json

Timed (CPU seconds of this process, one thread): coordinator.ingest.episodes.rescore_episode_group — the whole
ingest check of a group: the environment reset, every model turn decoded and stepped, every environment
turn rendered through the chat template, tokenized and compared, the reward recomputed — for
  echo        the built-in 3-turn game, the tiny model's tokenizer (no chat template);
  calculator  2 turns (a tool call, an answer) through Qwen2.5's chat template with tools (the test-local
              character tokenizer of tests/envs/chat.py: the template's cost is real, the tokenizer is not);
and one learner step (tiny model, fp32, CPU) over `--groups` groups of `--group-size` echo episodes, so
`fraction_of_step` = replaying those same episodes / that step. Scripted policies play the episodes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from asyncrl import envs  # noqa: E402
from asyncrl.coordinator.ingest.episodes import rescore_episode_group  # noqa: E402
from asyncrl.coordinator.leasing.taskboard import Lease  # noqa: E402
from asyncrl.envs.source import episode_prompt  # noqa: E402
from asyncrl.protocol import messages  # noqa: E402

from bench.results import provenance, write_result  # noqa: E402
from tests.envs.chat import qwen_style_tokenizer  # noqa: E402
from tests.envs.scripted import ScriptedPolicy  # noqa: E402

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "17*23+4"}}\n</tool_call>'


def episode_group(name, record, tokenizer, turns, group_size, max_new_tokens, index):
    prompt = episode_prompt(name, record, f"{name}-bench-{index}", tokenizer)
    env = envs.get_env(name)
    start = (envs.record_of(prompt.columns, prompt.answer), envs.seed_for(prompt.prompt_id))
    sessions = envs.run_episodes(env, envs.Renderer(tokenizer), [start] * group_size, ScriptedPolicy(tokenizer, turns),
                                 stop_token_ids=(tokenizer.eos_token_id,), max_new_tokens=max_new_tokens)
    comps = tuple(messages.Completion(np.asarray(s.tokens, "<i4").tobytes(), np.asarray(s.logprobs, "<f4").tobytes(),
                                      s.reward, s.finish_reason, env_mask=np.asarray(s.env_mask, np.uint8).tobytes())
                  for s in sessions)
    group = messages.RolloutGroup(f"l{index}", prompt.prompt_id, np.asarray(sessions[0].prompt_ids, "<i4").tobytes(),
                                  comps)
    lease = Lease(f"l{index}", prompt, b"", 0.0, group.prompt_token_ids)
    return group, lease, sessions


def timed_replays(groups, tokenizer, max_new_tokens) -> tuple[list[float], list]:
    batch = messages.RolloutBatch(run_id="r", adapter_version=0, client_name="b", generated_at=0.0, groups=(),
                                  sampling=messages.SamplingParams(max_new_tokens=max_new_tokens))
    per_episode, train = [], []
    for group, lease, _ in groups:
        t0 = time.process_time()
        train.append(rescore_episode_group(tokenizer, group, lease, batch, stop_token_ids=(tokenizer.eos_token_id,)))
        per_episode.append((time.process_time() - t0) * 1e3 / len(group.completions))
    return per_episode, train


def summary(ms: list[float]) -> dict:
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "groups_timed": len(ms)}


def run(args) -> dict:
    import torch

    torch.set_num_threads(1)
    from asyncrl.coordinator.learner.learner import Learner
    from asyncrl.coordinator.learner.loss import LossConfig
    from asyncrl.models import tinymodel

    path = str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))
    tiny = tinymodel.build_tokenizer()
    echo = [episode_group("echo", {}, tiny, ["a", "b", "c"], args.group_size, 3, i) for i in range(args.groups)]
    qwen = qwen_style_tokenizer()
    calc = [episode_group("calculator", {"question": "What is 17*23+4?", "answer": "395"}, qwen,
                          [CALL, "17*23+4 = 395"], args.group_size, 128, i) for i in range(args.groups)]
    echo_ms, train = timed_replays(echo, tiny, 3)
    calc_ms, _ = timed_replays(calc, qwen, 128)
    learner = Learner(path, messages.LoraSpec(r=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj")),
                      lr=1e-3, loss=LossConfig(), max_staleness=None)
    learner.step(train)  # warm-up
    steps = []
    for _ in range(args.steps):
        t0 = time.process_time()
        learner.step(train)
        steps.append(time.process_time() - t0)
    step_ms = statistics.median(steps) * 1e3
    replay_step_ms = sum(echo_ms) * args.group_size
    return {"bench": "env_replay", **provenance(), "groups": args.groups, "group_size": args.group_size,
            "echo": {**summary(echo_ms), "transcript_tokens": len(echo[0][2][0].tokens), "turns": echo[0][2][0].turns},
            "calculator": {**summary(calc_ms), "transcript_tokens": len(calc[0][2][0].tokens),
                           "turns": calc[0][2][0].turns},
            "learner_step_ms": {"median": step_ms, "min": min(steps) * 1e3, "max": max(steps) * 1e3},
            "replay_of_the_step_ms": replay_step_ms, "fraction_of_step": replay_step_ms / step_ms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="learner steps timed (median reported)")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run(args)
    import json

    print(json.dumps(result, indent=2))
    write_result(args.json_out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
