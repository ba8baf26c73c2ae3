"""Client overhead: the full volunteer loop vs bare `engine.generate` on the same work.

    python bench/client_overhead.py --engine transformers --json-out /tmp/client_overhead_tf.json
    python bench/client_overhead.py --engine vllm --json-out /tmp/client_overhead_vllm.json

The client side is the real `Volunteer` (lease over P2P, generate, score, sign, spool to disk with
fsync, upload, wait for the ack, delete) talking to a real coordinator process over hivemind on
loopback. That coordinator is `AckOnlyCoordinator`: the real service (publisher, task board, full
ingest verification including reward re-scoring) with the learner loop replaced by "drain the queue",
so no training competes for the CPU and no new adapter versions arrive mid-measurement.

The bare side calls the same engine object's `generate` on the same number of prompt batches with the
same sampling parameters. Both are timed in this process in interleaved rounds (bare, client, bare,
client, ...) so drift in the machine's speed hits both alike (the machine is noisy). JSON: engine, client_rollouts_per_s,
bare_rollouts_per_s, ratio (= client / bare), plus the workload.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ack_only_coordinator(run_dir: str, group_size: int, prompts: int, max_new_tokens: int) -> None:
    """Entry point of the coordinator subprocess."""
    from asyncrl.coordinator.config import CoordinatorConfig
    from asyncrl.coordinator.service import Coordinator, install_signal_handlers

    class AckOnlyCoordinator(Coordinator):
        def run(self) -> dict:
            while not self.stop.is_set():
                self.ingest.take(1 << 30, max_wait_s=0.5, min_groups=1, stop=self.stop)
            return {}

    cfg = CoordinatorConfig(run_dir=run_dir, model="tiny", max_steps=0, group_size=group_size,
                            prompts_per_lease=prompts, max_new_tokens=max_new_tokens,
                            max_inflight_groups=1 << 20, max_leases_per_client=1 << 20, groups_per_step=1,
                            min_groups=1)
    coord = AckOnlyCoordinator(cfg, out=lambda s: print(s, flush=True))
    install_signal_handlers(coord.stop)
    try:
        coord.start()
        coord.run()
    finally:
        coord.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    p.add_argument("--batches", type=int, default=30, help="batches in the measured workload")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="bare/client rounds, interleaved")
    p.add_argument("--json-out", default=None)
    p.add_argument("--_coordinator", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._coordinator:
        ack_only_coordinator(args._coordinator, args.group_size, args.prompts, args.max_new_tokens)
        return 0

    import torch

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="asyncrl-overhead-"))
    run_dir = work / "coordinator"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    coord = subprocess.Popen([sys.executable, __file__, "--_coordinator", str(run_dir), "--prompts", str(args.prompts),
                              "--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens)],
                             stdout=open(work / "coordinator.log", "w"), stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
    try:
        deadline = time.time() + 180
        while not (run_dir / "join.txt").exists():
            if coord.poll() is not None or time.time() > deadline:
                print((work / "coordinator.log").read_text()[-2000:])
                raise SystemExit("coordinator did not start")
            time.sleep(0.2)
        address = (run_dir / "join.txt").read_text().strip()
        result = measure(args, address, work)
    finally:
        coord.terminate()
        try:
            coord.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(coord.pid, 9)
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


def measure(args, address: str, work: Path) -> dict:
    from asyncrl.client.worker import Volunteer, VolunteerConfig

    vol = Volunteer(VolunteerConfig(address=address, data_dir=work / "volunteer", name="bench",
                                    prompts_per_batch=args.prompts, engine=args.engine, display="quiet",
                                    max_batches=2, fixed_lease_size=True))  # the same prompts as the bare engine
    vol.connect()
    vol.run()  # warm-up: engine load, first adapter, first batches (not timed)
    engine = vol.engine
    leases, _ = vol._lease()  # (leases, retry_after_s)
    prompts = [list(vol.engine.tokenizer(l.prompt)["input_ids"]) for l in leases]
    sampling, group = leases[0].sampling, leases[0].group_size

    def bare(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            engine.generate(prompts, group, sampling)
        return time.perf_counter() - t0

    def client(n: int) -> tuple[float, int]:
        before = vol.status.batches_acked
        vol.cfg.max_batches = before + n
        vol.stop.clear()
        t0 = time.perf_counter()
        vol.run()
        return time.perf_counter() - t0, vol.status.batches_acked - before

    # Interleave bare and client rounds so drift in machine speed hits both alike.
    per_round = max(1, args.batches // args.rounds)
    bare_s, client_s, client_batches, ratios = 0.0, 0.0, 0, []
    for _ in range(args.rounds):
        b_s = bare(per_round)
        c_s, c_n = client(per_round)
        bare_s, client_s, client_batches = bare_s + b_s, client_s + c_s, client_batches + c_n
        ratios.append((c_n / c_s) / (per_round / b_s))
    vol.shutdown()
    per_batch = args.prompts * group
    bare_rps = args.rounds * per_round * per_batch / bare_s
    client_rps = client_batches * per_batch / client_s
    return {"engine": engine.name, "client_rollouts_per_s": client_rps, "bare_rollouts_per_s": bare_rps,
            "ratio": client_rps / bare_rps, "round_ratios": ratios, "bare_s": bare_s, "client_s": client_s,
            "batches": args.batches, "prompts_per_batch": args.prompts, "group_size": group,
            "max_new_tokens": sampling.max_new_tokens, "rejected": vol.status.batches_rejected}


if __name__ == "__main__":
    sys.exit(main())
