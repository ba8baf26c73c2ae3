"""Multi-turn learning in a real swarm: coordinator + 2 volunteers (separate processes on loopback, the tiny
model) train on the built-in `echo` game (envs/echo.py: 3 turns with feedback per episode); every episode
is replayed at ingest. Reports the mean episode reward of the first and last 10 % of steps and their ratio
(issue 41's bar: >= 3x); every episode has 3 turns (the game's fixed length). Replay cost: bench/env_replay.py.

    python -m bench.env_swarm --steps 80 --seed 0 --json-out runs/env_swarm.json     # ~4 min on 2 CPU cores

Process handling is the demo's (asyncrl/demo.py DemoProcesses): every child in its own process group,
volunteers stopped first, leftovers SIGKILLed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from asyncrl.demo import DemoProcesses, prepare_run_dir
from asyncrl.runlog import read_events


def rewards(metrics: Path) -> list[float]:
    return [ev["reward_mean"] for ev in read_events(metrics) if ev["event"] == "step"] if metrics.exists() else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0, help="the coordinator's seed (LoRA init, prompt order)")
    ap.add_argument("--run-dir", default="runs/env_swarm")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--timeout-s", type=float, default=1500)
    args = ap.parse_args(argv)
    run = Path(args.run_dir)
    prepare_run_dir(run, overwrite=True)
    py, t0 = sys.executable, time.time()
    kids = DemoProcesses(run / "demo.pids")
    try:
        kids.spawn([py, "-m", "asyncrl.coordinator.cli", "run", "--model", "tiny", "--run-dir", str(run),
                    "--task", "env:echo", "--max-new-tokens", "3", "--group-size", str(args.group_size),
                    "--lr", str(args.lr), "--max-steps", str(args.steps), "--threads", "1", "--seed", str(args.seed)],
                   run / "coordinator.log", volunteer=False)
        while not (run / "join.txt").exists():
            if kids.coordinator.poll() is not None or time.time() - t0 > 240:
                print((run / "coordinator.log").read_text()[-3000:], file=sys.stderr)
                return 1
            time.sleep(0.5)
        address = (run / "join.txt").read_text().strip()
        for i in range(args.clients):
            kids.spawn([py, "-m", "asyncrl.client.cli", "join", address, "--name", f"volunteer-{i}",
                        "--data-dir", str(run / f"client-{i}"), "--seed", str(i), "--threads", "1"],
                       run / f"client-{i}.log", volunteer=True)
        last = 0.0
        while kids.coordinator.poll() is None and time.time() - t0 < args.timeout_s:
            if time.time() - last > 30:
                last = time.time()
                r = rewards(run / "metrics.jsonl")
                print(f"[{time.time() - t0:5.0f}s] step {len(r)}/{args.steps} reward {r[-1] if r else float('nan'):.3f}",
                      flush=True)
            time.sleep(1.0)
    finally:
        kids.stop_all()
    r = rewards(run / "metrics.jsonl")
    if len(r) < 10:
        print(f"only {len(r)} steps ran", file=sys.stderr)
        return 1
    k = max(1, len(r) // 10)
    first, last_ = sum(r[:k]) / k, sum(r[-k:]) / k
    out = {"steps": len(r), "first_10pct_reward": first, "last_10pct_reward": last_,
           "ratio": last_ / first if first > 0 else float("inf"), "wall_s": time.time() - t0, "rewards": r,
           "turns_per_episode": 3, "seed": args.seed, "lr": args.lr, "group_size": args.group_size, "clients": args.clients}
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    trust = (run / "trust.json").read_text() if (run / "trust.json").exists() else ""
    out.update(batches_accepted=summary.get("batches_accepted"), rejected_by_client=summary.get("rejected_by_client"),
               groups_unscorable=summary.get("groups_unscorable"), audits_passed=trust.count('"AUDIT_PASSED"'))
    print(json.dumps({k_: v for k_, v in out.items() if k_ != "rewards"}, indent=2))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
