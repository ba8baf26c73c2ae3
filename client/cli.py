"""`asyncrl-client`: lend a GPU (or CPU) to an asyncrl swarm.

    asyncrl-client join /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...   # what the coordinator printed
    asyncrl-client status

Heavy imports (torch, hivemind, transformers) are deferred until after argument parsing, so `--help`
answers at once and a bad address fails before anything starts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "asyncrl" / "client"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl-client", description="asyncrl volunteer client")
    sub = p.add_subparsers(dest="command", required=True)
    join = sub.add_parser("join", help="join a swarm at ADDRESS and contribute rollouts")
    join.add_argument("address", help="the multiaddr the coordinator printed (ends in /p2p/<peer id>)")
    join.add_argument("--data-dir", type=Path, default=default_data_dir(), help="identity, outbox, status")
    join.add_argument("--name", default="", help="display name shown to the operator")
    join.add_argument("--model", default=None, help="local copy of the base model (default: the manifest's)")
    join.add_argument("--max-batches", type=int, default=0, help="stop after this many acked batches (0 = never)")
    join.add_argument("--prompts-per-batch", type=int, default=4)
    join.add_argument("--client-mode", action="store_true",
                      help="behind NAT: do not accept incoming DHT connections (outbound only)")
    join.add_argument("--seed", type=int, default=0)
    join.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    join.add_argument("--quiet", action="store_true")
    status = sub.add_parser("status", help="identity, outbox size and contribution so far")
    status.add_argument("--data-dir", type=Path, default=default_data_dir())
    return p


def fail(message: str, code: int = 1) -> int:
    print(f"asyncrl-client: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "status":
        path = args.data_dir / "status.json"
        if not path.exists():
            return fail(f"no status in {args.data_dir} (has this volunteer joined yet?)")
        print(json.dumps(json.loads(path.read_text()), indent=2))
        return 0

    from asyncrl.transport import BadAddress, TransportError, check_reachable, parse_join_address

    try:
        check_reachable(parse_join_address(args.address))
    except BadAddress as exc:
        return fail(str(exc), 2)
    except TransportError as exc:
        return fail(str(exc))

    from asyncrl.protocol.errors import ProtocolError

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from asyncrl.client.worker import Volunteer, VolunteerConfig

    cfg = VolunteerConfig(address=args.address, data_dir=args.data_dir, name=args.name, model=args.model,
                          max_batches=args.max_batches, prompts_per_batch=args.prompts_per_batch,
                          client_mode=args.client_mode, seed=args.seed, quiet=args.quiet)
    try:
        vol = Volunteer(cfg, out=lambda s: print(s, flush=True))
    except ProtocolError as exc:
        return fail(f"{args.address!r}: {exc.detail}", 2)

    def on_signal(signum, frame):
        if vol.stop.is_set():
            raise KeyboardInterrupt
        print("stopping after the current batch (Ctrl-C again to abort; the outbox is kept)", flush=True)
        vol.stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        vol.connect()
        print(f"joined as {vol.name} ({vol.identity.fingerprint}); run {vol.run_id}", flush=True)
        status = vol.run()
    except TransportError as exc:
        return fail(str(exc))
    except ProtocolError as exc:
        return fail(f"{exc.code.value}: {exc.detail}")
    except KeyboardInterrupt:
        return fail("aborted; unsent batches stay in the outbox", 130)
    except Exception as exc:
        return fail(f"{exc.__class__.__name__}: {exc}")
    finally:
        vol.shutdown()
    print(f"done: {status.batches_acked} batches acked, {status.rollouts} rollouts, "
          f"versions {status.versions_loaded[:1]}..{status.versions_loaded[-1:]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
