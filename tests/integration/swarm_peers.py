"""Adversarial and probing peers for the swarm transport tests, run as separate processes.

    python -m tests.integration.swarm_peers tamper <swarmlab follow args>   # serves corrupted chunks
    python -m tests.integration.swarm_peers mallory ADDRESS --run-id R --coordinator PEER [--push-to PEER]
    python -m tests.integration.swarm_peers probe ADDRESS HANDLER CLAIMED_BYTES

- `TamperingProvider` is the real AdapterServer with one byte of every chunk flipped on the way out: a
  volunteer that fetched honestly and then lies (hivemind-style fault injection by subclassing).
- `mallory` runs a SwarmNode *without* our record validator (an attacker would not run it), forges a
  pointer signed by its own key under the coordinator's pointer key with a far-future expiration, and
  reports whether the network stored it; then pushes it to volunteers' `pointer` handler and keeps its
  own local copy alive so traversals meet it.
- `probe` opens a stream, sends only a frame header claiming CLAIMED_BYTES, never the body, and reports
  the answer: a server that checks the length first answers at once; one that tried to read the body
  would wait forever (the probe times out).
Each prints one JSON line per result.
"""

from __future__ import annotations

import os
import sys
import time

from asyncrl.swarm.streams import stream_name
from bench.swarmlab import emit


def tamper(argv: list[str]) -> int:
    from asyncrl.swarm.serving import AdapterServer

    from bench import swarmlab

    class TamperingProvider(AdapterServer):
        def outgoing_chunk(self, version: int, index: int, data: bytes) -> bytes:
            return bytes([data[0] ^ 0xFF]) + data[1:] if data else data

    return swarmlab.main(["follow", *argv], server_cls=TamperingProvider)


def mallory(argv: list[str]) -> int:
    import argparse
    import signal
    import threading

    from hivemind.utils import get_dht_time

    from asyncrl.protocol import envelope, messages, swarm
    from asyncrl.protocol.errors import ProtocolError
    from asyncrl.protocol.identity import Identity
    from asyncrl.swarm.transport import SwarmNode

    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("--run-id", required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--push-to", action="append", default=[])
    args = p.parse_args(argv)

    node = SwarmNode(initial_peers=[args.address])
    me = Identity.generate()
    forged = messages.AdapterPointer(run_id=args.run_id, version=999, manifest_sha256=os.urandom(32),
                                     keyframe_version=999, published_at=time.time() + 1000)
    sealed = envelope.seal(me, swarm.POINTER_KIND, messages.encode(forged))
    key = swarm.pointer_key(args.run_id, args.coordinator)
    expiration = get_dht_time() + 3000
    remote_ok = bool(node.dht.store(key, sealed, expiration, exclude_self=True))  # did any honest node take it?
    control_ok = bool(node.dht.store(f"asyncrl/{args.run_id}/mallory-note", b"hello", get_dht_time() + 60,
                                     exclude_self=True))
    emit("stored", forged_accepted=remote_ok, control_accepted=control_ok)
    node.dht.store(key, sealed, expiration)  # keep a local copy (no validator here): traversals meet it
    for peer in args.push_to:
        try:
            node.call(peer, stream_name(args.run_id, "pointer"), sealed, max_response_bytes=64)
            emit("pushed", peer=peer, code=None)
        except ProtocolError as exc:
            emit("pushed", peer=peer, code=exc.code.value)
        except Exception as exc:
            emit("pushed", peer=peer, code=f"transport:{exc.__class__.__name__}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    while not stop.wait(2.0):
        node.dht.store(key, sealed, get_dht_time() + 3000)
    node.shutdown()
    return 0


def probe(argv: list[str]) -> int:
    import asyncio

    from hivemind.p2p import PeerID

    from asyncrl.swarm.transport import HEADER, SwarmNode, _read_frame

    address, handler, claimed = argv[0], argv[1], int(argv[2])
    node = SwarmNode(initial_peers=[address])
    peer = address.rsplit("/p2p/", 1)[1]

    async def go():
        _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler)
        t0 = time.monotonic()
        writer.write(claimed.to_bytes(HEADER, "big"))  # the header only: the body never comes
        await writer.drain()
        status = await asyncio.wait_for(reader.readexactly(1), 30)
        body = await asyncio.wait_for(_read_frame(reader, 1 << 16), 30)
        writer.close()
        return status[0], body.decode(errors="replace"), time.monotonic() - t0

    try:
        status, body, seconds = node.loops.run(go(), timeout=60)
        emit("probe", status=status, code=body.partition(":")[0], seconds=round(seconds, 3))
    except Exception as exc:
        emit("probe", status=None, code=f"no answer: {exc.__class__.__name__}", seconds=None)
    node.shutdown()
    return 0


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    sys.exit({"tamper": tamper, "mallory": mallory, "probe": probe}[command](rest))
