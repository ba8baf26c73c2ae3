"""A volunteer SIGKILLed after spooling a batch but before uploading it loses nothing: on restart the
batch is uploaded from the outbox and accepted exactly once."""

from __future__ import annotations

import json
import signal

import pytest

from asyncrl.runlog import read_events

from tests.conftest import wait_for, wait_for_join

pytestmark = pytest.mark.integration


def _batch_events(run):
    return read_events(run, "batch")


def test_killed_after_spool_is_accepted_exactly_once(procs, tmp_path):
    run = tmp_path / "run"
    coord = procs.start("coordinator", ["-m", "asyncrl.coordinator.cli", "run", "--model", "tiny",
                                        "--run-dir", str(run), "--max-steps", "0", "--threads", "1",
                                        "--groups-per-step", "4", "--min-groups", "1", "--max-wait-s", "1",
                                        # the scenario is a restart within the lease (expiry: test_lease_expiry.py);
                                        # longer than every wait below, so no restart time can turn it into expiry
                                        "--lease-timeout-s", "3600"])
    join = wait_for_join(run)
    data = tmp_path / "alice"
    args = ["-m", "asyncrl.client.cli", "join", join, "--name", "alice", "--data-dir", str(data), "--threads", "1"]
    victim = procs.start("alice-1", args, env={"ASYNCRL_FAULT": "pause-after-spool"})
    paused = wait_for(lambda: (data / "FAULT_PAUSED").exists() and (data / "FAULT_PAUSED").read_text(), 180,
                      "the volunteer to spool its first batch")
    procs.signal(victim, signal.SIGKILL)
    victim.wait(10)
    spooled = list((data / "outbox").glob("*.payload"))
    assert [p.stem for p in spooled] == [paused], "the spooled batch must survive SIGKILL"
    assert paused not in {e["batch_id"] for e in _batch_events(run)}, "nothing was uploaded before the kill"

    (data / "FAULT_PAUSED").unlink()
    again = procs.start("alice-2", args + ["--max-batches", "3"])
    again.wait(240)
    assert again.returncode == 0, again.log_path.read_text()[-2000:]
    assert not list((data / "outbox").glob("*.payload")), "acked batches are deleted from the outbox"
    wait_for(lambda: paused in {e["batch_id"] for e in _batch_events(run)}, 60, "the learner to log the batch")
    procs.signal(coord, signal.SIGTERM)
    coord.wait(180)
    ids = [e["batch_id"] for e in _batch_events(run)]
    assert ids.count(paused) == 1, "the recovered batch is accepted exactly once"
    assert len(ids) == len(set(ids))
    status = json.loads((data / "status.json").read_text())
    assert status["batches_rejected"] == {}
