"""What asyncrl uses of hivemind's private API, in one place, checked against hivemind==1.1.12 (pyproject pins it).

hivemind's public API has no way to (a) connect to a peer at a given address (p2pd's control client has it:
`P2P._client.connect`), (b) pass p2pd a flag hivemind does not expose (`P2P._make_process_args`),
(c) choose the accept backlog of the unix socket p2pd hands inbound streams to (`ControlClient.listen`), or
(d) recover MPFuture's process-shared update lock from a DHT process killed while it held it
(`MPFuture._update_lock`).
Everything else in swarm/ goes through hivemind's public names. A hivemind upgrade re-checks exactly this
file: `tests/transport/test_hivemind_private.py` fails when a name used here is gone.

    connect(p2p, peer, addrs)   dial `peer` at `addrs` (multiaddrs) through p2pd
    apply_patches()             the two process-wide patches below, once, before any p2pd starts
    free_orphaned_update_lock() after a DHT process died by a signal: the lock it may have died holding
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

HIVEMIND_VERSION_CHECKED = "1.1.12"


async def connect(p2p, peer, addrs) -> None:
    """Open a libp2p connection to `peer` (a hivemind PeerID) at `addrs` (Multiaddr list) via p2pd."""
    await p2p._client.connect(peer, addrs)


ORPHAN_WAIT_S = 5.0  # a live holder keeps the lock for one pipe write (microseconds; a loaded machine: far below this)


def free_orphaned_update_lock(wait_s: float = ORPHAN_WAIT_S) -> bool:
    """Release MPFuture's update lock if nobody releases it within `wait_s`; True when it had to.

    hivemind's MPFuture serialises every cross-process result with ONE `multiprocessing.Lock` created at import
    and shared by this process and every process forked from it (its DHT processes). A DHT process killed while
    it held that lock (hivemind's own `DHT.shutdown` terminates one that missed its grace period; SwarmNode
    kills one that ignores SIGTERM) leaves it held for good, and from then on every DHT this process starts
    hangs in `hivemind.DHT(...)` before it is ready (its "ready" result cannot be sent). Call this only after
    such a kill, when the process is dead: a lock still held `wait_s` later belonged to it (a live holder
    writes one message and lets go)."""
    from hivemind.utils.mpfuture import MPFuture

    lock = MPFuture._update_lock
    if lock.acquire(timeout=wait_s):
        lock.release()
        return False
    lock.release()  # a multiprocessing.Lock may be released by any process; its dead holder never will
    return True


def apply_patches() -> None:
    """Both patches, idempotent; call before the first hivemind.DHT / P2P is created in this process
    (the DHT process forks from it and inherits them)."""
    global _PATCHED
    if _PATCHED:
        return
    _static_relays_patch()
    _listen_backlog_patch()
    _PATCHED = True


_PATCHED = False


def _static_relays_patch() -> None:
    """Make p2pd reserve at the named relays at once: hivemind 1.1.12 passes `-trustedRelays` but never
    `-relayDiscovery=false`, and with discovery on, go-libp2p's autorelay waits for 4 relay candidates or a
    3-minute boot delay before it reserves anything (measured: the first reservation came 3:00 after
    start with one relay known; see docs/transport.md "Relays"). With static relays only it reserves at
    start."""
    from hivemind.p2p import p2p_daemon

    original = p2p_daemon.P2P._make_process_args

    def make_process_args(*args, **kwargs):
        if kwargs.get("autoRelay") and kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False
        return original(*args, **kwargs)

    p2p_daemon.P2P._make_process_args = staticmethod(make_process_args)


LISTEN_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn (4096 on Linux >= 5.4)


def _listen_backlog_patch() -> None:
    """Give hivemind's handler socket a deep accept queue. p2pd hands every inbound stream to this process
    by dialing a unix socket that hivemind 1.1.12 opens with asyncio's default backlog of 100; when more
    streams than that arrive while the event loop is busy (a burst of volunteers, a flood, a GIL-starved
    loop), p2pd's dial fails with EAGAIN and it resets the stream: the caller reads 0 bytes, with no answer
    and no code. With a deep backlog each such call gets its answer or RATE_LIMITED from swarm/inbound.py
    (tests/integration/test_stream_burst.py)."""
    from hivemind.p2p.p2p_daemon_bindings import control
    from hivemind.utils.multiaddr import protocols

    @asynccontextmanager
    async def listen(self):
        proto_code = control.parse_conn_protocol(self.listen_maddr)
        if proto_code == protocols.P_UNIX:
            server = await asyncio.start_unix_server(
                self._handler, path=self.listen_maddr.value_for_protocol(protocols.P_UNIX), backlog=LISTEN_BACKLOG)
        elif proto_code == protocols.P_IP4:
            server = await asyncio.start_server(
                self._handler, host=self.listen_maddr.value_for_protocol(protocols.P_IP4),
                port=int(self.listen_maddr.value_for_protocol(protocols.P_TCP)), backlog=LISTEN_BACKLOG)
        else:
            raise ValueError(f"Protocol not supported: {protocols.protocol_with_code(proto_code)}")
        async with server:
            yield self

    control.ControlClient.listen = listen
