"""Episodes as interleaved segments: one state machine that the volunteer drives and the coordinator replays.

A transcript is the token sequence after the prompt: model segments (sampled, with log-probs) and
environment segments (rendered by envs/render.py, log-prob 0.0, `env_mask` 1). `Session.add_model_turn`
is the one transition both sides run, so the rules below hold by construction:

  * each model turn has at most min(max_new_tokens, tokens left under `max_total_tokens`) tokens, no stop
    token before its end; a turn that does not end on a stop token ended at that cap and ends the episode
    (finish "length");
  * otherwise the environment steps on the decoded turn; the episode ends when it says done, at
    `max_turns`, or when its next turn would pass `max_env_tokens` / leave no room under `max_total_tokens`
    (finish "stop") — that turn is then not in the transcript;
  * otherwise its rendered tokens follow, and the model answers again.
Reward = the environment's step rewards + its final reward.

`replay` walks a claimed transcript through the same session and raises `EpisodeMismatch` at the first
difference (an environment token that is not what the environment says, a turn dropped or added, model
tokens marked as environment tokens, a transcript cut short or run past its end); ingest answers ENV_MISMATCH.
Environment calls run under `step_timeout_s` (`guarded`); a failure is `EnvError`: no verdict on anyone.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .base import EnvError, Environment, Reset
from .render import Renderer


class EpisodeMismatch(Exception):
    """The claimed transcript is not what this environment produces (ingest: ENV_MISMATCH, a strike)."""


def seed_for(prompt_id: str) -> int:
    """The episode seed of a leased prompt: every completion of a group starts from the same state, and the
    coordinator knows it without being told."""
    return int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:8], "little")


def record_of(columns: str, answer: str) -> dict:
    """The task record an environment is reset with: the lease's columns (canonical JSON), else {"answer"}."""
    if columns:
        obj = json.loads(columns)
        if isinstance(obj, dict):
            return obj
    return {"answer": answer}


def guarded(fn: Callable, *args, timeout_s: float) -> Any:
    """fn(*args) with a wall-clock limit. A call past it, or one that raises, is an `EnvError`. The call runs
    on a daemon thread; one that hangs is left behind (Python cannot stop a thread), its result ignored."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - any failure of the environment is its own
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True, name="asyncrl-env-step")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise EnvError(f"{getattr(fn, '__qualname__', fn)} did not return within {timeout_s} s")
    if "error" in box:
        raise EnvError(f"{getattr(fn, '__qualname__', fn)} raised {type(box['error']).__name__}: {box['error']}")
    return box["value"]


@dataclass
class Session:
    env: Environment
    renderer: Renderer
    record: dict
    seed: int
    stop_token_ids: tuple[int, ...]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    turns: int = 0
    env_tokens: int = 0
    reward: float = 0.0
    done: bool = False
    finish_reason: str = ""

    def __post_init__(self):
        self.limits = self.env.limits
        opened: Reset = guarded(self.env.reset, self.record, self.seed, timeout_s=self.limits.step_timeout_s)
        if not isinstance(opened, Reset):
            raise EnvError("reset must return envs.Reset")
        self.state, self.tools = opened.state, list(opened.tools)
        self.history = list(opened.messages)
        self.prompt_ids = self.renderer.prompt_ids(self.history, self.tools)

    def turn_cap(self) -> int:
        return min(self.max_new_tokens, self.limits.max_total_tokens - len(self.tokens))

    def context(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def _end(self, finish: str) -> None:
        self.done, self.finish_reason = True, finish
        final = guarded(self.env.final_reward, self.state, timeout_s=self.limits.step_timeout_s)
        self.reward += float(final)

    def add_model_turn(self, ids: Sequence[int], logprobs: Sequence[float] | None = None) -> list[int]:
        """Append one model turn; returns the environment tokens that now follow ([] when the episode ended)."""
        ids = [int(t) for t in ids]
        if self.done:
            raise EpisodeMismatch("a model turn after the episode ended")
        cap = self.turn_cap()
        if not 1 <= len(ids) <= cap:
            raise EpisodeMismatch(f"model turn {self.turns + 1} has {len(ids)} tokens (allowed 1..{cap})")
        stops = set(self.stop_token_ids)
        if any(t in stops for t in ids[:-1]):
            raise EpisodeMismatch(f"model turn {self.turns + 1} goes on after a stop token")
        self.tokens += ids
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.env_mask += [0] * len(ids)
        self.turns += 1
        if ids[-1] not in stops:
            if len(ids) != cap:
                raise EpisodeMismatch(f"model turn {self.turns} ends without a stop token before its cap {cap}")
            self._end("length")
            return []
        text = self.renderer.assistant_text(ids)
        result = guarded(self.env.step, self.state, text, timeout_s=self.limits.step_timeout_s)
        self.reward += float(result.reward)
        self.history.append({"role": "assistant", "content": text})
        if result.done or self.turns >= self.limits.max_turns:
            self._end("stop")
            return []
        env_ids = self.renderer.env_ids(self.history, result.messages, self.tools)
        if (not env_ids or self.env_tokens + len(env_ids) > self.limits.max_env_tokens
                or len(self.tokens) + len(env_ids) >= self.limits.max_total_tokens):
            self._end("stop")
            return []
        self.history += result.messages
        self.tokens += env_ids
        self.logprobs += [0.0] * len(env_ids)
        self.env_mask += [1] * len(env_ids)
        self.env_tokens += len(env_ids)
        return env_ids


def segments(env_mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, end, is_env) runs of the mask."""
    out, start = [], 0
    for i in range(1, len(env_mask) + 1):
        if i == len(env_mask) or env_mask[i] != env_mask[start]:
            out.append((start, i, int(env_mask[start])))
            start = i
    return out


