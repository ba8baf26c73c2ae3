"""Task records -> leased `Prompt`s for an environment (what the coordinator's task board hands out).

A prompt for an episode carries: `reward` = "env:<name>" (ingest then replays instead of re-scoring one
answer), `columns` = the record as canonical JSON (both sides reset the environment from it), `text` = the
environment's opening rendered through the tokenizer's chat template, for the seed its prompt id gives
(envs/episode.py `seed_for`), so the lease's prompt tokens are the episode's opening on both sides.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Iterator

from asyncrl.tasks import Prompt
from asyncrl.tasks.sources import TaskSource, TaskSourceError

from .base import ENV_PREFIX, UnknownEnv, get_env
from .episode import guarded, seed_for
from .render import Renderer


def episode_prompt(name: str, record: dict, prompt_id: str, tokenizer) -> Prompt:
    env = get_env(name)
    opened = guarded(env.reset, record, seed_for(prompt_id), timeout_s=env.limits.step_timeout_s)
    text = Renderer(tokenizer).prompt_text(opened.messages, opened.tools)
    columns = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return Prompt(prompt_id, text, str(record.get("answer", "")), ENV_PREFIX + name, columns)


def read_records(path: str | Path) -> list[dict]:
    """A JSONL file of records (one JSON object per line; blank lines skipped)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: a record must be a JSON object")
            out.append(obj)
    return out


class EnvSource(TaskSource):
    """`--task env:<name>[:<records.jsonl>]`: the records in order, forever (prompt `i` plays record
    i mod n with the seed of its id `<name>-<run seed>-<i>`), resumable by index like every task source.
    An environment that needs no record (echo) runs on `[{}]`."""

    def __init__(self, name: str, records: list[dict], tokenizer, seed: int = 0):
        super().__init__()
        if not records:
            raise TaskSourceError(f"environment {name!r}: no records")
        # env_records, not `records`: other task sources' `records` are leased Prompts (coordinator/service.py)
        self.env, self.env_records, self.tokenizer, self.seed = name, records, tokenizer, seed
        self.name = f"env_{name}"
        self.limits = get_env(name).limits

    def _prompt(self, index: int) -> Prompt:
        return episode_prompt(self.env, self.env_records[index % len(self.env_records)], f"{self.env}-{self.seed}-{index}",
                              self.tokenizer)


def open_env_source(spec: str, *, seed: int, tokenizer) -> EnvSource:
    """`env:<name>` or `env:<name>:<path.jsonl>` (TaskSourceError names what is wrong)."""
    name, _, path = spec[len(ENV_PREFIX):].partition(":")
    try:
        get_env(name)
        records = read_records(path) if path else [{}]
    except (UnknownEnv, OSError, ValueError) as exc:
        raise TaskSourceError(f"task {spec!r}: {exc}") from None
    return EnvSource(name, records, tokenizer, seed)


def episode_prompts(name: str, records: list[dict], tokenizer, *, run_seed: int = 0) -> Iterator[Prompt]:
    """The records, round after round, as prompts: ids `<name>-<round>-<index>`, so each round plays every
    record with fresh seeds (records = [{}] for an environment that needs none, such as `echo`)."""
    for rnd in itertools.count():
        for i, record in enumerate(records):
            yield episode_prompt(name, record, f"{name}-{run_seed}-{rnd}-{i}", tokenizer)
