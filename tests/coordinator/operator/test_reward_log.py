"""TRL-like reward observability (coordinator/operator/reward_log.py): per-reward mean/std over a step's completions
with None left out (TRL's nanmean / nanstd), the sampled-completions log, reported reward errors."""

from __future__ import annotations

import json
import math

from asyncrl.coordinator.learner.learner import TrainGroup
from asyncrl.coordinator.operator.metrics import RunStats
from asyncrl.coordinator.operator.reward_log import CompletionLog, RewardErrors, per_reward_table, reward_stats
from asyncrl.models import tinymodel


def group(per_reward, rewards, comps=((1, 2), (3,))):
    return TrainGroup([5, 6], [list(c) for c in comps], [[0.0] * len(c) for c in comps], rewards, version=3,
                      client="alice", per_reward=per_reward)


def test_per_reward_mean_and_std_leave_none_out():
    groups = [group({"acc": [1.0, None], "fmt": [0.0, 1.0]}, [1.0, 1.0]),
              group({"acc": [0.0, 1.0], "fmt": [None, None]}, [0.0, 1.0])]
    got = reward_stats(groups)
    assert got["rewards/acc/mean"] == 2 / 3 and math.isclose(got["rewards/acc/std"], math.sqrt(1 / 3))
    assert got["rewards/fmt/mean"] == 0.5 and math.isclose(got["rewards/fmt/std"], math.sqrt(0.5))
    assert per_reward_table(got) == {"acc": {"mean": got["rewards/acc/mean"], "std": got["rewards/acc/std"]},
                                     "fmt": {"mean": 0.5, "std": got["rewards/fmt/std"]}}
    stats = RunStats(group_size=2)
    stats.observe("step", {"step": 1, "reward_mean": 0.75, **got})
    assert stats.snapshot()["per_reward"]["acc"]["mean"] == 2 / 3  # what the dashboard's table shows


def test_completions_are_logged_every_n_steps_spread_over_the_prompts(tmp_path):
    log = CompletionLog(tmp_path / "completions.jsonl", tinymodel.build_tokenizer(), every=2, count=3)
    groups = [group({"acc": [1.0, None]}, [1.0, 0.0]), group({"acc": [0.0, 1.0]}, [0.0, 1.0])]
    assert log.after_step(1, groups) == [] and not (tmp_path / "completions.jsonl").exists()
    rows = log.after_step(2, groups)
    assert [(r["reward"], r["rewards"]["acc"]) for r in rows] == [(1.0, 1.0), (0.0, 0.0), (0.0, None)]
    assert [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()] == rows
    assert log.latest() == rows and rows[0]["step"] == 2 and rows[0]["client"] == "alice"


def test_reward_errors_keep_the_newest_first_and_count_all():
    errors = RewardErrors(keep=2, clock=lambda: 5.0)
    for i in range(3):
        errors.add("alice", f"error {i}", 1)
    snap = errors.snapshot()
    assert snap["total"] == 3 and [e["error"] for e in snap["recent"]] == ["error 2", "error 1"]
