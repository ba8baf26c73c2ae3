"""`Prompt`: one task record as the task board leases it and both sides score it.

`text` is what the engine is given (chat-templated where the source asks for it); `answer` feeds the
simple `(completion, answer)` rewards; `reward` is a reward spec (tasks/rewards.py: one name or a weighted
sum such as "accuracy+0.5*format"); `columns` is the record as TRL reward functions see it — canonical
JSON of {"prompt": <the dataset's prompt: a string or a list of messages>, <every other column>} —
or "" for the built-in toy tasks. The lease carries it verbatim, so the volunteer and the coordinator
call a reward with the same kwargs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str
    answer: str
    reward: str
    columns: str = ""
