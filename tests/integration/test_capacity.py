"""The operator's capacity figures (coordinator/operator/capacity.py) against a real swarm with a deliberately slow
volunteer: `slow` takes 3 s more per leased prompt (ASYNCRL_FAULT=slow-prompt:3) beside a normal `fast` one,
and the learner wants 8 groups per step. The dashboard's /api/status must say the learner waits (idle), that
the swarm does not keep it busy, how many more volunteers it would take, and measure `slow` below `fast`."""

from __future__ import annotations

import json
import urllib.request

import pytest

from asyncrl.runlog import read_events

from tests.conftest import wait_for
from tests.harness import start_coordinator, start_volunteer, volunteer_args

pytestmark = pytest.mark.integration


def _capacity(url) -> dict:
    with urllib.request.urlopen(url + "api/status", timeout=30) as resp:
        return json.loads(resp.read())["capacity"]


def test_a_slow_swarm_shows_an_idle_learner_and_the_volunteers_it_lacks(procs, tmp_path):
    run = tmp_path / "run"
    coord = start_coordinator(procs, run, no_dashboard=False, groups_per_step=8, min_groups=8, max_wait_s=60,
                              group_size=4, prompts_per_lease=2, max_inflight_groups=16, new_key_share=1.0)
    url = wait_for(lambda: (run / "dashboard.txt").exists() and (run / "dashboard.txt").read_text().strip(), 60,
                   "dashboard.txt")
    start_volunteer(procs, coord.join, tmp_path / "fast", name="fast", prompts_per_batch=2, fixed_lease_size=True)
    procs.start("slow", volunteer_args(coord.join, tmp_path / "slow", name="slow", prompts_per_batch=2,
                                       fixed_lease_size=True), env={"ASYNCRL_FAULT": "slow-prompt:3"})

    def measured():
        cap = _capacity(url)
        rates = cap.get("volunteer_rollouts_per_s") or {}
        return cap if len(read_events(run, "step")) >= 2 and {"fast", "slow"} <= set(rates) else None

    cap = wait_for(measured, 400, "two learner steps and a measured rate for both volunteers")
    rates = cap["volunteer_rollouts_per_s"]
    assert rates["slow"] < rates["fast"], cap  # 3 s per prompt shows, whatever this machine's speed
    assert cap["learner_idle_fraction"] > 0.5 and cap["keeps_learner_busy"] is False, cap  # it waits for data
    assert cap["rollouts_needed_per_s"] > cap["swarm_rollouts_per_s"] and cap["more_volunteers_needed"] >= 1, cap
