"""A pipelined volunteer SIGKILLed while it holds several spooled, unacked batches (and, being pipelined,
leases fetched ahead) loses no batch: the outbox on disk is the only place a finished batch lives until it
is acked, so on restart every one of them is uploaded and accepted exactly once."""

from __future__ import annotations

import json
import signal

import pytest

from asyncrl.runlog import read_events

from tests.conftest import wait_for
from tests.harness import start_coordinator, volunteer_args, with_fault

pytestmark = pytest.mark.integration


def _batch_events(run):
    return read_events(run, "batch")


def test_a_killed_pipelined_volunteer_keeps_every_unacked_batch(procs, tmp_path):
    run = tmp_path / "run"
    # the scenario is a restart within the lease (expiry: test_lease_expiry.py); a lease timeout longer than
    # every wait below, so no restart time can turn it into expiry
    coord = start_coordinator(procs, run, timeout=120, no_dashboard=False, groups_per_step=4, min_groups=1,
                              max_wait_s=1, lease_timeout_s=3600)
    join = coord.join
    data = tmp_path / "alice"
    args = volunteer_args(join, data, name="alice")
    data.mkdir()
    (data / "HOLD_UPLOADS").write_text("the test kills the volunteer while its batches wait here\n")
    # the fault double (tests/fault_volunteer.py) keeps generating and spooling but uploads nothing while
    # HOLD_UPLOADS exists; after the kill the real volunteer takes over the same data directory
    victim = procs.start("alice-1", with_fault(args, "hold-uploads"))
    outbox = data / "outbox"
    spooled_before = wait_for(lambda: (lambda ids: ids if len(ids) >= 2 else None)(
        {p.stem for p in outbox.glob("*.payload")}), 240, "the volunteer to spool two batches")
    procs.signal(victim, signal.SIGKILL)
    victim.wait(10)
    spooled = {p.stem for p in outbox.glob("*.payload")}
    assert spooled >= spooled_before, "every spooled batch survives SIGKILL"
    assert not spooled & {e["batch_id"] for e in _batch_events(run)}, "nothing was uploaded before the kill"

    (data / "HOLD_UPLOADS").unlink()
    again = procs.start("alice-2", args + ["--max-batches", "3"])
    again.wait(240)
    assert again.returncode == 0, again.log_path.read_text()[-2000:]
    assert not list((data / "outbox").glob("*.payload")), "acked batches are deleted from the outbox"
    wait_for(lambda: spooled <= {e["batch_id"] for e in _batch_events(run)}, 60, "the learner to log the batches")
    procs.signal(coord.proc, signal.SIGTERM)
    coord.proc.wait(180)
    ids = [e["batch_id"] for e in _batch_events(run)]
    assert all(ids.count(b) == 1 for b in spooled), "each recovered batch is accepted exactly once"
    assert len(ids) == len(set(ids))
    status = json.loads((data / "status.json").read_text())
    assert status["batches_rejected"] == {}
