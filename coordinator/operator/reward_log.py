"""What the operator sees of the rewards, as TRL's GRPOTrainer logs them.

  reward_stats     per reward function, the mean and std of its values over a step's completions (None =
                   "not applicable" left out, as TRL's nanmean/nanstd do): `rewards/<name>/mean` and
                   `rewards/<name>/std` in the step event (metrics.jsonl, dashboard, trackers)
  CompletionLog    every `log_completions_every` steps, `log_completions_count` of the step's completions
                   with their prompt, total reward and each function's value, appended to
                   `<run_dir>/completions.jsonl` and kept (the latest table) for the dashboard
  RewardErrors     what volunteers report their reward functions raised (LeaseRequest.reward_error): the
                   most recent ones, for the dashboard and the `reward_error` event

The learner trains on each completion's weighted total (`TrainGroup.rewards`); these only report.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from pathlib import Path

TEXT_CHARS = 2000  # longest prompt / completion text kept per logged sample


def reward_stats(groups) -> dict[str, float]:
    """{"rewards/<name>/mean": m, "rewards/<name>/std": s} over every completion of `groups` (TRL's keys);
    std is the sample std (n - 1, TRL's nanstd), 0.0 for a single value; a reward with no value is left out."""
    values: dict[str, list[float]] = {}
    for g in groups:
        for name, vals in (getattr(g, "per_reward", None) or {}).items():
            values.setdefault(name, []).extend(float(v) for v in vals if v is not None)
    out = {}
    for name, vs in values.items():
        if not vs:
            continue
        mean = sum(vs) / len(vs)
        var = sum((v - mean) ** 2 for v in vs) / (len(vs) - 1) if len(vs) > 1 else 0.0
        out[f"rewards/{name}/mean"] = mean
        out[f"rewards/{name}/std"] = math.sqrt(var)
    return out


def per_reward_table(fields: dict) -> dict[str, dict[str, float]]:
    """{name: {"mean", "std"}} from a step event's flat `rewards/<name>/<stat>` keys."""
    table: dict[str, dict[str, float]] = {}
    for key, value in fields.items():
        if key.startswith("rewards/") and key.count("/") >= 2:
            name, stat = key[len("rewards/"):].rsplit("/", 1)
            table.setdefault(name, {})[stat] = value
    return table


class CompletionLog:
    """Samples of completions with their rewards, every `every` steps (0 = never)."""

    def __init__(self, path: Path, tokenizer, *, every: int, count: int):
        self.path, self.tokenizer, self.every, self.count = Path(path), tokenizer, every, count
        self._lock = threading.Lock()
        self._latest: list[dict] = []

    def after_step(self, step: int, groups) -> list[dict]:
        """Log `count` completions of this step's `groups` (spread over the groups) when `step` is due."""
        if not self.every or step % self.every or not groups:
            return []
        picks, i = [], 0
        while len(picks) < self.count and i < max(len(g.completions) for g in groups):
            for g in groups:  # the i-th completion of each group, then the (i+1)-th: several prompts shown
                if i < len(g.completions) and len(picks) < self.count:
                    picks.append((g, i))
            i += 1
        rows = []
        for g, i in picks:
            decode = lambda ids: self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=True)[:TEXT_CHARS]
            rows.append({"step": step, "version": g.version, "client": g.client,
                         "prompt": decode(g.prompt_ids), "completion": decode(g.completions[i]),
                         "reward": float(g.rewards[i]),
                         "rewards": {name: vals[i] for name, vals in (g.per_reward or {}).items()}})
        with open(self.path, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        with self._lock:
            self._latest = rows
        return rows

    def latest(self) -> list[dict]:
        with self._lock:
            return list(self._latest)


class RewardErrors:
    """The most recent reward errors volunteers reported, newest first, and how many in all."""

    def __init__(self, keep: int = 20, clock=time.time):
        self._recent: deque[dict] = deque(maxlen=keep)
        self.total = 0
        self._lock = threading.Lock()
        self.clock = clock

    def add(self, client: str, error: str, leases: int) -> dict:
        row = {"t": self.clock(), "client": client, "error": error, "leases": leases}
        with self._lock:
            self._recent.appendleft(row)
            self.total += 1
        return row

    def snapshot(self) -> dict:
        with self._lock:
            return {"total": self.total, "recent": list(self._recent)}
