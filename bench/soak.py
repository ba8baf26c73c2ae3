"""Soak: tens of thousands of accepted batches into a real coordinator — does its memory stay flat and does
handling stay as fast at the end as at the start?

    python bench/soak.py --batches 20000 --json-out runs/bench/soak.json

The coordinator is the real one (`asyncrl-coordinator run --model tiny`, its own process: learner, ingest,
journal, checkpoints every 50 steps, trust state, publisher), with the generation audit off (the synthetic
logprobs below are not a model's) and rate limits raised (the volunteers are ours). The volunteers are
synthetic and model-free, in this process: each has its own key and its own SwarmNode (its peer id is its
key, as a real volunteer's), leases prompts over P2P, answers each lease with two pre-generated completions
(random tokens, random logprobs; the reward is computed with the task's real reward function, as the
coordinator recomputes it), seals the batch at upload and submits it. One lease group per batch, so the
batch count is what grows.

Measured: the coordinator's RSS (/proc/<pid>/status VmRSS) every `--sample-every` accepted batches, and
each submit's round trip as a volunteer sees it (sealing excluded). JSON: batches_accepted, wall_s,
rss_start / rss_end (MB, after `--warmup` batches / at the end), rss_slope_mb_per_10k (least squares over the
samples after warm-up; goal <= 20), handler_p99_ms {"start", "end"} (p99 of the first / last `--window`
batches after warm-up; goal end <= 2 x start), the load average (`uptime`) at start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_NEW_TOKENS = 8  # the coordinator's --max-new-tokens; every synthetic completion is this long


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS")


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def slope_per_10k(points: list[tuple[int, float]]) -> float:
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return 10_000 * sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def p99(xs: list[float]) -> float:
    return quantile(xs, 0.99)


class SyntheticVolunteer(threading.Thread):
    """Lease -> answer each lease with pre-generated completions -> seal at upload -> submit, until told to stop."""

    def __init__(self, join: str, run_id: str, coordinator_peer: str, pool, prompts_per_lease: int, rec):
        super().__init__(daemon=True)
        from asyncrl.protocol.identity import Identity, public_key_from_peer_id
        from asyncrl.swarm.transport import SwarmNode

        self.identity = Identity.generate()
        self.tmp = Path(tempfile.mkdtemp(prefix="soak-vol-"))
        self.identity.write_libp2p_identity(self.tmp / "p2p.identity")
        self.node = SwarmNode(initial_peers=[join], identity_path=str(self.tmp / "p2p.identity"))
        self.run_id, self.peer = run_id, coordinator_peer
        self.audience = public_key_from_peer_id(coordinator_peer)
        self.pool, self.prompts_per_lease, self.rec = pool, prompts_per_lease, rec
        self.stop = threading.Event()
        self.errors: dict[str, int] = {}
        self.examples: dict[str, str] = {}  # the first message seen for each error code

    def _error(self, code: str, message: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1
        self.examples.setdefault(code, message[:300])

    def run(self) -> None:
        from asyncrl import tasks
        from asyncrl.protocol import envelope, messages
        from asyncrl.protocol.errors import ProtocolError
        from asyncrl.swarm import streams
        from asyncrl.swarm.streams import stream_name
        from asyncrl.swarm.transport import TransportError

        rng = random.Random(self.identity.fingerprint)
        lease_stream, submit_stream = stream_name(self.run_id, streams.LEASE), stream_name(self.run_id, streams.SUBMIT)
        while not self.stop.is_set():
            try:
                req = messages.LeaseRequest(run_id=self.run_id, max_prompts=self.prompts_per_lease, adapter_version=0,
                                            client_name="soak")
                raw = self.node.call(self.peer, lease_stream, envelope.seal(self.identity, "lease_request",
                                     messages.encode(req), audience=self.audience), max_response_bytes=4 << 20)
                grant = messages.decode(raw, messages.LeaseGrant, max_bytes=4 << 20)
                if not grant.leases:
                    time.sleep(0.05)
                    continue
                for lease in grant.leases:
                    comps = []
                    for _ in range(lease.group_size):
                        toks, lps, text = self.pool[rng.randrange(len(self.pool))]
                        comps.append(messages.Completion(toks, lps, tasks.score(lease.reward, text, lease.answer), "length"))
                    group = messages.RolloutGroup(lease.lease_id, lease.prompt_id, lease.prompt_token_ids, tuple(comps))
                    batch = messages.RolloutBatch(run_id=self.run_id, adapter_version=grant.current_version,
                                                  client_name="soak", sampling=lease.sampling, groups=(group,),
                                                  generated_at=time.time(), engine_dtype="fp32")
                    sealed = envelope.seal(self.identity, "rollout_batch", messages.encode(batch), audience=self.audience)
                    t0 = time.perf_counter()
                    raw = self.node.call(self.peer, submit_stream, sealed, max_response_bytes=64 * 1024)
                    ms = (time.perf_counter() - t0) * 1000.0
                    ack = messages.decode(raw, messages.Ack, max_bytes=64 * 1024)
                    if ack.accepted and ack.code is None:
                        self.rec(ms)
                    else:
                        self._error(ack.code or "?", f"submit refused: {ack.detail}")
            except ProtocolError as exc:
                self._error(exc.code.value, str(exc))
                time.sleep(0.2)
            except TransportError as exc:
                self._error("transport", str(exc))
                time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=20_000, help="accepted batches to reach")
    ap.add_argument("--volunteers", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2000, help="batches before memory and latency are compared")
    ap.add_argument("--window", type=int, default=2000, help="batches in each latency window")
    ap.add_argument("--sample-every", type=int, default=250, help="RSS sample interval, in accepted batches")
    ap.add_argument("--max-minutes", type=float, default=15.0)
    ap.add_argument("--json-out", default="runs/bench/soak.json")
    args = ap.parse_args()

    sys.path.insert(0, str(REPO))
    import numpy as np

    from asyncrl.models import tinymodel

    run = Path(tempfile.mkdtemp(prefix="soak-run-"))
    coord_args = [sys.executable, "-m", "asyncrl.coordinator.cli", "run", "--model", "tiny", "--run-dir", str(run),
                  "--run-id", "soak", "--max-steps", "0", "--threads", "1", "--no-dashboard", "--no-audit",
                  "--group-size", "2", "--max-new-tokens", str(MAX_NEW_TOKENS), "--groups-per-step", "64", "--min-groups", "1",
                  "--max-wait-s", "0.5", "--max-inflight-groups", "512", "--prompts-per-lease", "8",
                  "--checkpoint-every", "50", "--identity-rate", "2000", "--identity-burst", "4000",
                  "--peer-rate", "4000", "--peer-burst", "8000", "--new-identity-burst", "64"]
    log = open(run / "coordinator.log", "w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    coord = subprocess.Popen(coord_args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    vols: list[SyntheticVolunteer] = []
    try:
        join_txt = run / "join.txt"
        deadline = time.time() + 300
        while not (join_txt.exists() and join_txt.read_text().strip()):
            if coord.poll() is not None or time.time() > deadline:
                raise SystemExit(f"coordinator did not start: {(run / 'coordinator.log').read_text()[-2000:]}")
            time.sleep(0.5)
        join = join_txt.read_text().strip()
        tok = tinymodel.build_tokenizer()
        rng = np.random.default_rng(0)
        pool = []
        for _ in range(256):  # pre-generated completions: random tokens from the vocabulary, random logprobs;
            # all of max_new_tokens without a stop token, so "length" is their true finish reason (ingest checks it)
            toks = rng.integers(1, len(tinymodel.CHARS) + 1, size=MAX_NEW_TOKENS).astype("<i4")
            lps = (-rng.uniform(0.1, 5.0, size=len(toks))).astype("<f4")
            pool.append((toks.tobytes(), lps.tobytes(), tok.decode(toks.tolist(), skip_special_tokens=True)))
        lock = threading.Lock()
        latencies: list[float] = []
        samples: list[tuple[int, float]] = []

        def rec(ms: float) -> None:
            with lock:
                latencies.append(ms)
                n = len(latencies)
            if n % args.sample_every == 0:
                samples.append((n, rss_mb(coord.pid)))

        load_start = load()
        t0 = time.time()
        peer = join.rsplit("/p2p/", 1)[1]
        for _ in range(args.volunteers):
            vols.append(SyntheticVolunteer(join, "soak", peer, pool, 8, rec))
        samples.append((0, rss_mb(coord.pid)))
        for v in vols:
            v.start()
        last = 0
        while len(latencies) < args.batches:
            if time.time() - t0 > args.max_minutes * 60:
                print(f"stopped at the time limit with {len(latencies)} batches", flush=True)
                break
            if coord.poll() is not None:
                raise SystemExit(f"coordinator died: {(run / 'coordinator.log').read_text()[-2000:]}")
            time.sleep(2.0)
            if len(latencies) - last >= 1000:
                last = len(latencies)
                print(f"{last:6d} batches  {time.time() - t0:6.0f} s  coordinator RSS {samples[-1][1]:.0f} MB", flush=True)
        wall = time.time() - t0
        for v in vols:
            v.stop.set()
        for v in vols:
            v.join(30)
        n = len(latencies)
        after = [(x, y) for x, y in samples if x >= args.warmup]
        result = {
            "batches_accepted": n, "wall_s": round(wall, 1), "volunteers": args.volunteers,
            "batches_per_s": round(n / wall, 1) if wall else 0.0,
            "rss_start": round(after[0][1], 1) if after else None, "rss_end": round(samples[-1][1], 1),
            "rss_at_0": round(samples[0][1], 1), "rss_samples": [(x, round(y, 1)) for x, y in samples],
            "rss_slope_mb_per_10k": round(slope_per_10k(after), 2),
            "handler_p99_ms": {"start": round(p99(latencies[args.warmup:args.warmup + args.window]), 2),
                               "end": round(p99(latencies[-args.window:]), 2)},
            "handler_p50_ms": {"start": round(quantile(latencies[args.warmup:args.warmup + args.window], 0.5), 2),
                               "end": round(quantile(latencies[-args.window:], 0.5), 2)},
            "volunteer_errors": {k: sum(v.errors.get(k, 0) for v in vols) for k in {k for v in vols for k in v.errors}},
            "volunteer_error_examples": {k: m for v in vols for k, m in v.examples.items()},
            "goals": {"rss_slope_mb_per_10k": 20, "handler_p99_end_over_start": 2.0, "batches": args.batches,
                      "minutes": 15},
            "load_start": load_start, "load_end": load(),
        }
        p = result["handler_p99_ms"]
        result["met"] = {"batches": n >= args.batches and wall <= 15 * 60,
                         "rss_slope": result["rss_slope_mb_per_10k"] <= 20,
                         "p99": bool(p["start"]) and p["end"] <= 2 * p["start"]}
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "rss_samples"}, indent=1), flush=True)
        return 0
    finally:
        for v in vols:
            try:
                v.node.shutdown()
            except Exception:
                pass
        if coord.poll() is None:
            os.killpg(coord.pid, signal.SIGTERM)
            try:
                coord.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(coord.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
