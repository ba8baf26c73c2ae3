"""Run an environment written for Prime Intellect's `verifiers` (MultiTurnEnv / ToolEnv style) as an asyncrl
environment — when its rollout can be replayed.

Not a dependency: this adapter touches only the documented surface of such an environment object, so it
works with whatever `verifiers` release the researcher installed, and with plain classes that follow it
(the tests use one: tests/envs/test_verifiers_adapter.py). What it reads:

  env.dataset rows      {"prompt": [messages], "answer": str, "info": dict, "task": str} — the asyncrl record
                        is the row (JSONL or the adapter's `records()`);
  env.system_prompt     optional, put first when the row's prompt has no system turn;
  env.max_turns         assistant turns (-1/None: EnvLimits.max_turns);
  env.env_response(messages, state, **kw)   sync or async; returns the environment's messages (a list, one
                        message or a string: a "user" turn) — or, in older releases, (messages, state);
  env.is_completed(messages, state, **kw)   optional, sync or async (older releases); newer ones stop on
                        max_turns or on `state["done"]` set by env_response, which this adapter reads too;
  env.rubric.funcs / .weights (or .get_reward_funcs() / .get_reward_weights())   reward functions, sync or
                        async, called with the keyword arguments their signatures ask for, among prompt,
                        completion, answer, state, info, task; the episode reward is their weighted sum.

What can be verified this way (the coordinator replays env_response and the rubric over the transcript):
environments whose responses and rewards are functions of (row, seed, transcript) — games, puzzles,
deterministic tools (calculators, parsers, a seeded simulator: put `state["seed"]` into its RNG), rubric
functions that compare strings or numbers. What cannot: anything that calls the network (web search, an
LLM judge, a remote sandbox), reads the clock or unseeded randomness, or keeps state outside `state` — the
replay would disagree with an honest volunteer. Such environments must not be registered for asyncrl;
the adapter cannot tell, so say so in the environment's own docs.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from .base import EnvLimits, Reset, StepResult

REWARD_KWARGS = ("prompt", "completion", "answer", "state", "info", "task")


def _run(value):
    """The result of a sync or async call (a fresh event loop: environment calls run on their own thread)."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


def _call(fn, **available):
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return _run(fn(**available))
    return _run(fn(**{k: v for k, v in available.items() if k in params}))


def _as_messages(out) -> list[dict]:
    if isinstance(out, str):
        return [{"role": "user", "content": out}]
    if isinstance(out, dict):
        return [out]
    return [dict(m) for m in (out or [])]


class VerifiersAdapter:
    """An asyncrl environment over a verifiers-style environment object (see the module docstring)."""

    def __init__(self, vf_env: Any, *, name: str, limits: EnvLimits | None = None):
        self.vf, self.name = vf_env, name
        turns = getattr(vf_env, "max_turns", None)
        base = limits or EnvLimits()
        self.limits = EnvLimits(max_turns=turns if isinstance(turns, int) and turns > 0 else base.max_turns,
                                max_env_tokens=base.max_env_tokens, max_total_tokens=base.max_total_tokens,
                                step_timeout_s=base.step_timeout_s)

    def records(self) -> list[dict]:
        """The environment's dataset rows as asyncrl records (write them to JSONL for `--task env:<name>:...`)."""
        return [{k: row[k] for k in ("prompt", "answer", "info", "task") if k in row} for row in self.vf.dataset]

    def reset(self, record: dict, seed: int) -> Reset:
        prompt = record["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        system = getattr(self.vf, "system_prompt", None)
        if system and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": system})
        state = {"prompt": messages, "completion": [], "answer": record.get("answer", ""),
                 "info": record.get("info", {}), "task": record.get("task", ""), "seed": seed, "turn": 0}
        return Reset(messages, state)

    def _completed(self, state: dict) -> bool:
        if state.get("done"):
            return True
        check = getattr(self.vf, "is_completed", None)
        if check is None:
            return False
        messages = state["prompt"] + state["completion"]
        try:
            return bool(_run(check(messages, state)))
        except TypeError:  # newer signature: is_completed(state)
            return bool(_run(check(state)))

    def step(self, state: dict, assistant: str) -> StepResult:
        state["completion"].append({"role": "assistant", "content": assistant})
        state["turn"] += 1
        if self._completed(state):
            return StepResult([], done=True)
        out = _run(self.vf.env_response(state["prompt"] + state["completion"], state))
        if isinstance(out, tuple):  # older releases: (messages, state)
            out, new_state = out
            if isinstance(new_state, dict) and new_state is not state:
                state.update(new_state)
        messages = _as_messages(out)
        state["completion"] += messages
        return StepResult(messages, done=self._completed(state))

    def final_reward(self, state: dict) -> float:
        rubric = self.vf.rubric
        funcs = rubric.get_reward_funcs() if hasattr(rubric, "get_reward_funcs") else list(rubric.funcs)
        weights = (rubric.get_reward_weights() if hasattr(rubric, "get_reward_weights")
                   else list(getattr(rubric, "weights", None) or [1.0] * len(funcs)))
        available = {"prompt": state["prompt"], "completion": state["completion"], "answer": state["answer"],
                     "state": state, "info": state["info"], "task": state["task"]}
        return float(sum(w * float(_call(f, **available)) for f, w in zip(funcs, weights)))
