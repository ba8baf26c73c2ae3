"""Broadcast benchmark: how fast a new adapter version reaches N volunteers, and what it costs the
coordinator's uplink (issue 4; results in docs/transport.md).

    .venv/bin/python bench/broadcast.py --clients 8 --json-out runs/bench/broadcast.json

One lab publisher (`bench.swarmlab publish`: the real Publisher, codec, signed pointer, DHT validator
and AdapterServer, no model) and N lab followers (`bench.swarmlab follow`: the real AdapterSync,
SwarmFetcher, AdapterServer and presence beacon, no model), each a separate OS process with its own
hivemind DHT and p2pd, on 127.0.0.1. The adapter is a synthetic Qwen2.5-1.5B-shaped rank-16 LoRA
(36.9 MB raw bf16) that evolves like early AdamW steps (bench/synthetic_adapter.py).

Protocol: wait until every follower sees all N presence records; then for each of `--versions`
versions: publish (the clock starts when the signed pointer is stored), wait until every follower has
verified + decoded it (or `--version-timeout-s`), pause `--gap-s`, next. Reported:

  adapter_compressed_bytes            mean payload per version (keyframe + deltas)
  coordinator_sent_bytes_per_version  mean bytes the publisher's AdapterServer sent (manifests + chunks)
  uplink_ratio                        the two divided (a star would be N)
  t95_p50_s / t95_p95_s               per version: seconds from publish until 95 % of followers hold it
                                      verified and decoded; median / 95th percentile over versions
  corrupt_loads                       loads whose tensor digest (crc32 over the decoded tensors, in
                                      manifest order) differs from the publisher's (must be 0)
  fetch_s_max_p50 / decode_s_max_p50  per version, the slowest follower's fetch (pointer in hand ->
                                      manifest + every chunk verified) and decode; median over versions
  cpu_s_per_version                   CPU seconds per version by role:process (main / dht / p2pd)
  peak_rss_mb                         all processes of the benchmark together (p2pd daemons included)

Every event of every process is kept in <work-dir>/<name>.events.jsonl (`--work-dir` to keep them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/broadcast.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import REPO, provenance, write_result  # noqa: E402


class Proc:
    """A child in its own session whose stdout JSON lines land in a queue."""

    def __init__(self, name: str, args: list[str], log_dir: Path, stdin=False, prefix: tuple[str, ...] = ()):
        """`prefix`: run under another command, e.g. ("ip", "netns", "exec", NS) (bench/broadcast_wan.py)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.name = name
        self.err = open(log_dir / f"{name}.log", "w")
        self.p = subprocess.Popen([*prefix, sys.executable, "-m", "bench.swarmlab", *args], cwd=REPO, env=env,
                                  stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=self.err, text=True, start_new_session=True)
        self.events: queue.Queue = queue.Queue()
        self.record = open(log_dir / f"{name}.events.jsonl", "w")  # every event, for a look afterwards
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.record.write(line)
            self.record.flush()
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                pass

    def send(self, line: str) -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def wait_event(self, kind: str, timeout: float, pred=lambda e: True) -> dict:
        deadline = time.time() + timeout
        while True:
            left = deadline - time.time()
            if left <= 0 or self.p.poll() is not None and self.events.empty():
                raise TimeoutError(f"{self.name}: no {kind!r} event (exit {self.p.poll()})")
            try:
                event = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if event.get("event") == kind and pred(event):
                return event

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.p.pid, signal.SIGKILL)  # p2pd and the DHT fork of this session
        except ProcessLookupError:
            pass


def cpu_seconds(sessions: dict[int, str]) -> dict[str, float]:
    """CPU seconds used so far by every process in the given sessions, summed by role:process kind
    (main = the Python process we started, dht = its hivemind DHT process, p2pd = the libp2p daemon)."""
    hz = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            rest = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            sid = int(rest[3])  # state ppid pgrp session ...
            if sid not in sessions:
                continue
            comm = open(f"/proc/{pid}/comm").read().strip()
        except (OSError, ValueError, IndexError):
            continue
        kind = "p2pd" if comm == "p2pd" else "main" if int(pid) == sid else "dht"
        key = f"{sessions[sid]}:{kind}"
        out[key] = out.get(key, 0.0) + (int(rest[11]) + int(rest[12])) / hz
    return out


