"""A run that ends says so, and what a volunteer did is provable: real coordinator and volunteer processes.

The coordinator stops at --max-steps; the volunteer learns it from the signed pointer (or RUN_FINISHED)
and exits 0 on its own with its summary — nobody signals it. Its exported receipts then verify offline
against the join address, and their totals are the coordinator's own (summary.json `receipts` and
`contributors`). (A volunteer joining a finished run is told by the handshake: tests/client/test_run_end.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl.protocol.identity import Identity
from tests.conftest import REPO, wait_for_join

pytestmark = pytest.mark.integration


def test_volunteers_exit_when_the_run_finishes_and_their_receipts_match_the_coordinators(procs, tmp_path):
    run = tmp_path / "run"
    coord = procs.start("coordinator", ["-m", "asyncrl.coordinator.cli", "run", "--model", "tiny", "--run-dir", str(run),
                                        "--max-steps", "4", "--threads", "1", "--groups-per-step", "2",
                                        "--min-groups", "1", "--max-wait-s", "1"])
    join = wait_for_join(run)
    data = tmp_path / "alice"
    alice = procs.start("alice", ["-m", "asyncrl.client.cli", "join", join, "--name", "alice", "--data-dir", str(data),
                                  "--threads", "1", "--quiet", "--host", "127.0.0.1"])
    assert alice.wait(400) == 0, alice.log_path.read_text()[-3000:]  # on its own: the run said it finished
    status = json.loads((data / "status.json").read_text())
    assert status["run_finished"] and status["batches_acked"] >= 1
    assert coord.wait(300) == 0, coord.log_path.read_text()[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["trainer_steps"] == 4

    cli = [sys.executable, "-m", "asyncrl.client.cli"]
    export = tmp_path / "alice-receipts.json"
    subprocess.run([*cli, "receipts", "--data-dir", str(data), "--export", str(export)], check=True, cwd=REPO,
                   capture_output=True, timeout=120)
    done = subprocess.run([*cli, "verify", str(export), "--address", join], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    [mine] = json.loads(done.stdout)["runs"]
    fingerprint = Identity.load(data / "identity.key").fingerprint
    assert mine["volunteer"] == fingerprint and mine["batches"] == status["receipts"] == status["batches_acked"]
    theirs = summary["receipts"][fingerprint]
    assert (mine["batches"], mine["groups"], mine["tokens"]) == (theirs["batches"], theirs["groups"], theirs["tokens"])
    [row] = summary["contributors"]
    assert row["fingerprint"] == fingerprint and row["accepted_tokens"] == mine["tokens"]
    assert row["trained_groups"] > 0 and row["trained_share"] == 1.0
