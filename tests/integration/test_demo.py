"""`asyncrl demo` process hygiene, for real: SIGTERM, or Ctrl-C (SIGINT to the demo's process group, as a
terminal sends it), once training has started. The demo must exit 128 + the signal, print and write the
summary of what ran (the coordinator's summary.json), and leave none of the process groups it started —
coordinator, volunteers and their DHT forks and p2pd daemons — behind. Lean: a run of --steps 1000 that
the signal ends right after its first step."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from asyncrl.runlog import read_events

from tests.conftest import wait_for

pytestmark = pytest.mark.integration


def _first_step(demo, run: Path) -> bool:
    assert demo.poll() is None, demo.log_path.read_text()[-3000:]
    return bool(read_events(run, "step"))


def _alive_in(groups: set[int]) -> list[int]:
    """PIDs of live (not zombie) processes whose process group or session is one of `groups`, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited while we looked
            continue
        state, pgrp, session = fields[0], int(fields[2]), int(fields[3])
        if state not in ("Z", "X") and (pgrp in groups or session in groups):
            out.append(int(d.name))
    return out


@pytest.mark.parametrize("sig, clients", [(signal.SIGTERM, 2), (signal.SIGINT, 1)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_everything_the_demo_started_and_prints_the_summary(procs, tmp_path, sig, clients):
    run, out = tmp_path / "run", tmp_path / "demo.json"
    demo = procs.start("demo", ["-m", "asyncrl.cli", "demo", "--clients", str(clients), "--steps", "1000",
                                "--run-dir", str(run), "--json-out", str(out)])
    groups: set[int] = set()
    try:
        wait_for(lambda: _first_step(demo, run), 300, "the demo's first optimizer step")
        groups = set(json.loads((run / "demo.pids").read_text())["process_groups"])
        assert len(groups) == 1 + clients and _alive_in(groups)
        procs.signal(demo, sig)  # the demo's own group: its children sit in sessions of their own
        assert demo.wait(120) == 128 + sig, demo.log_path.read_text()[-3000:]
        assert _alive_in(groups) == [], "a process the demo started outlived it"
    finally:
        for pgid in groups:  # only what this test's demo started, should the demo have left it
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    log = demo.log_path.read_text()
    assert "Traceback" not in log, log[-3000:]
    summary = json.loads(out.read_text())
    assert summary["interrupted"] == signal.Signals(sig).name
    assert summary["trainer_steps"] >= 1 and summary["batches_accepted"] >= 1
    assert isinstance(summary["leases"], dict)  # from the coordinator's own summary.json, written on the way out
    assert summary["exit_codes"]["coordinator"] == 0, summary["exit_codes"]
    assert not (run / "demo.pids").exists()
