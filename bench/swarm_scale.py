"""Swarm scale benchmark: what each volunteer costs the coordinator and the DHT at N = 8 and N = 32 (issue 16).

    .venv/bin/python bench/swarm_scale.py --sizes 8 32 --json-out runs/bench/swarm_scale.json

One real coordinator (`asyncrl-coordinator run`: learner on the built-in tiny model, publisher,
LeaseDesk, Ingest, ProviderDesk, presence tracker; `--no-audit`, because the volunteers' logprobs are
made up) and N real volunteers (`python -m bench.swarmlab volunteer`: the real client — lease loop with
the coordinator's retry-after, outbox, upload, presence, adapter follow/fetch/re-serve — around a
scripted engine that returns random tokens with honest rewards after `--gen-s` seconds (5 by default; a
real volunteer's batch takes tens of seconds) instead of generating). Every peer is
its own process with its own hivemind DHT and p2pd, on 127.0.0.1. The tiny adapter is cut into 4 KiB
chunks (`--chunk-bytes 4096`) so that a version spans many chunks and the fan-out is exercised.

Per N, after every volunteer has had a batch accepted, over a window of `--window-s` seconds:
  uplink_ratio               coordinator adapter bytes sent / compressed bytes, over the versions
                             published in the window (a star would be N)
  t95_s                      per version: publish (pointer about to be pushed and stored) -> 95 % of
                             the volunteers hold it or a newer one (newest wins: they skip versions);
                             median over the window's versions
  presence_bytes_per_min     DHT bytes each volunteer reads per minute for presence and fetch sources
                             (volunteers read no presence shard; the signed providers record is all),
                             split into providers_reads_per_min x providers_bytes_per_read
  cpu_s_per_batch            CPU seconds of the coordinator's processes (main, DHT, p2pd) per accepted batch
  idle_lease_requests_per_min  empty lease grants per idle volunteer per minute (idle = got one in the window)
and the coordinator's own presence reading (bytes and records per minute), for docs/scale.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.runlog import read_events  # noqa: E402

from bench.broadcast import MemorySampler, Proc, cpu_seconds  # noqa: E402
from bench.results import REPO, provenance, write_result  # noqa: E402


class Coordinator:
    def __init__(self, run_dir: Path, log_dir: Path, extra: list[str]):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.run_dir = run_dir
        self.log = open(log_dir / "coordinator.log", "w")
        self.p = subprocess.Popen([sys.executable, "-m", "asyncrl.coordinator.cli", "run", "--model", "tiny",
                                   "--run-dir", str(run_dir), "--run-id", "scale", "--max-steps", "0", "--threads", "1",
                                   "--no-dashboard", "--checkpoint-every", "0", "--no-audit", "--chunk-bytes", "4096",
                                   *extra], cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True)

    def join(self, timeout: float = 300) -> str:
        deadline = time.time() + timeout
        path = self.run_dir / "join.txt"
        while time.time() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"coordinator exited ({self.p.returncode}); see {self.log.name}")
            if path.exists() and path.read_text().strip():
                return path.read_text().strip()
            time.sleep(0.5)
        raise TimeoutError("coordinator did not start")

    def events(self, kind: str) -> list[dict]:
        return read_events(self.run_dir, kind)

    def stop(self) -> dict:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(120)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            return json.loads((self.run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return {}


def status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def t95_newest_wins(publishes: list[dict], held: dict[int, list[float]], n: int) -> list[float]:
    """Per published version v: seconds from v's publish until 95 % of the n volunteers hold v *or a newer
    version*. Volunteers load the newest adapter between batches, so with a version every few seconds most
    skip some versions: "holds exactly v" would never reach 95 %, and a volunteer on v+1 is up to date."""
    need = math.ceil(0.95 * n)
    out = []
    for e in publishes:  # `held`: version -> [(volunteer, t_held)]
        first: dict[int, float] = {}  # volunteer -> when it first held e's version or a newer one
        for version, loads in held.items():
            if version >= e["version"]:
                for who, t in loads:
                    first[who] = min(t, first.get(who, t))
        times = sorted(t - e["visible_at"] for t in first.values())
        if len(times) >= need:
            out.append(times[need - 1])
    return out


def one_size(n: int, args, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    coord = Coordinator(work / "run", work, ["--publish-every", str(args.publish_every)])
    vols: list[Proc] = []
    restarts: list[str] = []
    try:
        join = coord.join()

        def start(i: int) -> Proc:
            return Proc(f"v{i}", ["volunteer", join, "--data-dir", str(work / f"v{i}"), "--name", f"v{i}",
                                  "--seed", str(i), "--gen-s", str(args.gen_s)], work)
        for i in range(n):
            vols.append(start(i))
            time.sleep(args.stagger_s)  # the first-contact brake admits new keys at ~1/s after a burst of 20
        sampler = MemorySampler([coord.p.pid, *(v.p.pid for v in vols)])
        deadline = time.time() + args.setup_timeout_s
        while True:  # everyone works: a batch accepted each
            acked = [status(work / f"v{i}" / "status.json").get("batches_acked", 0) for i in range(n)]
            if all(a >= 1 for a in acked):
                break
            if time.time() > deadline:
                raise TimeoutError(f"only {sum(a >= 1 for a in acked)}/{n} volunteers had a batch accepted")
            for i, v in enumerate(vols):  # one that exited during start-up is started again, as its owner would
                if v.p.poll() is not None and acked[i] < 1 and len(restarts) < n:
                    last = [line for line in (work / f"v{i}.log").read_text().splitlines() if line.strip()][-1:]
                    restarts.append(f"v{i} exit {v.p.returncode}: {last[0][:200] if last else ''}")
                    (work / f"v{i}.log").rename(work / f"v{i}.exit{len(restarts)}.log")
                    vols[i] = start(i)
            time.sleep(1.0)
        t0 = time.time()
        cpu0 = cpu_seconds({coord.p.pid: "coordinator"})
        before = {i: status(work / f"v{i}" / "status.json") for i in range(n)}
        time.sleep(args.window_s)
        t1 = time.time()
        cpu1 = cpu_seconds({coord.p.pid: "coordinator"})
        after = {i: status(work / f"v{i}" / "status.json") for i in range(n)}
        sampler.stop()
    finally:
        for v in vols:
            v.stop()
        summary = coord.stop()
    minutes = (t1 - t0) / 60
    publishes = [e for e in coord.events("publish") if t0 <= e.get("visible_at", e["t"]) <= t1 - args.settle_s]
    held = {}
    for i, v in enumerate(vols):
        for line in (work / f"v{i}.events.jsonl").read_text().splitlines():
            e = json.loads(line)
            if e.get("event") == "held":
                held.setdefault(e["version"], []).append((i, e["t_held"]))
    t95s = t95_newest_wins(publishes, held, n)
    by_version = summary.get("adapter_uplink", {}).get("bytes_by_version", {})
    sent = sum(by_version.get(str(e["version"]), 0) for e in publishes)
    compressed = sum(e["compressed_bytes"] for e in publishes)
    batches = [e for e in coord.events("batch") if t0 <= e["t"] <= t1]
    cpu = sum(cpu1.values()) - sum(cpu0.get(k, 0.0) for k in cpu1)

    def providers(i: int, what: str) -> int:
        return ((after[i].get("swarm") or {}).get("providers", {}).get(what, 0)
                - (before[i].get("swarm") or {}).get("providers", {}).get(what, 0))
    providers_bytes = [providers(i, "bytes") for i in range(n)]
    providers_reads = [providers(i, "reads") for i in range(n)]
    idle = [after[i].get("idle_lease_requests", 0) - before[i].get("idle_lease_requests", 0) for i in range(n)]
    idle_vols = [x for x in idle if x > 0]
    tracker = summary.get("presence_reads", {})
    return {
        "volunteers": n, "restarted_during_setup": restarts, "window_s": round(t1 - t0, 1),
        "versions_in_window": len(publishes),
        "versions_measured": len(t95s),
        "uplink_ratio": round(sent / compressed, 3) if compressed else None,
        "t95_s": round(statistics.median(t95s), 3) if t95s else None,
        "t95_p90_s": round(sorted(t95s)[int(0.9 * (len(t95s) - 1))], 3) if t95s else None,
        "presence_bytes_per_min": round(statistics.mean(providers_bytes) / minutes, 1),
        "providers_reads_per_min": round(statistics.mean(providers_reads) / minutes, 1),  # the split of the above
        "providers_bytes_per_read": round(sum(providers_bytes) / max(1, sum(providers_reads)), 1),
        "cpu_s_per_batch": round(cpu / len(batches), 4) if batches else None,
        "batches_in_window": len(batches),
        "idle_lease_requests_per_min": round(statistics.mean(idle_vols) / minutes, 2) if idle_vols else 0.0,
        "idle_volunteers": len(idle_vols),
        "lease_requests_idle_all_per_min": round(statistics.mean(idle) / minutes, 2),
        "coordinator_cpu_s": {k: round(cpu1[k] - cpu0.get(k, 0.0), 2) for k in cpu1},
        "coordinator_presence": tracker,
        "providers": summary.get("providers"),
        "peak_rss_mb": round(sampler.peak_mb),
        "compressed_bytes_per_version": round(compressed / len(publishes)) if publishes else None,
    }


def run(args) -> dict:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="asyncrl-scale-"))
    if work.exists() and args.work_dir:
        shutil.rmtree(work)
    out = {}
    try:
        for n in args.sizes:
            load0 = os.getloadavg()[0]
            out[str(n)] = one_size(n, args, work / f"n{n}")
            out[str(n)]["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
            print(f"N={n}: {json.dumps(out[str(n)])}", flush=True)
    finally:
        if not args.keep_work_dir and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    sizes = [str(n) for n in args.sizes]
    goals = {}
    if "8" in out and "32" in out:
        a, b = out["8"], out["32"]
        goals = {"uplink_ratio_32_le_2": (b["uplink_ratio"] or 99) <= 2.0,
                 "t95_32_le_2x_8": bool(a["t95_s"] and b["t95_s"] and b["t95_s"] <= 2 * a["t95_s"]),
                 "presence_32_le_1.5x_8": b["presence_bytes_per_min"] <= 1.5 * max(a["presence_bytes_per_min"], 1e-9),
                 "idle_lease_requests_le_6": b["idle_lease_requests_per_min"] <= 6 and a["idle_lease_requests_per_min"] <= 6}
    return {**out, "goals": goals, "sizes": sizes,
            "settings": {"window_s": args.window_s, "publish_every": args.publish_every, "chunk_bytes": 4096,
                         "gen_s": args.gen_s},
            **provenance()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 32])
    p.add_argument("--window-s", type=float, default=120.0)
    p.add_argument("--settle-s", type=float, default=15.0, help="versions published this close to the end are not timed")
    p.add_argument("--publish-every", type=int, default=4, help="the coordinator's --publish-every")
    p.add_argument("--stagger-s", type=float, default=0.5, help="between volunteer starts")
    p.add_argument("--gen-s", type=float, default=5.0,
                   help="seconds each volunteer's scripted generation takes per batch (a real one takes tens of "
                        "seconds; 0 = as fast as the client loop goes, which on 2 cores measures the machine at N = 32)")
    p.add_argument("--setup-timeout-s", type=float, default=600.0)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--keep-work-dir", action="store_true")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    result = run(args)
    write_result(args.json_out, result)
    print(json.dumps(result["goals"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
