"""Tasks and verifiable rewards shared by coordinator (re-verification) and client (scoring).

A task source yields `Prompt`s; each names the reward that scores it. Rewards are pure functions
`(completion_text, answer) -> float in [0, 1]` looked up by name in one registry, so the coordinator
can recompute exactly what a volunteer claims.

Built-in toy task `repeat` (see docs/toy-task.md for why a random-init model learns it):
prompt "rep:x=" for a letter x; the completion should be x repeated; the reward is the fraction of
the first `REPEAT_LEN` completion characters equal to x (partial credit, so every group of a random
policy already has reward variance and GRPO's group-relative advantage is non-zero from step one).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterator

RewardFn = Callable[[str, str], float]

REPEAT_LEN = 8
REPEAT_LETTERS = "abcd"


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str
    answer: str
    reward: str


def repeat_reward(completion: str, answer: str) -> float:
    """Fraction of the first REPEAT_LEN characters of `completion` equal to `answer` (one char)."""
    if len(answer) != 1:
        return 0.0
    head = completion[:REPEAT_LEN]
    return sum(1 for ch in head if ch == answer) / REPEAT_LEN


def exact_reward(completion: str, answer: str) -> float:
    """1.0 when the stripped completion equals the stripped answer, else 0.0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def math_reward(completion: str, answer: str) -> float:
    """math-verify equivalence of the completion's final answer and `answer` (in a time-limited worker)."""
    from asyncrl.math_reward import math_reward as verify

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


def repeat_task(seed: int = 0) -> Iterator[Prompt]:
    """Endless stream of `repeat` prompts with unique ids."""
    rng = random.Random(seed)
    i = 0
    while True:
        letter = rng.choice(REPEAT_LETTERS)
        yield Prompt(prompt_id=f"repeat-{seed}-{i}", text=f"rep:{letter}=", answer=letter, reward="repeat")
        i += 1


TASKS: dict[str, Callable[[int], Iterator[Prompt]]] = {"repeat": repeat_task}


def get_task(name: str, seed: int = 0) -> Iterator[Prompt]:
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; built-in: {sorted(TASKS)}")
    return TASKS[name](seed)
