"""`asyncrl demo`: a real swarm on loopback — one coordinator and K volunteer processes.

Every process is a separate OS process talking over hivemind on 127.0.0.1; nothing is shared but
the built-in tiny model's on-disk cache. The demo starts the coordinator, reads the join address it
prints into `<run_dir>/join.txt`, starts K `asyncrl-client join` processes, shows progress, and when
the coordinator has done `--steps` optimizer steps stops the volunteers, prints a one-screen summary
and writes `<run_dir>/reward.png` (+ `--json-out`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.coordinator.plots import plot_run


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _stop(proc: subprocess.Popen, grace: float = 15.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own child's session: its p2pd and DHT children
        proc.wait(5)


def run_demo(*, clients: int, steps: int, run_dir: str, json_out: str | None, timeout_s: float) -> int:
    t0 = time.time()
    run = Path(run_dir)
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    py = sys.executable
    coord = _spawn([py, "-m", "asyncrl.coordinator.cli", "run", "--model", "tiny", "--run-dir", str(run),
                    "--max-steps", str(steps), "--threads", "1"], run / "coordinator.log")
    procs: list[subprocess.Popen] = []
    try:
        join = run / "join.txt"
        while not join.exists():
            if coord.poll() is not None:
                print((run / "coordinator.log").read_text()[-3000:])
                print("demo: the coordinator exited before it was ready", file=sys.stderr)
                return 1
            if time.time() - t0 > 180:
                print("demo: coordinator did not start within 180 s", file=sys.stderr)
                return 1
            time.sleep(0.2)
        address = join.read_text().strip()
        print(f"coordinator up at {address}")
        for i in range(clients):
            procs.append(_spawn([py, "-m", "asyncrl.client.cli", "join", address, "--name", f"volunteer-{i}",
                                 "--data-dir", str(run / f"client-{i}"), "--seed", str(i), "--threads", "1"],
                                run / f"client-{i}.log"))
        print(f"{clients} volunteers started; logs in {run}/")
        last = 0.0
        while coord.poll() is None:
            if time.time() - t0 > timeout_s:
                print("demo: timed out", file=sys.stderr)
                return 1
            if time.time() - last > 10:
                last = time.time()
                print(_progress_line(run / "metrics.jsonl", steps, t0), flush=True)
            time.sleep(0.5)
    finally:
        for p in procs:
            _stop(p)
        _stop(coord)
    summary_path = run / "summary.json"
    if not summary_path.exists():
        print((run / "coordinator.log").read_text()[-3000:])
        print("demo: the coordinator wrote no summary", file=sys.stderr)
        return 1
    summary = json.loads(summary_path.read_text())
    summary["wall_s"] = time.time() - t0
    summary["clients"] = clients
    summary["client_versions_loaded"] = {}
    for i in range(clients):
        status = run / f"client-{i}" / "status.json"
        if status.exists():
            st = json.loads(status.read_text())
            summary["client_versions_loaded"][st["name"]] = len(set(st["versions_loaded"]))
    plot_path = plot_run(run)
    summary["plot"] = str(plot_path) if plot_path else None
    print_summary(summary)
    if json_out:
        Path(json_out).write_text(json.dumps(summary, indent=2))
    return 0


def _progress_line(metrics: Path, steps: int, t0: float) -> str:
    step, reward, batches = 0, float("nan"), 0
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            ev = json.loads(line)
            if ev["event"] == "step":
                step, reward = ev["step"], ev["reward_mean"]
            elif ev["event"] == "batch":
                batches += 1
    return f"[{time.time() - t0:5.0f}s] step {step}/{steps}  batches {batches}  reward {reward:.3f}"


def print_summary(s: dict) -> None:
    print()
    print("=" * 64)
    print(f" asyncrl demo — {s['clients']} volunteers, {s['wall_s']:.0f} s")
    print("=" * 64)
    print(f" trainer steps               {s['trainer_steps']}")
    print(f" adapter versions published  {s['adapter_versions_published']}")
    print(f" batches accepted            {s['batches_accepted']}")
    for name, n in sorted(s["batches_by_client"].items()):
        loaded = s.get("client_versions_loaded", {}).get(name, "?")
        print(f"   {name:<24} {n:5d} batches, {loaded} adapter versions loaded")
    print(f" reward first 10% → last 10%  {s['reward_first']:.3f} → {s['reward_last']:.3f}")
    print(f" LoRA change (L2)            {s['lora_delta_norm']:.4f}")
    print(f" leases                      {s['leases']}")
    if s.get("plot"):
        print(f" plot                        {s['plot']}")
    print("=" * 64)
