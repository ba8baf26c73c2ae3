"""Mallory's coordinator: answers the handshake at an address whose peer id is hers, but hands out an
adapter pointer signed by another key (alice's, the real coordinator's) — what a volunteer would meet if
someone relayed a coordinator's records under their own address. Used by tests/integration/test_doctor.py.

    python -m tests.integration.impostor --run-dir DIR      # writes DIR/join.txt, serves until killed
"""

from __future__ import annotations

import argparse
import hashlib
import signal
import threading
import time
from pathlib import Path

from asyncrl.protocol import envelope, handshake, messages, swarm
from asyncrl.protocol.identity import Identity
from asyncrl.swarm import streams
from asyncrl.swarm.transport import SwarmNode


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    args = p.parse_args()
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    mallory, alice = Identity.generate(), Identity.generate()
    mallory.write_libp2p_identity(run / "p2p.identity")
    node = SwarmNode(host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(run / "p2p.identity"))
    pointer = envelope.seal(alice, swarm.POINTER_KIND, messages.encode(messages.AdapterPointer(
        run_id="demo", version=0, manifest_sha256=hashlib.sha256(b"x").digest(), keyframe_version=0,
        published_at=time.time())))

    async def info(request: bytes, peer: str) -> bytes:
        return handshake.encode(handshake.CoordinatorInfo(
            run_id="demo", asyncrl_version=handshake.package_version(), protocol=handshake.PROTOCOL_VERSION,
            schema=handshake.SCHEMA_VERSION, time=envelope.clock(), window_s=300.0, pointer=pointer))

    node.serve(streams.INFO, info, max_request_bytes=handshake.MAX_INFO_REQUEST_BYTES)
    addr = next(m for m in node.visible_maddrs() if "127.0.0.1" in m)
    addr = addr if "/p2p/" in addr else f"{addr}/p2p/{node.peer_id}"
    (run / "join.txt").write_text(addr + "\n")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    node.shutdown()


if __name__ == "__main__":
    main()
