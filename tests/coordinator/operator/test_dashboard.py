"""The dashboard's HTTP surface (real uvicorn server on 127.0.0.1), plots, and the status/keys commands."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from argparse import Namespace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.coordinator.operator import admin
from asyncrl.coordinator.operator.dashboard import Dashboard
from asyncrl.coordinator.operator.metrics import RunStats, make_registry, volunteer_rows
from asyncrl.coordinator.operator.plots import PlotOnDemand, plot_run
from asyncrl.protocol.identity import Identity


class StaticSwarm:
    """A snapshot source with two volunteers, built the way Coordinator.snapshot() builds it."""

    def __init__(self):
        self.stats = RunStats(group_size=4)
        self.stats.observe("publish", {"t": time.time(), "version": 0, "codec": "k", "compressed_bytes": 9,
                                       "raw_bytes": 40})
        self.stats.observe("batch", {"t": time.time(), "client": "alice", "groups": 2})

    def __call__(self) -> dict:
        now = time.time()
        clients = [{"name": "alice", "fingerprint": "aaaa:bbbb", "accepted": 1, "rejected": {}, "last_version": 0,
                    "last_seen": now},
                   {"name": "<b>bob</b>", "fingerprint": "cccc:dddd", "accepted": 0,
                    "rejected": {"UNKNOWN_LEASE": 1}, "last_version": -1, "last_seen": now}]
        s = self.stats.snapshot()
        return {"time": now, "run": {"run_id": "r", "model": "m", "fingerprint": "ffff", "uptime_s": 1.0,
                                     "max_steps": 0, "join_command": "asyncrl-client join /ip4/x",
                                     "dashboard_url": None},
                "learner": {"steps": 0, "version": 0, "queued_groups": 0, "max_staleness": 4},
                "leases": {"outstanding": 0, "completed": 1, "expired": 0}, "stats": s,
                "volunteers": volunteer_rows(clients, version=0, rollouts_by_client=s["rollouts_by_client"], now=now)}


def get(url: str, host: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def write_steps(run_dir: Path, n: int) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        for step in range(1, n + 1):
            f.write(json.dumps({"event": "step", "t": time.time(), "step": step, "reward_mean": step / n,
                                "staleness": [0, 1]}) + "\n")
        f.write('{"event": "step", "t": 1')  # a torn last line, as a reader can see mid-write


@pytest.fixture
def dashboard(tmp_path):
    snap = StaticSwarm()
    dash = Dashboard(snapshot=snap, registry=make_registry(snap), run_dir=tmp_path)
    url = dash.start()
    yield dash, url, snap
    dash.stop()


def test_serves_page_status_and_metrics_on_loopback(dashboard, tmp_path):
    dash, url, snap = dashboard
    assert url.startswith("http://127.0.0.1:") and dash.port > 0
    assert (tmp_path / "dashboard.txt").read_text().strip() == url
    status, body = get(url)
    assert status == 200 and b'id="swarm"' in body
    status, body = get(url + "api/status")
    data = json.loads(body)
    assert status == 200 and {v["name"] for v in data["volunteers"]} == {"alice", "<b>bob</b>"}
    status, body = get(url + "metrics")
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert status == 200 and {"asyncrl_learner_steps", "asyncrl_swarm_volunteers"} <= names


def test_refuses_foreign_host_headers_when_bound_to_loopback(dashboard):
    _, url, _ = dashboard
    assert get(url + "api/status", host="attacker.example")[0] == 400
    assert get(url + "api/status", host=f"localhost:{url.rsplit(':', 1)[1].strip('/')}")[0] == 200


def test_plot_endpoint_draws_from_metrics(dashboard, tmp_path):
    _, url, _ = dashboard
    assert get(url + "plot.png")[0] == 404  # nothing logged yet
    write_steps(tmp_path, 12)
    status, body = get(url + "plot.png")
    assert status == 200 and body.startswith(b"\x89PNG")
    assert (tmp_path / "reward.png").read_bytes() == body


def test_stop_closes_the_port_and_removes_dashboard_txt(tmp_path):
    snap = StaticSwarm()
    dash = Dashboard(snapshot=snap, registry=make_registry(snap), run_dir=tmp_path)
    dash.start()
    dash.stop()
    assert not (tmp_path / "dashboard.txt").exists()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", dash.port), timeout=5).close()


def test_plot_run_and_plot_on_demand(tmp_path):
    assert plot_run(tmp_path) is None
    write_steps(tmp_path, 30)
    plots = PlotOnDemand(tmp_path)
    plots.request()
    deadline = time.time() + 60
    while plots.written == 0 and time.time() < deadline:
        time.sleep(0.05)
    plots.close()
    assert plots.written == 1 and (tmp_path / "reward.png").read_bytes().startswith(b"\x89PNG")
    assert not list(tmp_path.glob("*.tmp"))


def status_args(run_dir: Path, **kw) -> Namespace:
    return Namespace(command="status", config=None, run_dir=str(run_dir), url=None, json=True, **kw)


def test_status_asks_the_live_dashboard(dashboard, tmp_path, capsys):
    assert admin.main(status_args(tmp_path)) == admin.EXIT_OK
    assert {v["name"] for v in json.loads(capsys.readouterr().out)["volunteers"]} == {"alice", "<b>bob</b>"}


def test_status_falls_back_to_the_run_dir(tmp_path, capsys):
    assert admin.main(status_args(tmp_path)) == admin.EXIT_FAIL
    write_steps(tmp_path, 3)
    (tmp_path / "dashboard.txt").write_text("http://127.0.0.1:9/\n")  # stale: nothing listens there
    assert admin.main(status_args(tmp_path)) == admin.EXIT_NOT_RUNNING
    assert json.loads(capsys.readouterr().out)["step"] == 3


def keys_args(run_dir: Path, new: bool) -> Namespace:
    return Namespace(command="keys", config=None, run_dir=str(run_dir), key=None, new=new)


def test_keys_show_and_create_but_never_overwrite(tmp_path, capsys):
    assert admin.main(keys_args(tmp_path, new=False)) == admin.EXIT_FAIL
    assert admin.main(keys_args(tmp_path, new=True)) == admin.EXIT_OK
    key_file = tmp_path / admin.KEY_NAME
    before = key_file.read_bytes()
    ident = Identity.load(key_file)
    assert ident.peer_id in capsys.readouterr().out
    assert admin.main(keys_args(tmp_path, new=True)) == admin.EXIT_FAIL
    assert key_file.read_bytes() == before
    assert admin.main(keys_args(tmp_path, new=False)) == admin.EXIT_OK
    out = capsys.readouterr().out
    assert ident.peer_id in out and ident.fingerprint in out and "PRIVATE" not in out


def test_status_shows_each_engine_class_learning_its_audit_tolerance():
    """What an operator sees when a new engine kind joins: its class, learning (samples of needed) or learned,
    the tolerance in force, and the batches it rejected while learning (docs/operator.md)."""
    from asyncrl.coordinator.trust.audit_policy import AuditPolicy

    policy = AuditPolicy(0.01, learn_batches=2, learn_tolerance=0.05, learn_tolerance_half=0.2)
    policy.judge(b"k", 0.9, "bf16", "vllm")  # a new kind's first batch: rejected, not struck, still learning
    for stat in (0.004, 0.006):
        policy.judge(b"k", stat, "fp32", "transformers")
    snap = StaticSwarm()()
    snap["audit"] = {"engines": policy.engines_status()}
    lines = admin.format_status(snap).splitlines()
    assert "audit engine vllm/bf16: learning (1/2 batches), tolerance 2.00e-01, 1 rejected while learning" in lines
    assert "audit engine transformers/fp32: learned (2/2 batches), tolerance 1.80e-02" in lines
