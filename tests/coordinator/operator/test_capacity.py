"""CapacityMeter (coordinator/operator/capacity.py): the learner's idle fraction and the capacity rule against
hand-computed figures, with a fast and a deliberately slow volunteer (a fake clock: no wall time)."""

from __future__ import annotations

import pytest

from asyncrl.coordinator.operator.capacity import CapacityMeter, capacity_line


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_a_slow_swarm_leaves_the_learner_idle_and_says_how_many_more_volunteers_it_needs():
    clock = Clock()
    meter = CapacityMeter(samples_per_step=64, group_size=16, clock=clock)  # 4 groups of 16 per step
    assert meter.snapshot()["learner_idle_fraction"] is None  # nothing measured yet
    for _ in range(6):  # over 60 s: fast delivers 2 groups (32 rollouts) every 10 s, slow 1 group every 30 s
        clock.t += 10
        meter.accepted("fast", 2)
    clock.t -= 60
    for _ in range(2):
        clock.t += 30
        meter.accepted("slow", 1)
    meter.learner_step(wait_s=6.0, step_s=2.0, groups=4, stale_dropped=1)  # waited 6 s for data, stepped 2 s
    cap = meter.snapshot()
    rates = cap["volunteer_rollouts_per_s"]
    # the first accepted batch starts a volunteer's clock: fast 5 x 32 rollouts in 50 s, slow 1 x 16 in 30 s
    assert rates["fast"] == pytest.approx(5 * 32 / 50, abs=1e-3) and rates["slow"] == pytest.approx(16 / 30, abs=1e-3)
    assert cap["learner_idle_fraction"] == pytest.approx(0.75) and cap["keeps_learner_busy"] is False
    assert cap["rollouts_needed_per_s"] == pytest.approx(32.0)  # 64 samples per 2 s step
    effective = (3.2 + 16 / 30) * 0.75  # a quarter of what arrived went stale
    assert cap["swarm_rollouts_per_s"] == pytest.approx(effective, abs=1e-3)
    per = (3.2 + 16 / 30) / 2 * 0.75
    assert cap["more_volunteers_needed"] == 21  # ceil((32 - 2.8) / 1.4): volunteers like the two seen
    assert "does NOT keep the learner busy" in capacity_line(cap) and "more volunteers" in capacity_line(cap)


def test_a_swarm_that_keeps_up_needs_no_one_more():
    clock = Clock()
    meter = CapacityMeter(samples_per_step=32, group_size=16, clock=clock)
    for _ in range(10):
        clock.t += 1
        meter.accepted("fast", 2)  # 32 rollouts/s
    meter.learner_step(wait_s=0.05, step_s=2.0, groups=2, stale_dropped=0)
    cap = meter.snapshot()
    assert cap["keeps_learner_busy"] and cap["more_volunteers_needed"] == 0
    assert "keeps the learner busy" in capacity_line(cap)
