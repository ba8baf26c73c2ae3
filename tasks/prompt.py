"""`Prompt`: one task record as the task board leases it and both sides score it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str
    answer: str
    reward: str
