"""--sync, --duty-cycle and --hold-version with real processes over loopback.

- sync: with `--wait-for-volunteers 2` the first round waits until both volunteers are in, and every step
  trains on one batch from each of them, all generated with the current adapter (staleness 0); the
  duty-cycle volunteer rests in proportion to its work.
- run end (same run): at --max-steps the volunteers learn from the signed pointer that the run is over and
  exit 0 on their own; a volunteer's exported receipts verify offline against the join address and add up
  to the coordinator's own books (summary.json `receipts`, `contributors`: one batch of each per step, so
  each trained half the groups).
- hold-version: a volunteer holding 2 versions back sends batches at least 2 versions stale, which an
  unlimited-staleness learner trains on (with the IS correction), logging staleness metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl.protocol.identity import Identity
from asyncrl.runlog import read_events

from tests.conftest import REPO
from tests.harness import start_coordinator, start_volunteer

pytestmark = pytest.mark.integration

STEP_METRICS = {"staleness_hist", "staleness_max", "ratio_mean", "ratio_min", "ratio_max", "clip_fraction",
                "clip_low_fraction", "clip_high_fraction", "is_weight_mean", "is_truncated_fraction",
                "dropped_stale", "dropped_total", "kl_mean", "loss"}


def _events(run, kind):
    return read_events(run, kind)


def _tail(proc, n=2500):
    return proc.log_path.read_text()[-n:] if proc.log_path.exists() else "(no log)"


def _start_coordinator(procs, run, **opts):
    started = start_coordinator(procs, run, no_dashboard=False, prompts_per_lease=2, **opts)
    return started.proc, started.join


def _volunteer(procs, tmp_path, join, name, **opts):
    # two groups per volunteer per round, from the first (no sizing probe)
    return start_volunteer(procs, join, tmp_path / name, name=name, quiet=True, prompts_per_batch=2,
                           fixed_lease_size=True, **opts)


def test_sync_steps_on_every_live_volunteer_at_the_current_version(procs, tmp_path):
    run = tmp_path / "run"
    coord, join = _start_coordinator(procs, run, sync=True, max_steps=6, wait_for_volunteers=2)
    vols = [_volunteer(procs, tmp_path, join, "alice"),
            _volunteer(procs, tmp_path, join, "bob", duty_cycle=0.5)]
    try:
        coord.wait(timeout=400)
    except Exception:
        pytest.fail("coordinator did not finish:\n" + _tail(coord) + "\n".join(_tail(v) for v in vols))
    assert coord.returncode == 0, _tail(coord)
    for v in vols:  # nobody signals them: the run said it finished
        assert v.wait(120) == 0, _tail(v)
    steps = _events(run, "step")
    assert len(steps) == 6
    for s in steps:
        assert STEP_METRICS <= set(s), sorted(STEP_METRICS - set(s))
        assert s["staleness_hist"] == {"0": s["groups"]}, s  # synchronous: all at the current version
    # Both were in before the first round: every step, the first included, has one batch from each.
    assert all(s["clients"] == ["alice", "bob"] and s["groups"] == 4 for s in steps), [s["clients"] for s in steps]
    bob = json.loads((tmp_path / "bob" / "status.json").read_text())
    alice = json.loads((tmp_path / "alice" / "status.json").read_text())
    assert bob["busy_s"] > 0 and bob["rested_s"] > 0.5 * bob["busy_s"]  # F = 0.5: rest ~ busy
    assert alice["rested_s"] == 0.0
    assert alice["run_finished"] and bob["run_finished"]

    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["trainer_steps"] == 6
    cli = [sys.executable, "-m", "asyncrl.client.cli"]
    export = tmp_path / "alice-receipts.json"
    subprocess.run([*cli, "receipts", "--data-dir", str(tmp_path / "alice"), "--export", str(export)], check=True,
                   cwd=REPO, capture_output=True, timeout=120)
    done = subprocess.run([*cli, "verify", str(export), "--address", join], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    [mine] = json.loads(done.stdout)["runs"]
    fingerprint = Identity.load(tmp_path / "alice" / "identity.key").fingerprint
    assert mine["volunteer"] == fingerprint and mine["batches"] == alice["receipts"] == alice["batches_acked"]
    theirs = summary["receipts"][fingerprint]
    assert (mine["batches"], mine["groups"], mine["tokens"]) == (theirs["batches"], theirs["groups"], theirs["tokens"])
    rows = {r["fingerprint"]: r for r in summary["contributors"]}
    assert set(rows) == set(summary["receipts"]) and len(rows) == 2
    assert rows[fingerprint]["accepted_tokens"] == mine["tokens"]
    assert all(r["trained_groups"] == 12 and r["trained_share"] == 0.5 for r in rows.values()), rows


def test_hold_version_sends_stale_batches_that_an_unlimited_learner_trains_on(procs, tmp_path):
    run = tmp_path / "run"
    coord, join = _start_coordinator(procs, run, max_steps=8, max_staleness=-1, correction="tis-token",
                                      groups_per_step=2, min_groups=2, max_inflight_groups=2)
    vol = _volunteer(procs, tmp_path, join, "holder", hold_version=2)
    try:
        coord.wait(timeout=400)
    except Exception:
        pytest.fail("coordinator did not finish:\n" + _tail(coord) + _tail(vol))
    assert coord.returncode == 0, _tail(coord)
    procs.signal(vol, 15)
    vol.wait(60)
    batches = _events(run, "batch")
    assert batches
    for b in batches:  # at least K = 2 versions behind whenever 2 older versions existed
        newest_at_arrival = b["version"] + b["staleness"]
        assert b["staleness"] >= min(2, newest_at_arrival), b
    steps = _events(run, "step")
    assert len(steps) == 8 and all(s["dropped_stale"] == 0 for s in steps)
    assert max(s["staleness_max"] for s in steps) >= 2
    status = json.loads((tmp_path / "holder" / "status.json").read_text())
    assert max(status["versions_loaded"]) <= steps[-1]["version"] - 2 + 1  # never served the newest
