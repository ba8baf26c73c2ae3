"""Batches outlive an outage longer than the coordinator's timestamp window (real processes).

A volunteer spools batches it cannot upload (the fault double's `hold-uploads`, tests/fault_volunteer.py: it
keeps working while the file HOLD_UPLOADS exists), the coordinator is stopped (its final checkpoint holds the
leases), stays down for more than `--timestamp-window-s`, and comes back with `--resume`. The volunteer seals
each batch when it uploads it, so nothing is EXPIRED: every batch it spooled is acked and then trained or
explicitly dropped as stale (a `step` / `dropped` record names its id), none is deleted unread, and the lease
books balance.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from asyncrl.runlog import read_events

from tests.conftest import wait_for
from tests.harness import coordinator_args, start_coordinator, volunteer_args, with_fault

pytestmark = pytest.mark.integration

WINDOW_S = 4.0


def _events(run):
    return read_events(run)


def _status(d):
    try:
        return json.loads((d / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _volunteer_events(log):
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_spooled_batches_survive_an_outage_longer_than_the_window(procs, tmp_path, free_port):
    run, vol = tmp_path / "run", tmp_path / "vol"
    same = {"port": free_port, "checkpoint_every": 0, "groups_per_step": 4, "min_groups": 1, "max_wait_s": 1,
            "lease_timeout_s": 600, "timestamp_window_s": WINDOW_S, "group_size": 4, "max_inflight_groups": 16}
    coordinator = start_coordinator(procs, run, name="coordinator-1", **same)
    first, join = coordinator.proc, coordinator.join
    vol.mkdir()
    (vol / "HOLD_UPLOADS").write_text("the test releases uploads after the outage\n")
    args = volunteer_args(join, vol, name="vol", prompts_per_batch=2, json_logs=True,
                          fixed_lease_size=True)  # 2 prompts per batch from the first
    volunteer = procs.start("vol", with_fault(args, "hold-uploads"))
    # It holds every lease it may (8 prompts = 4 batches of 2) and spools them all.
    wait_for(lambda: _status(vol).get("outbox", 0) >= 4, 300, "the volunteer to spool 4 batches")
    spooled = set(_status(vol)["outbox_pending"])
    assert len(spooled) == 4

    procs.signal(first, signal.SIGTERM)  # the final checkpoint keeps the 8 outstanding leases
    assert first.wait(120) == 0, first.log_path.read_text()[-3000:]
    down_at = time.time()
    # Down for longer than the window: each spooled batch is now far older than any envelope it may send.
    wait_for(lambda: time.time() - down_at > 2 * WINDOW_S, 60, "the outage to outlast the timestamp window")
    (vol / "HOLD_UPLOADS").unlink()
    second = procs.start("coordinator-2", coordinator_args(run, resume=True, **same))

    def trained_or_dropped():
        events = _events(run)
        done = {i for e in events if e["event"] in ("step", "dropped") for i in e["batch_ids"]}
        return spooled <= done and done

    consumed = wait_for(trained_or_dropped, 300, "every spooled batch trained or dropped after the resume")
    # The volunteer first: it keeps working after the resume, and its first Ctrl-C finishes the batch in hand
    # and flushes it to the coordinator that is still up (stopping the coordinator first would strand it).
    # SIGINT, as a terminal sends it: SIGTERM to the group also stops its p2pd before the flush.
    procs.signal(volunteer, signal.SIGINT)
    assert volunteer.wait(120) == 0, volunteer.log_path.read_text()[-3000:]
    procs.signal(second, signal.SIGTERM)
    assert second.wait(120) == 0, second.log_path.read_text()[-3000:]

    events = _volunteer_events(volunteer.log_path)
    acked = {e["batch_id"] for e in events if e["event"] == "acked"}
    assert spooled <= acked  # none deleted unread: each one was answered with an ack
    st = _status(vol)
    assert "EXPIRED" not in st["batches_rejected"] and "EXPIRED" not in st["batches_deferred"]
    assert st["batches_rejected"] == {} and st["batches_quarantined"] == 0 and st["outbox"] == 0
    assert spooled <= consumed
    summary = json.loads((run / "summary.json").read_text())
    assert summary["leases_balanced"], summary["leases"]
