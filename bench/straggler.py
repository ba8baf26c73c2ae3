"""Straggler benchmark: asynchronous GRPO vs the synchronous baseline when one volunteer is slow.

Owned by the staleness/benchmark work (issue 5, part B). Real processes on loopback: one coordinator
and 3 volunteers (`asyncrl-client join`), the built-in tiny model and the `repeat` toy task; volunteer
2 lends only 20 % of its machine (`--duty-cycle 0.2`: after each batch it rests 4x the time the batch
took). The same seeds and task run twice:

- async (the default coordinator): steps whenever `groups_per_step` groups are queued, whoever sent
  them, so the slow volunteer only contributes less;
- sync (`--sync`): every step waits for one batch from every live volunteer, all generated with the
  current adapter, so the slow volunteer gates every step.

A step uses the same amount of data in both modes (groups_per_step = 3 volunteers x 4 prompts).
Measured: wall time from the first accepted batch (swarm up; start-up costs are the same in both
modes and excluded) until the moving average of the step rewards over `--window` steps first reaches
`--target`. Each mode then runs `--extra-steps` more steps; its final reward is the last moving average.
JSON: target_reward, async_time_s, sync_time_s, ratio (= async / sync; goal <= 0.40),
async_final_reward, sync_final_reward, plus per-mode details.

    .venv/bin/python bench/straggler.py --json-out runs/bench/straggler.json

Note for a 2-core machine: all four processes share the CPU, so in async mode the volunteers slow each
other (and the learner) down, which real volunteers on their own GPUs would not; the ratio measured
here is, if anything, pessimistic for async.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.protocol.atomic import write_json_atomic
from asyncrl.runlog import read_events

VOLUNTEERS = 3
SLOW_DUTY = 0.2


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, *args], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def stop(proc: subprocess.Popen, grace: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # our child's own session: its p2pd and DHT children too
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(5)


def session_cpu_s(proc: subprocess.Popen) -> float:
    """CPU seconds used so far by every live process in `proc`'s session (it, its DHT fork, p2pd)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == proc.pid:  # field 6 of stat: session id
            total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return total


