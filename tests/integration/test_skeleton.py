"""Walking skeleton, end to end: a real coordinator and two real volunteers over hivemind on loopback.

The test asserts that both volunteers contributed, so it says so: `--wait-for-volunteers 2` holds every
lease and the first step until both are in (otherwise the first one up may do all 12 steps alone). Being
in is not having a batch trained, though: nothing makes the second volunteer's first batch arrive within
any fixed number of steps, so the run has no --max-steps. The test waits for the condition itself — 12
steps, and a trained batch and two adapter versions loaded on each volunteer — then stops the coordinator
as an operator does (SIGTERM: final checkpoint and summary.json)."""

from __future__ import annotations

import json
import signal
import urllib.request

import pytest

from asyncrl.runlog import read_events

from tests.conftest import wait_for
from tests.harness import start_coordinator, start_volunteer

pytestmark = pytest.mark.integration


def _tail(path, n=3000):
    return path.read_text()[-n:] if path.exists() else "(no log)"


def _status(path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _trained_by_both(run, tmp_path) -> bool:
    """>= 12 steps, each volunteer's batches in at least one of them, >= 2 adapter versions loaded by each."""
    steps = read_events(run, "step")
    return (len(steps) >= 12 and {c for e in steps for c in e["clients"]} == {"vol-0", "vol-1"}
            and all(len(set(_status(tmp_path / f"c{i}" / "status.json").get("versions_loaded") or [])) >= 2
                    for i in range(2)))


def test_two_volunteers_train_the_tiny_model(procs, tmp_path):
    run = tmp_path / "run"
    started = start_coordinator(procs, run, no_dashboard=False, groups_per_step=4, max_wait_s=2, wait_for_volunteers=2)
    coord, join = started.proc, started.join
    assert join.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/12D3KooW" in join
    url = wait_for(lambda: (run / "dashboard.txt").exists() and (run / "dashboard.txt").read_text().strip(), 60,
                   "dashboard.txt")
    with urllib.request.urlopen(url + "api/status", timeout=30) as resp:  # nobody in yet: the run says it waits
        assert json.loads(resp.read())["learner"]["waiting_for_volunteers"] == {"needed": 2, "joined": 0}
    clients = [start_volunteer(procs, join, tmp_path / f"c{i}", name=f"vol-{i}", seed=i) for i in range(2)]
    try:
        wait_for(lambda: _trained_by_both(run, tmp_path), 400, "12 steps with a trained batch from each volunteer")
    except AssertionError as exc:
        pytest.fail(f"{exc}:\n" + _tail(coord.log_path) + "\n" + "\n".join(_tail(c.log_path) for c in clients))
    # every version each volunteer loaded passed its adapter canary (models/canary.py), and the swarm table says so
    with urllib.request.urlopen(url + "api/status", timeout=30) as resp:
        swarm = {v["name"]: v.get("canary", "") for v in json.loads(resp.read())["volunteers"]}
    assert set(swarm) == {"vol-0", "vol-1"} and all(c.endswith(" ok") for c in swarm.values()), swarm
    coord.send_signal(signal.SIGTERM)  # the operator stops it: final checkpoint + summary.json
    assert coord.wait(120) == 0, _tail(coord.log_path)
    for c in clients:
        procs.signal(c, 15)
    for c in clients:
        c.wait(60)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer_steps"] >= 12
    assert summary["adapter_versions_published"] >= 3
    assert summary["lora_delta_norm"] > 0, "the LoRA parameters did not change"
    assert set(summary["batches_by_client"]) == {"vol-0", "vol-1"}
    events = [e["event"] for e in read_events(run)]
    assert events.count("volunteer_in") == 2 and events.index("volunteers_ready") < events.index("step")
    assert all(n >= 1 for n in summary["batches_by_client"].values()), summary
    for i in range(2):
        status = json.loads((tmp_path / f"c{i}" / "status.json").read_text())
        assert len(set(status["versions_loaded"])) >= 2, status
        assert status["canary_failures"] == 0 and status["canary"]["passed"], status
        assert status["canary"]["version"] == status["versions_loaded"][-1], status
        assert status["batches_acked"] >= 1
    # the board's books balance: nothing leased vanished
    leases = summary["leases"]
    assert leases["leased"] == leases["completed"] + leases["expired"] + leases["outstanding"]
