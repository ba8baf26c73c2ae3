"""Verifiable rewards shared by the coordinator (re-verification) and the client (scoring).

Rewards are pure functions `(completion_text, answer) -> float in [0, 1]` looked up by name in one
registry, so the coordinator can recompute exactly what a volunteer claims. Built-ins register
through the same `asyncrl.rewards` entry-point group a third-party package uses (pyproject.toml).
"""

from __future__ import annotations

from typing import Callable

from .toy import repeat_reward

RewardFn = Callable[[str, str], float]


def exact_reward(completion: str, answer: str) -> float:
    """1.0 when the stripped completion equals the stripped answer, else 0.0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def math_reward(completion: str, answer: str) -> float:
    """math-verify equivalence of the completion's final answer and `answer` (in a time-limited worker)."""
    from .math_reward import math_reward as verify

    return verify(completion, answer)


REWARDS: dict[str, RewardFn] = {"repeat": repeat_reward, "exact": exact_reward, "math": math_reward}


class UnknownReward(KeyError):
    pass


def get_reward(name: str) -> RewardFn:
    """Built-in rewards, then third-party ones from the `asyncrl.rewards` entry-point group."""
    if name in REWARDS:
        return REWARDS[name]
    from importlib.metadata import entry_points

    for ep in entry_points(group="asyncrl.rewards"):
        if ep.name == name:
            fn = ep.load()
            REWARDS[name] = fn
            return fn
    raise UnknownReward(f"unknown reward {name!r}; built-in: {sorted(REWARDS)}")


def score(reward: str, completion: str, answer: str) -> float:
    """Score and clamp into [0, 1] (a third-party reward must not push a batch out of range)."""
    value = float(get_reward(reward)(completion, answer))
    if value != value:  # NaN
        return 0.0
    return min(1.0, max(0.0, value))
