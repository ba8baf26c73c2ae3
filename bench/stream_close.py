"""Answers lost between two real nodes: does the handler's close order lose answered streams?

    python -m bench.stream_close --calls 20000 --inflight 32 --answer refuse --json-out runs/bench/stream_close.json

Two real `SwarmNode`s over loopback (each with its own hivemind DHT process and p2pd): a server, in a child
process of its own, and a caller here that makes `--calls` requests, `--inflight` at a time, on one handler.
The server answers each with 64 bytes (`--answer ok`) or a RATE_LIMITED error frame (`refuse`, what a stranger
past its serving rate gets). A call that reads no answer (the stream ended with 0 bytes) is "lost"; its phase
note ("opening the stream" / "awaiting the answer", swarm/transport.py `acall`) is counted.

Each handler order runs in the same invocation, one after the other, so the figures compare under one load:
`linger` is the shipped handler (it waits, bounded, for the caller to hang up before closing: docs/transport.md
"Who closes first"); `close-first` is the handler before 2026-12-05 (`_linger` replaced by a no-op in the
server process). JSON: per order, ok / refused / lost / seconds / phases, and the load average.

The server child gets its own session and its output goes to a file, and it is killed by process group when
the caller ends however it ends: a child holding the caller's stdout made an earlier version of this hang.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HANDLER = "bench-stream-close"
ORDERS = ("close-first", "linger")


def serve(order: str, answer: str) -> None:
    from asyncrl.protocol.errors import ProtocolError, RejectCode
    from asyncrl.swarm import transport

    if order == "close-first":
        async def close_at_once(gate, reader) -> None:
            return None

        transport._linger = close_at_once
    node = transport.SwarmNode()

    async def handler(request: bytes, peer: str) -> bytes:
        if answer == "refuse":
            raise ProtocolError(RejectCode.RATE_LIMITED, "serving rate for new peers reached; retry later")
        return b"x" * 64

    node.serve(HANDLER, handler, max_request_bytes=1024)
    print(node.peer_id, node.visible_maddrs()[0], flush=True)
    sys.stdin.read()  # until the caller closes our stdin (or dies)
    node.shutdown()


def measure(order: str, answer: str, calls: int, inflight: int, log_dir: Path) -> dict:
    from asyncrl.protocol.errors import ProtocolError
    from asyncrl.swarm.transport import SwarmNode

    with open(log_dir / f"server-{order}.log", "w") as log:
        child = subprocess.Popen([sys.executable, "-m", "bench.stream_close", "--serve", order, "--answer", answer],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                 start_new_session=True)
    node = None
    try:
        peer_id, maddr = child.stdout.readline().split()[:2]
        node = SwarmNode(initial_peers=[maddr if "/p2p/" in maddr else f"{maddr}/p2p/{peer_id}"])
        out = {"ok": 0, "refused": 0, "lost": 0, "phases": {}}

        async def worker(n: int) -> None:
            for _ in range(n):
                try:
                    await node.acall(peer_id, HANDLER, b"r" * 16, max_response_bytes=1024)
                    out["ok"] += 1
                except ProtocolError:
                    out["refused"] += 1
                except (asyncio.IncompleteReadError, ConnectionError) as exc:
                    out["lost"] += 1
                    phase = "; ".join(getattr(exc, "__notes__", [])) or "no phase noted"
                    out["phases"][phase] = out["phases"].get(phase, 0) + 1

        async def run_all() -> None:
            per, extra = divmod(calls, inflight)
            await asyncio.gather(*(worker(per + (i < extra)) for i in range(inflight)))

        t0 = time.monotonic()
        node.loops.run(run_all(), timeout=3600)
        out["seconds"] = round(time.monotonic() - t0, 1)
        return out
    finally:
        if node is not None:
            node.shutdown()
        try:
            child.stdin.close()
            child.wait(30)
        except Exception:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--inflight", type=int, default=32)
    ap.add_argument("--answer", choices=("ok", "refuse"), default="refuse")
    ap.add_argument("--orders", default=",".join(ORDERS), help="comma-separated, of: " + ", ".join(ORDERS))
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--serve", choices=ORDERS, default=None, help=argparse.SUPPRESS)  # the server child
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.answer)
        return 0
    orders = [o for o in args.orders.split(",") if o]
    if not orders or any(o not in ORDERS for o in orders) or args.calls < 1 or not 1 <= args.inflight <= 1024:
        ap.error("--orders must name some of close-first, linger; --calls >= 1; --inflight in 1..1024")
    result = {"calls": args.calls, "inflight": args.inflight, "answer": args.answer,
              "loadavg_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="stream-close-") as tmp:
        for order in orders:
            result[order] = measure(order, args.answer, args.calls, args.inflight, Path(tmp))
            print(order, json.dumps(result[order]), flush=True)
    result["loadavg_end"] = os.getloadavg()[0]
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
