"""The built-in toy task `repeat` (see docs/toy-task.md for why a random-init model learns it).

Prompt "rep:x=" for a letter x; the completion should be x repeated; the reward is the fraction of
the first `REPEAT_LEN` completion characters equal to x (partial credit, so every group of a random
policy already has reward variance and GRPO's group-relative advantage is non-zero from step one).
"""

from __future__ import annotations

import random
from typing import Callable, Iterator

from .prompt import Prompt

REPEAT_LEN = 8
REPEAT_LETTERS = "abcd"


def repeat_reward(completion: str, answer: str) -> float:
    """Fraction of the first REPEAT_LEN characters of `completion` equal to `answer` (one char)."""
    if len(answer) != 1:
        return 0.0
    head = completion[:REPEAT_LEN]
    return sum(1 for ch in head if ch == answer) / REPEAT_LEN


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
