"""`asyncrl-coordinator`: run a swarm's coordinator.

    asyncrl-coordinator run --model tiny --max-steps 150 --run-dir runs/demo
    asyncrl-coordinator run --model Qwen/Qwen2.5-0.5B-Instruct --port 31337 --announce /ip4/203.0.113.5/tcp/31337

Heavy imports (torch, hivemind) happen after argument parsing so `--help` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys


def build_parser() -> argparse.ArgumentParser:
    from asyncrl.coordinator.config import CoordinatorConfig

    d = CoordinatorConfig()
    p = argparse.ArgumentParser(prog="asyncrl-coordinator", description="asyncrl coordinator: learner + publisher")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start the coordinator and train until --max-steps")
    run.add_argument("--model", default=d.model, help="HF model id or local directory; 'tiny' = built-in test model")
    run.add_argument("--run-id", default=d.run_id)
    run.add_argument("--run-dir", default=d.run_dir)
    run.add_argument("--task", default=d.task)
    run.add_argument("--max-steps", type=int, default=d.max_steps, help="0 = until interrupted")
    run.add_argument("--lr", type=float, default=d.lr)
    run.add_argument("--lora-r", type=int, default=d.lora_r)
    run.add_argument("--groups-per-step", type=int, default=d.groups_per_step)
    run.add_argument("--min-groups", type=int, default=d.min_groups)
    run.add_argument("--max-wait-s", type=float, default=d.max_wait_s)
    run.add_argument("--max-staleness", type=int, default=d.max_staleness, help="-1 = unlimited")
    run.add_argument("--group-size", type=int, default=d.group_size)
    run.add_argument("--prompts-per-lease", type=int, default=d.prompts_per_lease)
    run.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    run.add_argument("--lease-timeout-s", type=float, default=d.lease_timeout_s)
    run.add_argument("--max-inflight-groups", type=int, default=d.max_inflight_groups)
    run.add_argument("--publish-every", type=int, default=d.publish_every)
    run.add_argument("--publish-dtype", default=d.publish_dtype, choices=["bf16", "fp16", "fp32"])
    run.add_argument("--host", default=d.host, help="IP to listen on (0.0.0.0 for all interfaces)")
    run.add_argument("--port", type=int, default=d.port, help="TCP port for libp2p (0 = any free port)")
    run.add_argument("--announce", action="append", default=[], help="multiaddr to announce (repeatable)")
    run.add_argument("--seed", type=int, default=d.seed)
    run.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from asyncrl.coordinator.config import ConfigError, CoordinatorConfig

    try:
        cfg = CoordinatorConfig(
            run_id=args.run_id, model=args.model, run_dir=args.run_dir, task=args.task, seed=args.seed,
            lr=args.lr, lora_r=args.lora_r, lora_alpha=2.0 * args.lora_r, max_steps=args.max_steps,
            groups_per_step=args.groups_per_step, min_groups=args.min_groups, max_wait_s=args.max_wait_s,
            max_staleness=None if args.max_staleness is not None and args.max_staleness < 0 else args.max_staleness,
            group_size=args.group_size, prompts_per_lease=args.prompts_per_lease,
            max_new_tokens=args.max_new_tokens, lease_timeout_s=args.lease_timeout_s,
            max_inflight_groups=args.max_inflight_groups,
            publish_every=args.publish_every, publish_dtype=args.publish_dtype, host=args.host, port=args.port,
            announce=tuple(args.announce)).validate()
    except ConfigError as exc:
        print(f"asyncrl-coordinator: invalid config: {exc}", file=sys.stderr)
        return 2

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from asyncrl.coordinator.service import Coordinator, install_signal_handlers

    coord = Coordinator(cfg, out=lambda s: print(s, flush=True))
    install_signal_handlers(coord.stop)
    try:
        coord.start()
        summary = coord.run()
    finally:
        coord.shutdown()
    print("summary " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