class MemorySampler:
    """Peak total RSS of every process in the given sessions (our children, their DHT forks, p2pd)."""

    def __init__(self, sessions: list[int]):
        self.sessions = set(sessions)
        self.peak_mb = 0.0
        self._stop = threading.Event()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            total = 0
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    stat = open(f"/proc/{pid}/stat").read()
                    sid = int(stat.rsplit(")", 1)[1].split()[3])  # state ppid pgrp session
                    if sid in self.sessions:
                        total += int(open(f"/proc/{pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                except (OSError, ValueError, IndexError):
                    continue
            self.peak_mb = max(self.peak_mb, total / 2**20)

    def stop(self) -> None:
        self._stop.set()


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def run(args) -> dict:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="asyncrl-broadcast-"))
    if work.exists() and args.work_dir:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        pub = Proc("publisher", ["publish", "--run-dir", str(work / "publisher"), "--layers", str(args.layers),
                                 "--chunk-bytes", str(args.chunk_bytes), "--keyframe-every", str(args.keyframe_every),
                                 "--control"], work, stdin=True)
        procs.append(pub)
        ready = pub.wait_event("ready", 120)
        followers = [Proc(f"f{i}", ["follow", ready["join"], "--data-dir", str(work / f"f{i}"), "--name", f"f{i}",
                                    "--run-id", "lab", "--poll-s", str(args.poll_s), "--digest", "crc32"], work)
                     for i in range(args.clients)]
        procs += followers
        sampler = MemorySampler([p.p.pid for p in procs])
        t_setup = time.time()
        for f in followers:  # everyone sees everyone: the seeding assignment is then the same for all
            f.wait_event("peers", 180, lambda e: e["peers"] >= args.clients)
        setup_s = time.time() - t_setup
        need = math.ceil(0.95 * args.clients)
        rows, corrupt, loads = [], 0, 0
        roles = {pub.p.pid: "publisher", **{f.p.pid: "followers" for f in followers}}
        cpu_by_version = []
        for v in range(args.versions):
            pub.send("publish")
            published = pub.wait_event("published", 120, lambda e: e["version"] == v)
            cpu_before = cpu_seconds(roles)  # after the encode: from about the pointer's store on
            delays, fetch_s, decode_s = [], [], []
            for f in followers:
                try:
                    held = f.wait_event("held", args.version_timeout_s, lambda e: e["version"] >= v)
                except TimeoutError:
                    continue
                loads += 1
                if held["version"] == v:
                    corrupt += held["digest"] != published["digests"]["crc32"]
                    delays.append(held["t_held"] - published["t_publish"])
                    timings = held.get("timings", {})
                    fetch_s.append(timings.get("manifests_s", 0.0) + timings.get("chunks_s", 0.0))
                    decode_s.append(timings.get("decode_s", 0.0))
            cpu_after = cpu_seconds(roles)
            cpu_by_version.append({k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after})
            delays.sort()
            t95 = delays[need - 1] if len(delays) >= need else float("inf")
            rows.append({"version": v, "codec": published["codec"], "compressed_bytes": published["compressed_bytes"],
                         "t95_s": round(t95, 3), "t_all_s": round(delays[-1], 3) if len(delays) == args.clients else None,
                         "t_first_s": round(delays[0], 3) if delays else None, "holders": len(delays),
                         # per follower, once it had the pointer: manifest + all chunks verified / decode
                         "fetch_s_max": round(max(fetch_s), 3) if fetch_s else None,
                         "decode_s_max": round(max(decode_s), 3) if decode_s else None})
            print(f"v{v} {published['codec']:24s} {published['compressed_bytes'] / 1e6:6.2f} MB  t95 {t95:6.2f}s  "
                  f"held by {len(delays)}/{args.clients}  (slowest fetch {max(fetch_s, default=0):.2f}s, "
                  f"slowest decode {max(decode_s, default=0):.2f}s)", flush=True)
            time.sleep(args.gap_s)
        pub.send("stats")
        stats = pub.wait_event("stats", 30)
        sampler.stop()
        for row in rows:
            row["coordinator_sent_bytes"] = stats["bytes_by_version"].get(str(row["version"]), 0)
        compressed = sum(r["compressed_bytes"] for r in rows) / len(rows)
        sent = sum(r["coordinator_sent_bytes"] for r in rows) / len(rows)
        t95s = [r["t95_s"] for r in rows]
        fetch_max = [r["fetch_s_max"] for r in rows if r["fetch_s_max"] is not None]
        decode_max = [r["decode_s_max"] for r in rows if r["decode_s_max"] is not None]
        fetch = []
        for f in followers:
            try:
                fetch.append(json.loads((work / f.name / "status.json").read_text())["fetch"])
            except (OSError, KeyError, json.JSONDecodeError):
                pass
        return {
            "clients": args.clients, "versions": args.versions,
            "adapter_raw_bytes": ready["raw_bytes"],
            "adapter_compressed_bytes": round(compressed),
            "coordinator_sent_bytes_per_version": round(sent),
            "uplink_ratio": round(sent / compressed, 3),
            "t95_p50_s": round(percentile(t95s, 50), 3), "t95_p95_s": round(percentile(t95s, 95), 3),
            "corrupt_loads": corrupt, "loads": loads,
            "fetch_s_max_p50": round(percentile(fetch_max, 50), 3) if fetch_max else None,
            "decode_s_max_p50": round(percentile(decode_max, 50), 3) if decode_max else None,
            "hash_mismatches": sum(s.get("hash_mismatches", 0) for s in fetch),
            "bytes_from_peers": sum(s.get("bytes_from_peers", 0) for s in fetch),
            "bytes_from_coordinator": sum(s.get("bytes_from_coordinator", 0) for s in fetch),
            "peak_rss_mb": round(sampler.peak_mb), "setup_s": round(setup_s, 1),
            "cpu_s_per_version": {k: round(sum(c.get(k, 0.0) for c in cpu_by_version) / len(cpu_by_version), 2)
                                  for k in sorted({k for c in cpu_by_version for k in c})},
            "per_version": rows,
            "settings": {"layers": args.layers, "chunk_bytes": args.chunk_bytes, "keyframe_every": args.keyframe_every,
                         "poll_s": args.poll_s, "gap_s": args.gap_s},
            **provenance(),
        }
    finally:
        for p in reversed(procs):
            p.stop()
        if not args.keep_work_dir and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--versions", type=int, default=10)
    p.add_argument("--layers", type=int, default=28, help="28 = Qwen2.5-1.5B")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--keyframe-every", type=int, default=10)
    p.add_argument("--poll-s", type=float, default=2.0, help="followers' DHT pointer poll interval (pushes come first)")
    p.add_argument("--gap-s", type=float, default=1.0, help="pause after every follower holds a version")
    p.add_argument("--version-timeout-s", type=float, default=60.0)
    p.add_argument("--work-dir", default=None, help="keep logs and status files here (default: a temp dir)")
    p.add_argument("--keep-work-dir", action="store_true")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    result = run(args)
    write_result(args.json_out, result)
    keys = ("clients", "versions", "adapter_compressed_bytes", "coordinator_sent_bytes_per_version", "uplink_ratio",
            "t95_p50_s", "t95_p95_s", "corrupt_loads", "fetch_s_max_p50", "decode_s_max_p50", "peak_rss_mb",
            "cpu_s_per_version")
    print(json.dumps({k: result[k] for k in keys}, indent=2))
    ok = result["uplink_ratio"] <= 2.0 and result["t95_p95_s"] <= 3.0 and result["corrupt_loads"] == 0
    print("targets (uplink_ratio <= 2.0, t95_p95_s <= 3.0, corrupt_loads == 0):", "met" if ok else "MISSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
