"""Poison reports from a run's first step on: the policy still learns, and no record is retired (issue 43, class 1).

The package swarm's "poison reports" row (test_hostile.py) measures what the reports cost honest volunteers in
a run whose reward has long saturated (the built-in task is learned within a minute). This test gives the
attack the whole learning curve instead: its own coordinator, 8 Sybil keys that lease what they may and report
every lease unscorable, round after round, starting before the honest volunteer's first batch and running
until the run has taken STEPS optimizer steps. The reward of the built-in task (~0.01 for the random policy)
must still rise, and the reports must retire none of the task's records (keys without accepted batches
together weigh as one reporter and never retire a record alone: coordinator/leasing/taskboard.py).
That a record set retired by reports comes back on `--resume` is tests/coordinator/leasing/test_poison_prompts.py's.
"""

from __future__ import annotations

import threading
from collections import Counter
from statistics import fmean

import pytest

from asyncrl.protocol.errors import ProtocolError
from asyncrl.protocol.identity import Identity
from asyncrl.runlog import read_events

from tests.adversarial.swarm import COORDINATOR_FLAGS, Mallory, Swarm, read_json, sealed_request, wait_for
from tests.conftest import wait_for_join
from tests.harness import COORDINATOR, volunteer_args

pytestmark = pytest.mark.integration

SYBILS = 8
STEPS = 100  # the built-in task's reward rises from ~0.01 over its first ~100 steps of 8 groups (docs/toy-task.md)
EDGE = 15  # steps averaged at each end of the curve
RISE = 0.3  # the reward of the last EDGE steps over the first EDGE steps' at least this much


def test_the_policy_learns_while_sybil_keys_report_every_prompt_unscorable(procs, tmp_path):
    run = tmp_path / "run"
    coord = procs.start("coordinator", [*COORDINATOR, "--model", "tiny", "--run-dir", str(run), *COORDINATOR_FLAGS])
    swarm = Swarm(root=tmp_path, run=run, join=wait_for_join(run, 240, coord), coordinator_pid=coord.pid,
                  honest={"alice": tmp_path / "alice"})
    mallory = Mallory(swarm)
    keys = [Identity.generate() for _ in range(SYBILS)]
    codes: list[str] = []
    stop = threading.Event()

    def report_all() -> None:  # every round: each key leases what it may and reports all of it unscorable
        while not stop.is_set():
            for k in keys:
                try:
                    ids = tuple(lease.lease_id for lease in mallory.lease_once(k, 4).leases)
                    if ids:
                        mallory.call("lease", sealed_request(swarm, k, unscorable=ids))
                    codes.extend(["REPORTED"] * len(ids) or ["WAIT"])
                except ProtocolError as exc:
                    codes.append(exc.code.value)
            stop.wait(0.5)

    attacker = threading.Thread(target=report_all, name="sybil-reports", daemon=True)
    attacker.start()
    try:
        wait_for(lambda: codes.count("REPORTED") >= SYBILS, 120, "the Sybil keys' first reports")
        assert not read_events(run, "step"), "the attack must start before the first optimizer step"
        procs.start("alice", volunteer_args(swarm.join, swarm.honest["alice"], name="alice", seed=1, quiet=True))
        wait_for(lambda: len(read_events(run, "step")) >= STEPS, 600, f"{STEPS} optimizer steps under the reports")
    finally:
        stop.set()
        attacker.join(30)
        mallory.close()
    rewards = [float(e["reward_mean"]) for e in read_events(run, "step")]
    first, last = fmean(rewards[:EDGE]), fmean(rewards[-EDGE:])
    reported = codes.count("REPORTED")
    trust = wait_for(lambda: read_json(run / "trust.json"), 60, "trust.json")
    retired = (trust.get("books") or {}).get("prompts_retired", 0)
    alice = swarm.honest_view()["alice"]
    print(f"poison from the first step: {reported} leases reported unscorable by {SYBILS} Sybil keys over "
          f"{len(rewards)} steps; reward {first:.3f} (first {EDGE} steps) -> {last:.3f} (last {EDGE}); "
          f"records retired {retired}; alice acked {alice['acked']}, rejected {alice['coordinator_rejected']}")
    assert reported >= 4 * SYBILS, Counter(codes)
    assert last >= first + RISE, rewards
    assert retired == 0, trust.get("books")
    assert alice["acked"] > 0 and not alice["coordinator_rejected"] and not alice["client_rejected"], alice
