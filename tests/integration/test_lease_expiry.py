"""A volunteer SIGKILLed while holding leases: they expire, its prompts go to the other volunteer, training
continues, and the task board's books balance (every leased prompt trained, re-leased or dropped)."""

from __future__ import annotations

import json
import signal

import pytest

from asyncrl.protocol import messages
from asyncrl.runlog import read_events

from tests.conftest import wait_for
from tests.harness import start_coordinator, start_volunteer

pytestmark = pytest.mark.integration


def _events(run, kind):
    return read_events(run, kind)


def test_killed_volunteers_prompts_are_released_and_trained(procs, tmp_path):
    run = tmp_path / "run"
    started = start_coordinator(procs, run, groups_per_step=2, min_groups=1, max_wait_s=1, prompts_per_lease=2,
                                group_size=8, lease_timeout_s=15, max_staleness=-1)
    coord, join = started.proc, started.join

    def volunteer(name, data, **opts):
        # the victim holds two leases from its first grant on (no one-prompt probe)
        return start_volunteer(procs, join, data, name=name, prompts_per_batch=2, fixed_lease_size=True, **opts)

    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    (victim_dir / "HOLD_UPLOADS").write_text("its batches stay unsent until it is killed\n")
    # works on, uploads nothing (tests/fault_volunteer.py): its leases die with it
    victim = volunteer("victim", victim_dir, fault="hold-uploads")
    wait_for(lambda: any((victim_dir / "outbox").glob("*.payload")), 240, "the victim to finish generating")
    procs.signal(victim, signal.SIGKILL)
    victim.wait(10)
    spooled = [p.read_bytes() for p in (victim_dir / "outbox").glob("*.payload")]  # payloads: sealed at upload
    lost = {g.prompt_id for b in spooled for g in messages.decode_rollout_batch(b, max_bytes=1 << 20).groups}
    assert len(lost) == 2 * len(spooled) >= 2  # two prompts per batch, each batch unsent

    volunteer("survivor", tmp_path / "survivor")

    def lost_prompts_trained() -> bool:  # answered by the survivor, and that batch went through a step
        trained = {i for e in _events(run, "step") for i in e["batch_ids"]}
        answered = {p: e for e in _events(run, "batch") for p in e["prompt_ids"]}
        return all(p in answered and answered[p]["client"] == "survivor" and answered[p]["batch_id"] in trained
                   for p in lost)

    wait_for(lost_prompts_trained, 400, "the killed volunteer's prompts to be re-leased and trained")
    wait_for(lambda: len(_events(run, "step")) >= 4, 200, "training to go on")
    coord.send_signal(signal.SIGTERM)  # the operator stops it: final checkpoint + summary
    assert coord.wait(120) == 0, coord.log_path.read_text()[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    leases = summary["leases"]
    assert leases["expired"] >= 2 and leases["released"] >= 2, leases
    assert summary["leases_balanced"], leases
