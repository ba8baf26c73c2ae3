"""`asyncrl`: umbrella command.

    asyncrl demo --clients 2 --json-out demo.json    # coordinator + 2 volunteers on loopback
    asyncrl demo --run-dir runs/demo --overwrite     # replace an earlier demo run (refused otherwise)

Ctrl-C or SIGTERM stops every process the demo started and still prints the summary (asyncrl/demo.py).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while still importing, before the demo's own handlers: nothing started
        return 128 + 2


def _main(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl", description="asyncrl: volunteer-compute GRPO over hivemind")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a coordinator and K volunteers as separate processes on loopback")
    demo.add_argument("--clients", type=int, default=2)
    demo.add_argument("--steps", type=int, default=150, help="optimizer steps the coordinator runs")
    demo.add_argument("--run-dir", default="runs/demo", help="must be empty or new unless --overwrite")
    demo.add_argument("--overwrite", action="store_true", help="delete an earlier run in --run-dir first")
    demo.add_argument("--json-out", default=None)
    demo.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)
    if args.clients < 1:
        p.error("--clients must be >= 1")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    from asyncrl.demo import run_demo

    return run_demo(clients=args.clients, steps=args.steps, run_dir=args.run_dir, json_out=args.json_out,
                    timeout_s=args.timeout_s, overwrite=args.overwrite)


if __name__ == "__main__":
    sys.exit(main())
