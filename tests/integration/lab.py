"""Lab swarms for integration tests: start bench/swarmlab.py publishers and followers as processes and
read their JSON events (one per line in their logs). Shared by tests/integration and tests/adversarial."""

from __future__ import annotations

import json

from tests.conftest import REPO, wait_for

SMALL = ["--layers", "2"]  # a 2-layer slice of the Qwen2.5-1.5B-shaped adapter: 2.6 MB raw


def events(proc, kind: str) -> list[dict]:
    out = []
    if proc.log_path.exists():
        for line in proc.log_path.read_text().splitlines():
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if event.get("event") == kind:
                    out.append(event)
    return out


def status(data_dir) -> dict:
    try:
        return json.loads((data_dir / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def alive(proc) -> None:
    assert proc.poll() is None, proc.log_path.read_text()[-3000:]


def start_publisher(procs, tmp_path, *extra, stdin=None):
    pub = procs.start("publisher", ["-m", "bench.swarmlab", "publish", "--run-dir", str(tmp_path / "pub"),
                                    *SMALL, "--presence-every-s", "1", *extra], cwd=REPO, stdin=stdin)
    ready = wait_for(lambda: (alive(pub), events(pub, "ready"))[1], 120, "the publisher to start")[0]
    return pub, ready


def start_follower(procs, tmp_path, name, join, *extra, module=("-m", "bench.swarmlab", "follow")):
    data = tmp_path / name
    proc = procs.start(name, [*module, join, "--data-dir", str(data), "--name", name, "--run-id", "lab", *extra],
                       cwd=REPO)
    return proc, data


def published(pub, version: int) -> dict:
    return wait_for(lambda: next((e for e in events(pub, "published") if e["version"] == version), None), 120,
                    f"the publisher to publish v{version}")


def held(proc, version: int, timeout: float = 120) -> dict:
    return wait_for(lambda: (alive(proc), next((e for e in events(proc, "held") if e["version"] == version), None))[1],
                    timeout, f"{proc.log_path.stem} to hold v{version}")


def serves(pub, peer_id: str, version: int) -> None:
    """Wait until the publisher's signed providers record names `peer_id` as a holder of `version` (it
    announced it in presence and answered the publisher's probe)."""
    wait_for(lambda: any(version in e["holders"].get(peer_id, []) for e in events(pub, "providers")), 90,
             f"the providers record naming {peer_id[-6:]} as a holder of v{version}")


