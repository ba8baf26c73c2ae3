"""Peers for tests/integration/test_stream_burst.py, one SwarmNode per process as in the product.

`serve`: echo handler plus a `stall` handler that blocks the node's event loop for `--stall-s`; prints
{"join": ...} and serves until killed. `burst JOIN PEER`: asks for one stall, and while the loop is
stalled opens `--streams` echo calls at once; prints {"outcomes": {outcome: count}} and exits."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections import Counter

from asyncrl.protocol.errors import ProtocolError
from asyncrl.swarm.transport import SwarmNode


def serve(args) -> None:
    node = SwarmNode()

    async def echo(request: bytes, peer: str) -> bytes:
        return request

    async def stall(request: bytes, peer: str) -> bytes:
        time.sleep(args.stall_s)  # on the loop: it accepts no stream meanwhile, as a GIL-starved loop would not
        return b"stalled"

    node.serve("asyncrl.test.echo", echo, max_request_bytes=1024)
    node.serve("asyncrl.test.stall", stall, max_request_bytes=1024)
    join = f"{node.visible_maddrs()[0]}/p2p/{node.peer_id}"
    print(json.dumps({"event": "ready", "join": join, "peer_id": node.peer_id}), flush=True)
    threading.Event().wait()


def burst(args) -> None:
    node = SwarmNode(initial_peers=[args.join])
    assert node.call(args.peer, "asyncrl.test.echo", b"warm", max_response_bytes=64) == b"warm"

    async def one() -> str:
        try:
            answer = await asyncio.wait_for(node.acall(args.peer, "asyncrl.test.echo", b"hello",
                                                       max_response_bytes=64), 60)
            return "OK" if answer == b"hello" else "WRONG_ANSWER"
        except ProtocolError as exc:
            return exc.code.value
        except asyncio.TimeoutError:
            return "no answer within 60 s"
        except Exception as exc:  # what the test is about: a stream closed without an answer
            return f"unanswered: {exc.__class__.__name__}"

    async def run() -> Counter:
        stalled = asyncio.ensure_future(node.acall(args.peer, "asyncrl.test.stall", b"", max_response_bytes=64))
        await asyncio.sleep(0.5)  # the stall has reached the server's loop
        outcomes = Counter(await asyncio.gather(*(one() for _ in range(args.streams))))
        assert await stalled == b"stalled"
        return outcomes

    outcomes = node.loops.run(run(), timeout=180)
    print(json.dumps({"event": "outcomes", "outcomes": dict(outcomes)}), flush=True)
    node.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--stall-s", type=float, default=3.0)
    b = sub.add_parser("burst")
    b.add_argument("join")
    b.add_argument("peer")
    b.add_argument("--streams", type=int, default=150)
    args = p.parse_args(argv)
    (serve if args.cmd == "serve" else burst)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