def moving_average(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def analyse(events: list[dict], target: float, window: int, extra_steps: int | None = None) -> dict:
    """Time (from the first accepted batch) until the step-reward moving average reaches `target`.

    With `extra_steps`, only the steps up to target + extra_steps count (the run was stopped there;
    a few more may have trained while the processes were shutting down)."""
    batches = [e for e in events if e["event"] == "batch"]
    steps = [e for e in events if e["event"] == "step"]
    if extra_steps is not None:
        probe = moving_average([e["reward_mean"] for e in steps], window)
        hit = next((i for i, v in enumerate(probe) if i + 1 >= window and v >= target), None)
        if hit is not None:
            steps = steps[:hit + 1 + extra_steps]
            batches = [b for b in batches if b["t"] <= steps[-1]["t"]]
    t0 = batches[0]["t"] if batches else None
    smooth = moving_average([e["reward_mean"] for e in steps], window)
    hit = next((i for i, v in enumerate(smooth) if i + 1 >= window and v >= target), None)
    return {
        "steps": len(steps),
        "time_s": (steps[hit]["t"] - t0) if hit is not None else None,
        "steps_to_target": hit + 1 if hit is not None else None,
        "final_reward": smooth[-1] if smooth else None,
        "first_reward": smooth[0] if smooth else None,
        "wall_s": (steps[-1]["t"] - t0) if steps and t0 else None,
        "mean_step_s": ((steps[-1]["t"] - t0) / len(steps)) if steps and t0 else None,
        "groups_per_step_mean": sum(e["groups"] for e in steps) / len(steps) if steps else None,
        "staleness_mean": (sum(e.get("staleness_mean", 0.0) for e in steps) / len(steps)) if steps else None,
        "dropped_stale_groups": sum(e.get("dropped_stale", 0) for e in steps),
        "batches_by_client": {c: sum(1 for b in batches if b["client"] == c) for c in sorted({b["client"] for b in batches})},
    }


def run_mode(mode: str, run_dir: Path, a) -> dict:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    coord_args = ["-m", "asyncrl.coordinator.cli", "run", "--model", "tiny", "--run-dir", str(run_dir),
                  "--run-id", f"straggler-{mode}", "--max-steps", str(a.max_steps), "--threads", "1",
                  "--seed", str(a.seed), "--groups-per-step", str(VOLUNTEERS * a.prompts_per_batch),
                  "--min-groups", str(a.prompts_per_batch), "--max-inflight-groups", str(2 * VOLUNTEERS * a.prompts_per_batch),
                  "--prompts-per-lease", str(a.prompts_per_batch), "--lr", str(a.lr)]
    if mode.startswith("sync"):
        coord_args.append("--sync")
    coord = spawn(coord_args, run_dir / "coordinator.log")
    vols: list[subprocess.Popen] = []
    t_start = time.time()
    result: dict = {"mode": mode}
    try:
        join = run_dir / "join.txt"
        while not (join.exists() and join.read_text().strip()):
            if coord.poll() is not None or time.time() - t_start > 300:
                raise RuntimeError(f"{mode}: coordinator did not start:\n" + (run_dir / "coordinator.log").read_text()[-2000:])
            time.sleep(0.2)
        address = join.read_text().strip()
        from asyncrl.protocol.identity import Identity

        for i in range(VOLUNTEERS):
            (run_dir / f"client-{i}").mkdir(parents=True, exist_ok=True)
            Identity.load_or_create(run_dir / f"client-{i}" / "identity.key")  # keys made here, not in the race
            args = ["-m", "asyncrl.client.cli", "join", address, "--name", f"vol-{i}", "--data-dir",
                    str(run_dir / f"client-{i}"), "--seed", str(a.seed + i), "--threads", "1", "--quiet",
                    "--prompts-per-batch", str(a.prompts_per_batch),
                    "--fixed-lease-size"]  # every volunteer contributes prompts_per_batch groups per round
            if i == VOLUNTEERS - 1 and not mode.endswith("-even"):
                args += ["--duty-cycle", str(SLOW_DUTY)]
            vols.append(spawn(args, run_dir / f"client-{i}.log"))
        hit_at_steps = None
        last_print = 0.0
        while coord.poll() is None:
            events = read_events(run_dir / "metrics.jsonl")
            info = analyse(events, a.target, a.window)
            if info["steps_to_target"] is not None and hit_at_steps is None:
                hit_at_steps = info["steps"]
            if hit_at_steps is not None and info["steps"] >= info["steps_to_target"] + a.extra_steps:
                break
            elapsed = time.time() - t_start
            if elapsed > a.time_cap_s:
                result["timed_out"] = True
                break
            if time.time() - last_print > 15:
                last_print = time.time()
                print(f"  [{mode} {elapsed:5.0f}s] steps {info['steps']}  reward(ma) "
                      f"{info['final_reward'] if info['final_reward'] is not None else float('nan'):.3f}", flush=True)
            time.sleep(1.0)
        result["cpu_s"] = {"coordinator": session_cpu_s(coord),
                           **{f"vol-{i}": session_cpu_s(v) for i, v in enumerate(vols)}}
    finally:
        for proc in [coord, *vols]:  # all at once: nobody trains on while the others shut down
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*vols, coord]:
            stop(proc)
    result.update(analyse(read_events(run_dir / "metrics.jsonl"), a.target, a.window, a.extra_steps))
    duty = json.loads((run_dir / f"client-{VOLUNTEERS - 1}" / "status.json").read_text()) \
        if (run_dir / f"client-{VOLUNTEERS - 1}" / "status.json").exists() else {}
    if duty.get("busy_s"):
        result["slow_volunteer_achieved_duty"] = duty["busy_s"] / (duty["busy_s"] + duty.get("rested_s", 0.0))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json-out", default="runs/bench/straggler.json")
    p.add_argument("--run-dir", default="runs/bench/straggler")
    p.add_argument("--target", type=float, default=0.5, help="moving-average reward to reach")
    p.add_argument("--window", type=int, default=10, help="moving-average window, in steps")
    p.add_argument("--extra-steps", type=int, default=5, help="steps to run after the target is reached")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--time-cap-s", type=float, default=360.0, help="per mode")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts-per-batch", type=int, default=4,
                   help="prompts per volunteer batch (x16 samples); a step uses 3x this many groups")
    p.add_argument("--modes", default="async,sync",
                   help="any of async, sync, async-even, sync-even (-even: no slow volunteer; a control)")
    a = p.parse_args(argv)
    t0 = time.time()
    runs = {}
    for mode in a.modes.split(","):
        print(f"running {mode} ...", flush=True)
        runs[mode] = run_mode(mode, Path(a.run_dir) / mode, a)
        print(f"  {mode}: {json.dumps(runs[mode])}", flush=True)
    out = {
        "benchmark": "straggler",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "target_reward": a.target,
        "window_steps": a.window,
        "volunteers": VOLUNTEERS,
        "slow_volunteer_duty_cycle": SLOW_DUTY,
        "groups_per_step": VOLUNTEERS * a.prompts_per_batch, "prompts_per_batch": a.prompts_per_batch,
        "async_time_s": runs.get("async", {}).get("time_s"),
        "sync_time_s": runs.get("sync", {}).get("time_s"),
        "async_final_reward": runs.get("async", {}).get("final_reward"),
        "sync_final_reward": runs.get("sync", {}).get("final_reward"),
        "runs": runs,
        "total_wall_s": time.time() - t0,
    }
    at, st = out["async_time_s"], out["sync_time_s"]
    out["ratio"] = at / st if at is not None and st else None
    if at is not None and st is None and "sync" in runs:  # sync never got there: the ratio is at most this
        out["ratio_upper_bound"] = at / runs["sync"]["wall_s"] if runs["sync"].get("wall_s") else None
    out["goal_ratio_max"] = 0.40
    Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.json_out, out, indent=2)
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
