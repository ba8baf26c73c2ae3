"""The swarm transport against the real coordinator (tiny model): a volunteer survives a coordinator
restart, and an oversized batch frame is refused from its length header alone."""

from __future__ import annotations

import json
import signal

import pytest

from asyncrl.runlog import read_events
from asyncrl.swarm.streams import stream_name

from tests import harness
from tests.conftest import REPO, wait_for, wait_for_join

pytestmark = pytest.mark.integration

MAX_BATCH_BYTES = 8 * 1024 * 1024  # the coordinator's default max_batch_bytes


def coordinator_args(run, port: int) -> list[str]:
    return harness.coordinator_args(run, port=port, groups_per_step=4, max_wait_s=2)


def metrics(run) -> list[dict]:
    return read_events(run)


def client_status(data) -> dict:
    try:
        return json.loads((data / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def tail(proc, n: int = 3000) -> str:
    return proc.log_path.read_text()[-n:] if proc.log_path.exists() else "(no log)"


def wait_or_dump(predicate, timeout: float, what: str, *procs):
    try:
        return wait_for(predicate, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n" + "\n".join(f"--- {p.log_path.name}\n{tail(p)}" for p in procs)) from None


def test_oversized_batch_frame_is_refused_without_reading_it(procs, tmp_path, free_port):
    run = tmp_path / "run"
    coord = procs.start("coordinator", coordinator_args(run, free_port))
    join = wait_for_join(run)
    run_id = json.loads((run / "config.json").read_text())["run_id"]
    # Header claims one byte over the cap; the body is never sent. A server that buffered before checking
    # would wait for it and never answer; ours answers from the header.
    probe = procs.start("probe", ["-m", "tests.integration.swarm_peers", "probe", join, stream_name(run_id, "submit"),
                                  str(MAX_BATCH_BYTES + 1)], cwd=REPO)
    probe.wait(120)
    answer = [json.loads(line) for line in probe.log_path.read_text().splitlines() if line.startswith("{")]
    assert answer and answer[-1]["status"] == 1, tail(probe)
    assert answer[-1]["code"] == "PAYLOAD_TOO_LARGE"
    assert coord.poll() is None, tail(coord)


def test_coordinator_restart_does_not_kill_clients(procs, tmp_path, free_port):
    run, data = tmp_path / "run", tmp_path / "vol"
    first = procs.start("coordinator-1", coordinator_args(run, free_port))
    join = wait_for_join(run)
    client = harness.start_volunteer(procs, join, data, name="vol", quiet=True)
    # Until the client generates with a version > 0: after the restart that number names nothing yet.
    wait_or_dump(lambda: client_status(data).get("batches_acked", 0) >= 1
                 and max(client_status(data).get("versions_loaded") or [0]) >= 1, 240,
                 "a batch accepted and adapter v1 loaded", client, first)

    first.send_signal(signal.SIGTERM)  # the operator stops it (its DHT process and p2pd go with it)
    first.wait(90)
    acked_before = client_status(data)["batches_acked"]
    assert client.poll() is None, tail(client)  # the volunteer outlives its coordinator

    second = procs.start("coordinator-2", coordinator_args(run, free_port))  # same key (run dir), same port
    restart_at = wait_for(lambda: [i for i, e in enumerate(metrics(run)) if e["event"] == "publish"
                                   and e["version"] == 0][1:], 120, "the restarted coordinator's first publish")[0]

    def accepted_after_restart() -> int:
        return sum(1 for e in metrics(run)[restart_at:] if e["event"] == "batch")

    def stepped_back() -> bool:
        # Without --resume the restarted coordinator's versions start again at 0: the sequence of loaded
        # versions (increasing within one coordinator's life) steps back once the client follows it.
        loaded = client_status(data).get("versions_loaded") or []
        return any(b <= a for a, b in zip(loaded, loaded[1:]))

    wait_or_dump(lambda: stepped_back() and accepted_after_restart() >= 2
                 and client_status(data).get("batches_acked", 0) > acked_before,
                 300, "the client to follow the restarted coordinator and get batches accepted", client, second)
    assert client.poll() is None, tail(client)