def replay(env: Environment, renderer: Renderer, *, record: dict, seed: int, prompt_ids: Sequence[int],
           tokens: Sequence[int], env_mask: Sequence[int], stop_token_ids: tuple[int, ...],
           max_new_tokens: int) -> Session:
    """Re-run the environment over a claimed transcript; the finished `Session` (reward, finish_reason) or
    `EpisodeMismatch` at the first difference (`EnvError` when the environment itself fails here)."""
    session = Session(env, renderer, record, seed, tuple(stop_token_ids), max_new_tokens)
    if list(prompt_ids) != session.prompt_ids:
        raise EpisodeMismatch("prompt tokens are not the environment's opening")
    if len(env_mask) != len(tokens):
        raise EpisodeMismatch("env_mask must have one entry per token")
    tokens = [int(t) for t in tokens]
    runs = segments(env_mask) if len(tokens) else []
    if not runs or runs[0][2] != 0:
        raise EpisodeMismatch("a transcript starts with a model turn")
    expected: list[int] = []
    for start, end, is_env in runs:
        part = tokens[start:end]
        if is_env:
            if part != expected:
                raise EpisodeMismatch(f"environment turn {session.turns} differs from the environment's "
                                      f"({len(part)} tokens claimed, {len(expected)} expected)")
            expected = []
            continue
        if expected:
            raise EpisodeMismatch(f"environment turn {session.turns} is missing")
        if session.done:
            raise EpisodeMismatch("the transcript goes on after the episode ended")
        expected = session.add_model_turn(part)
    if not session.done:
        raise EpisodeMismatch(f"the transcript stops after turn {session.turns}, before the episode ended")
    return session


TurnGenerator = Callable[[list[list[int]], list[int]], list[tuple[list[int], list[float]]]]
"""(contexts, per-context max_new_tokens) -> one (token ids, sampling log-probs) per context."""


def run_episodes(env: Environment, renderer: Renderer, starts: list[tuple[dict, int]], generate: TurnGenerator,
                 *, stop_token_ids: tuple[int, ...], max_new_tokens: int) -> list[Session]:
    """The volunteer's side: every episode advanced turn by turn, all live ones batched per turn (each turn
    re-prefills its context: engines without a prefix cache pay that; vLLM's prefix cache reuses it)."""
    sessions = [Session(env, renderer, rec, seed, tuple(stop_token_ids), max_new_tokens) for rec, seed in starts]
    while True:
        live = [s for s in sessions if not s.done]
        if not live:
            return sessions
        outs = generate([s.context() for s in live], [s.turn_cap() for s in live])
        for s, (ids, lps) in zip(live, outs):
            s.add_model_turn(ids, lps)
