"""`asyncrl-client doctor` against a real coordinator: a healthy swarm passes every row, and each broken
condition fails its own row, with a fix, and a non-zero exit (tests assert on row ids and statuses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.protocol.identity import Identity

from tests.conftest import REPO, Procs, wait_for_join
from tests.harness import coordinator_args

pytestmark = pytest.mark.integration
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """One real coordinator (tiny model) and mallory's impostor, shared by the tests below."""
    root = tmp_path_factory.mktemp("doctor")
    procs = Procs(root)
    # started side by side with the impostor, then both waited for: coordinator_args, not start_coordinator
    procs.start("coordinator", coordinator_args(root / "run", no_dashboard=False))
    procs.start("impostor", ["-m", "tests.integration.impostor", "--run-dir", str(root / "mallory")])
    try:
        yield {"join": wait_for_join(root / "run"), "impostor": wait_for_join(root / "mallory"), "root": root}
    finally:
        procs.reap()


def doctor(swarm, address, *extra, env=None) -> tuple[int, dict]:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
               "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run([sys.executable, "-m", "asyncrl.client.cli", "doctor", address, "--json", "--host",
                           "127.0.0.1", "--data-dir", str(swarm["root"] / "volunteer"), *extra],
                          capture_output=True, text=True, timeout=600, env=environ)
    assert done.stdout.strip(), done.stderr[-3000:]
    report = json.loads(done.stdout)
    return done.returncode, {row["id"]: row for row in report["rows"]}


def failed(rows) -> list[str]:
    return [rid for rid, row in rows.items() if row["status"] == "fail"]


def test_healthy_swarm_passes_every_row(swarm):
    code, rows = doctor(swarm, swarm["join"])
    assert list(rows) == ["versions", "engine", "memory", "disk", "tcp", "libp2p", "pointer", "chunk", "nat", "clock"]
    assert {rid: row["status"] for rid, row in rows.items()} == {rid: "pass" for rid in rows}, rows
    assert code == 0


def test_wrong_peer_id_fails_the_handshake_row(swarm):
    wrong = swarm["join"].rsplit("/p2p/", 1)[0] + "/p2p/" + Identity.generate().peer_id
    code, rows = doctor(swarm, wrong)
    assert failed(rows) == ["libp2p"] and rows["libp2p"]["fix"], rows["libp2p"]
    assert rows["tcp"]["status"] == "pass" and rows["pointer"]["status"] == "skip"
    assert code == 1


def test_closed_port_fails_the_tcp_row(swarm, free_port):
    closed = f"/ip4/127.0.0.1/tcp/{free_port}/p2p/" + swarm["join"].rsplit("/p2p/", 1)[1]
    code, rows = doctor(swarm, closed)
    assert failed(rows) == ["tcp"] and rows["tcp"]["fix"]
    assert all(rows[r]["status"] == "skip" for r in ("libp2p", "pointer", "chunk", "nat", "clock"))
    assert code == 1


def test_coordinator_key_not_matching_the_address_fails_the_pointer_row(swarm):
    code, rows = doctor(swarm, swarm["impostor"])
    assert rows["libp2p"]["status"] == "pass"  # the peer *is* who the address says...
    assert failed(rows) == ["pointer"] and rows["pointer"]["code"] == "NOT_ALLOWED"  # ...but signs nothing of its own
    assert code == 1


def test_clock_beyond_the_envelope_window_fails_the_clock_row(swarm):
    code, rows = doctor(swarm, swarm["join"], env={"ASYNCRL_TEST_CLOCK_SKEW_S": "900"})
    assert failed(rows) == ["clock"] and rows["clock"]["fix"], rows
    assert code == 1


def test_missing_engine_fails_the_engine_row(swarm):
    shim = os.pathsep.join([str(HERE / "broken_vllm"), str(REPO)])
    code, rows = doctor(swarm, swarm["join"], "--engine", "vllm", env={"PYTHONPATH": shim})
    assert failed(rows) == ["engine"] and rows["engine"]["fix"]
    assert code == 1
