"""A SwarmNode whose DHT process is gone answers TransportError at once, never blocks its caller.

Why: SIGTERM or Ctrl-C reaches a volunteer's whole process group, so its hivemind DHT child can die while
the main thread is inside a DHT get (the volunteer polling the adapter pointer after its coordinator went
away): hivemind's future would then never resolve and the volunteer would never finish stopping. A real
node, its real DHT child, ended by PID."""

from __future__ import annotations

import os
import signal
import time

import pytest

from asyncrl.swarm.transport import SwarmNode, TransportError

pytestmark = pytest.mark.integration


def test_get_and_store_refuse_once_the_dht_process_is_gone():
    node = SwarmNode()
    try:
        assert node.store("asyncrl/test/k", b"v", ttl=60) is not None
        assert node.get("asyncrl/test/k") == b"v"
        os.kill(node.dht.pid, signal.SIGKILL)  # the DHT child this test started
        node.dht.join(30)
        t0 = time.monotonic()
        for call in (lambda: node.get("asyncrl/test/k"), lambda: node.store("asyncrl/test/k", b"w", ttl=60)):
            with pytest.raises(TransportError):
                call()
        assert time.monotonic() - t0 < 10, "a call waited on a DHT process that no longer exists"
    finally:
        node.shutdown()
