"""Transport: hivemind DHT + P2P streams, behind a small interface both sides use.

`SwarmNode` owns one hivemind DHT (which forks a process and starts the `p2pd` daemon) and a replica
of its P2P client running on a private asyncio loop thread. It offers:

- `serve(name, handler, max_request_bytes)` / `call(peer_id, name, request, ...)`: one framed
  request/response over a libp2p stream. Frames are `u64 length | bytes`; the length is checked against
  the cap *before* the body is read, so an oversized request is refused without being buffered.
  Responses are `status byte | u64 length | bytes`; status 1 carries "CODE:detail" (a RejectCode).
- `store(key, value, ttl, subkey)` / `get(key)`: small DHT values (hivemind caps DHT messages at
  4 MiB; we keep pointers and presence there, never adapter bytes).

No pickle: payloads are whatever bytes `asyncrl.protocol` produced. The libp2p connection is
authenticated (TLS/noise bound to peer IDs), so a caller that dialled the coordinator's peer ID knows
who answered; requests that matter (batches) are additionally signed envelopes.

Create the SwarmNode before loading CUDA/vLLM: hivemind.DHT forks.

Size: `SwarmNode`'s framing, stream serving, calls, DHT access and shutdown share the node's loop thread
and inbound gate; the gate and the private-API patches are their own modules.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from asyncrl.protocol.errors import ProtocolError, RejectCode

from . import hivemind_private
from .inbound import BoundedExecutor, InboundGate, InboundLimits, monotonic_ms

logger = logging.getLogger(__name__)
HEADER = 8
DHT_STORE_TIMEOUT_S = 60.0
DHT_GET_TIMEOUT_S = 30.0
DHT_SHUTDOWN_GRACE_S = 10.0
"""How long a DHT process gets to stop by itself before hivemind terminates it (hivemind's default, 3 s, is short
on a loaded machine, and a process killed mid-message can leave hivemind's shared MPFuture lock held:
SwarmNode.shutdown)."""
STATUS_OK, STATUS_ERR = 0, 1
Handler = Callable[[bytes, str], Awaitable[bytes]]


class TransportError(Exception):
    """The peer could not be reached or the stream broke (retryable)."""


class NotServed(TransportError):
    """The peer was reached but serves no handler of that name: its p2pd refused the stream's protocol
    (go-multistream's "protocols not supported: [<name>]"). A coordinator that is starting says this: its node
    listens before its handlers are registered (the model loads in between, after the DHT fork). Retryable,
    soon: client/pacing.py ReconnectBackoff gives it a short back-off of its own."""


NOT_SERVED = re.compile(r"protocols? not supported")
"""What p2pd's ControlFailure says when the peer answered the dial but has no handler for the stream's name."""


class BadAddress(ValueError):
    """A join address that is not a usable multiaddr (not retryable)."""


@dataclass(frozen=True)
class JoinAddress:
    maddr: str
    peer_id: str
    host: str | None
    port: int | None


def parse_join_address(text: str) -> JoinAddress:
    """Validate a multiaddr that ends in /p2p/<peer id> (what the coordinator prints)."""
    from multiaddr import Multiaddr

    try:
        ma = Multiaddr(text)
    except Exception as exc:  # multiaddr raises several types
        raise BadAddress(f"{text!r} is not a multiaddr ({exc.__class__.__name__}); expected e.g. "
                         "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...") from None
    values = {}
    for proto in ma.protocols():
        try:
            values[proto.name] = ma.value_for_protocol(proto.code)
        except Exception:
            values[proto.name] = None
    peer_id = values.get("p2p") or values.get("ipfs")
    if not peer_id:
        raise BadAddress(f"{text!r} has no /p2p/<peer id> part: the coordinator's peer id is the trust anchor")
    host = values.get("ip4") or values.get("ip6") or values.get("dns") or values.get("dns4") or values.get("dns6")
    port = values.get("tcp")
    return JoinAddress(maddr=text, peer_id=peer_id, host=host, port=int(port) if port else None)


def check_reachable(addr: JoinAddress | Sequence[JoinAddress], timeout: float = 3.0) -> None:
    """Fail fast with a readable error when nothing listens at any of the TCP addresses (one suffices)."""
    addrs = [addr] if isinstance(addr, JoinAddress) else list(addr)
    errors = []
    for a in addrs:
        if a.host is None or a.port is None:
            return  # relay / quic addresses: let libp2p try
        try:
            with socket.create_connection((a.host, a.port), timeout=timeout):
                return
        except OSError as exc:
            errors.append(f"{a.host}:{a.port} ({exc.strerror or exc})")
    raise TransportError(f"cannot reach {', '.join(errors)}; is the coordinator (or bootstrap peer) running and "
                         "the port open?")


class LoopThread:
    """An asyncio loop on a daemon thread; `run(coro)` blocks the caller until the result."""

    def __init__(self, name: str = "asyncrl-p2p"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float | None = None):
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


async def _read_frame(reader: asyncio.StreamReader, cap: int) -> bytes:
    header = await reader.readexactly(HEADER)
    length = int.from_bytes(header, "big")
    if length > cap:
        raise ProtocolError(RejectCode.PAYLOAD_TOO_LARGE, f"{length} bytes > cap {cap}")
    return await reader.readexactly(length)


LINGER_BYTES = 256 * 1024
LINGER_S = 2.0


async def _linger(gate: InboundGate, reader: asyncio.StreamReader) -> None:
    """After answering (or refusing a request unread: banned peer, oversized frame): wait for the caller to
    hang up, discarding a bounded amount of what it is still sending, for a bounded time, so that closing
    does not reset the stream before it read our answer. At most `max_lingering` streams wait at once (the
    gate's linger slots); beyond that, return at once."""
    with gate.linger_slot() as ok:
        left = LINGER_BYTES if ok else 0
        deadline = time.monotonic() + LINGER_S
        try:
            while left > 0:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    return
                chunk = await asyncio.wait_for(reader.read(min(65536, left)), wait)
                if not chunk:
                    return
                left -= len(chunk)
        except (asyncio.TimeoutError, ConnectionError):
            pass


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(HEADER, "big") + data


def _error_frame(exc: ProtocolError) -> bytes:
    return bytes([STATUS_ERR]) + _frame(f"{exc.code.value}:{exc.detail[:1024]}".encode())


def stream_handler(gate: InboundGate, name: str, handler: Handler, *, max_request_bytes: int,
                   admit: Callable[[str], None] | None = None, with_addr: bool = False):
    """The coroutine hivemind runs for each inbound stream of handler `name`: one framed request through
    `gate` (swarm/inbound.py), one framed answer. Module-level so tests drive it with plain asyncio streams."""

    async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        started = monotonic_ms()
        try:
            with gate.stream(peer):  # RATE_LIMITED escapes: answered below without a slot
                try:
                    if admit is not None:
                        admit(peer)
                    header = await gate.read_exactly(reader, HEADER, gate.limits.header_timeout_s, "frame header")
                    length = int.from_bytes(header, "big")
                    if length > max_request_bytes:
                        raise ProtocolError(RejectCode.PAYLOAD_TOO_LARGE, f"{length} bytes > cap {max_request_bytes}")
                    with gate.reserve(peer, length):  # held while the handler works on the bytes
                        request = await gate.read_exactly(reader, length, gate.limits.body_deadline_s(length),
                                                          "request body")
                        response = await (handler(request, peer, str(info.addr)) if with_addr
                                          else handler(request, peer))
                        del request
                    writer.write(bytes([STATUS_OK]) + _frame(response))
                except ProtocolError as exc:
                    writer.write(_error_frame(exc))
                except (asyncio.IncompleteReadError, ConnectionError):
                    raise
                except Exception as exc:  # a handler bug must not look like a network failure to the caller
                    logger.exception("handler %s failed", name)
                    writer.write(bytes([STATUS_ERR]) + _frame(f"INTERNAL:{exc.__class__.__name__}".encode()))
                await asyncio.wait_for(writer.drain(), gate.limits.header_timeout_s)
                gate.stats.record_latency(name, monotonic_ms() - started)
            # Answered: wait for the caller to hang up before closing (bounded, outside the stream slot). If we
            # close first, p2pd's doStreamPipe can reset the stream while the answer is still in the caller's
            # receive buffer, and the caller reads 0 bytes (measured: 1 answer in 20,000 lost; docs/transport.md).
            await _linger(gate, reader)
        except ProtocolError as exc:  # no stream slot: answer without reading the request, then drain it
            # (bounded): closing on unread bytes can make p2pd reset the stream before the caller read the
            # refusal
            try:
                writer.write(_error_frame(exc))
                await asyncio.wait_for(writer.drain(), 2.0)
                await _linger(gate, reader)
            except Exception:
                pass
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass  # the caller went away (or stopped reading our answer); nothing to answer
        finally:
            writer.close()

    return on_stream


async def _get_many(dht, node, keys: tuple[str, ...], latest: bool):
    """Runs inside the DHT process (DHT.run_coroutine): one batched traversal for all `keys`."""
    found = await node.get_many(keys, sufficient_expiration_time=float("inf") if latest else None)
    return {k: v for k, v in found.items() if v is not None and v.expiration_time is not None}


RELAY_DIAL_TIMEOUT_S = 5.0
CALL_PATHS_MAX_PEERS = 256  # SwarmNode.call_paths: peers remembered, addresses per peer
CALL_PATHS_MAX_ADDRS = 8
STREAM_LOST_AT = "stream lost while"
"""Prefix of the note `SwarmNode.acall` adds to a transport error: the phase it happened in (diagnosis of the
streams p2pd closes with no answer; docs/testing.md)."""


class SwarmNode:
    def __init__(self, *, initial_peers: Sequence[str] = (), host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
                 announce_maddrs: Sequence[str] | None = None, identity_path: str | None = None,
                 client_mode: bool = False, use_relay: bool = True, use_auto_relay: bool = False,
                 trusted_relays: Sequence[str] = (), start_timeout: float = 30.0,
                 inbound: InboundLimits | None = None, force_reachability: str | None = None):
        """`use_relay`: may reach/be reached through libp2p circuit relays; `use_auto_relay`: behind NAT,
        become reachable through a relay; `trusted_relays`: relay multiaddrs to use (default: the initial
        peers); `force_reachability`: "private" / "public" instead of waiting for AutoNAT's verdict;
        `inbound`: what unasked-for requests may cost this node (swarm/inbound.py). See "Relays" above."""
        import hivemind

        hivemind_private.apply_patches()

        self.inbound = InboundGate(inbound)
        self.executor = BoundedExecutor(self.inbound.limits.workers, self.inbound.limits.queue, self.inbound.stats)

        kwargs = dict(host_maddrs=list(host_maddrs), client_mode=client_mode, use_relay=use_relay,
                      startup_timeout=start_timeout)
        if use_auto_relay:
            kwargs["use_auto_relay"] = True
        if force_reachability:  # "private": behind NAT, look for a relay at once instead of waiting for AutoNAT
            kwargs["force_reachability"] = force_reachability
        if trusted_relays:
            kwargs["trusted_relays"] = list(trusted_relays)
        if announce_maddrs:
            kwargs["announce_maddrs"] = list(announce_maddrs)
        if identity_path:
            kwargs["identity_path"] = identity_path
            kwargs["check_if_identity_free"] = False
        if use_auto_relay and not trusted_relays and initial_peers:
            kwargs["trusted_relays"] = list(initial_peers)  # static relays: reserved at once (see "Relays")
        # Relays to reach peers through when a direct dial fails (a NATed seeder has a reservation there).
        self.relays = tuple(trusted_relays or initial_peers) if use_relay else ()
        self.relayed_dials = 0
        # The connection each outbound stream went over, as p2pd reports it (StreamInfo.addr, the connection's
        # remote multiaddr: a relayed one ends in /p2p-circuit): peer id -> {address: streams}. Evidence of the
        # path a fetch took (tests/integration/test_nat.py); bounded by CALL_PATHS_MAX_PEERS.
        self.call_paths: dict[str, dict[str, int]] = {}
        self.dht = hivemind.DHT(initial_peers=list(initial_peers) or None, start=True,
                                shutdown_timeout=DHT_SHUTDOWN_GRACE_S, **kwargs)
        self.loops = LoopThread()
        self.p2p = self.loops.run(self.dht.replicate_p2p(), timeout=start_timeout)
        self.peer_id = self.p2p.peer_id.to_base58()

    # ---- addresses -------------------------------------------------------------------------
    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    # ---- request / response over streams ---------------------------------------------------
    def serve(self, name: str, handler: Handler, *, max_request_bytes: int,
              admit: Callable[[str], None] | None = None, with_addr: bool = False) -> None:
        """`admit(peer_id)` (optional) runs before the request is read; its ProtocolError is the answer
        (e.g. a banned or rate-limited peer: coordinator/trust/access.py). Every stream passes this node's
        InboundGate first (swarm/inbound.py: stream caps, read deadlines, the global byte budget).
        `with_addr`: the handler also gets the caller's multiaddr as this side sees it (the handshake's NAT check)."""
        on_stream = stream_handler(self.inbound, name, handler, max_request_bytes=max_request_bytes, admit=admit,
                                   with_addr=with_addr)
        self.loops.run(self.p2p.add_binary_stream_handler(name, on_stream), timeout=30)

    async def run_blocking(self, fn, *args):
        """Run `fn(*args)` on this node's bounded handler pool (await it on the node's loop); a full queue
        is refused with RATE_LIMITED instead of growing without bound (swarm/inbound.py)."""
        return await self.executor.run(fn, *args)

    async def acall(self, peer_id: str, name: str, request: bytes, *, max_response_bytes: int) -> bytes:
        """One framed request/response. The answer is read while the request is still being written, so a
        server that refuses from the frame header (too large, busy, banned) is heard even though it stops
        reading the body: the caller gets that code, not a broken pipe."""
        from hivemind.p2p import PeerID
        from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure  # p2pd: "could not connect"

        peer = PeerID.from_base58(peer_id)
        try:
            try:
                info, reader, writer = await self.p2p.call_binary_stream_handler(peer, name)
            except ControlFailure as exc:
                if NOT_SERVED.search(str(exc)):  # reached, nothing serves `name` there (yet): no relay helps
                    raise NotServed(f"{name} to {peer_id[-8:]}: the peer does not serve it (yet): {exc}") from None
                if not await self._dial_via_relays(peer):
                    raise
                info, reader, writer = await self.p2p.call_binary_stream_handler(peer, name)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:  # which side lost it is a different bug
            exc.add_note(f"{STREAM_LOST_AT}: opening the stream (our p2pd closed its control connection)")
            raise
        self._note_path(peer_id, str(info.addr))

        async def send() -> None:
            writer.write(_frame(request))
            await writer.drain()

        sending = asyncio.ensure_future(send())
        try:
            try:
                status = await reader.readexactly(1)
                body = await _read_frame(reader, max_response_bytes)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                if sending.done() and sending.exception() is not None:
                    raise sending.exception() from None  # the write broke first: report that
                exc.add_note(f"{STREAM_LOST_AT}: awaiting the answer (the stream was open)")
                raise
            if not sending.done():
                sending.cancel()  # answered before the server read it all (a refusal): stop sending
        finally:
            if not sending.done():
                sending.cancel()
            elif not sending.cancelled():
                sending.exception()  # retrieved: a broken write after the answer is no error of ours
            writer.close()
        if status[0] == STATUS_ERR:
            code, _, detail = body.decode(errors="replace").partition(":")
            try:
                raise ProtocolError(RejectCode(code), detail)
            except ValueError:
                raise ProtocolError(RejectCode.INTERNAL, body.decode(errors="replace")) from None
        return body

    def _note_path(self, peer_id: str, addr: str) -> None:
        paths = self.call_paths.get(peer_id)
        if paths is None:
            if len(self.call_paths) >= CALL_PATHS_MAX_PEERS:
                return
            paths = self.call_paths[peer_id] = {}
        if addr in paths or len(paths) < CALL_PATHS_MAX_ADDRS:
            paths[addr] = paths.get(addr, 0) + 1

    async def _dial_via_relays(self, peer) -> bool:
        """Connect to `peer` through a circuit of one of our relays (a NATed peer reserved a slot there);
        True when one worked. p2pd does not learn peers' circuit addresses by itself (see "Relays")."""
        from multiaddr import Multiaddr

        for relay in self.relays:
            if relay.rstrip("/").endswith(peer.to_base58()):
                continue
            try:
                await asyncio.wait_for(hivemind_private.connect(self.p2p, peer, [Multiaddr(f"{relay}/p2p-circuit")]),
                                       RELAY_DIAL_TIMEOUT_S)
            except Exception:
                continue
            self.relayed_dials += 1
            return True
        return False

    def call(self, peer_id: str, name: str, request: bytes, *, max_response_bytes: int,
             timeout: float = 30.0) -> bytes:
        """Blocking call from any non-loop thread. Network failures → TransportError (NotServed when the peer
        answered but serves no `name`)."""
        try:
            return self.loops.run(self.acall(peer_id, name, request, max_response_bytes=max_response_bytes),
                                  timeout=timeout)
        except (ProtocolError, NotServed):
            raise
        except Exception as exc:  # p2pd control errors, timeouts, broken streams
            notes = "".join(f" ({n})" for n in getattr(exc, "__notes__", ()))
            raise TransportError(f"{name} to {peer_id[-8:]}: {exc.__class__.__name__}: {exc}{notes}") from None

    # ---- DHT ------------------------------------------------------------------------------
    def _dht_answer(self, what: str, call: Callable[[], Future], timeout: float):
        """The result of one DHT call (`call` returns hivemind's MPFuture). Raises TransportError when the
        DHT process is gone (e.g. SIGTERM/Ctrl-C reached the whole process group: its future would never
        resolve) or does not answer in `timeout`, instead of blocking the caller (the learner loop, a
        volunteer stopping) forever."""
        if not self.dht.is_alive():
            raise TransportError(f"DHT {what}: the DHT process has exited")
        future = call()
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                if self.dht.is_alive() and time.monotonic() < deadline:
                    continue  # still working; a dead DHT process would never answer
                raise TransportError(f"DHT {what}: no answer (DHT process alive: {self.dht.is_alive()})")
            except Exception as exc:
                raise TransportError(f"DHT {what}: {exc.__class__.__name__}: {exc}") from None

    def store(self, key: str, value: bytes, ttl: float, subkey: str | None = None,
              timeout: float = DHT_STORE_TIMEOUT_S) -> bool:
        """True when some node took it; TransportError as in `_dht_answer`."""
        from hivemind.utils import get_dht_time

        return bool(self._dht_answer(f"store of {key!r}", lambda: self.dht.store(
            key, value, get_dht_time() + ttl, subkey=subkey, return_future=True), timeout))

    def get(self, key: str, latest: bool = True, timeout: float = DHT_GET_TIMEOUT_S):
        """The raw value (bytes) or {subkey: bytes} for dictionary keys; None when absent; TransportError as
        in `_dht_answer`."""
        found = self._dht_answer(f"get of {key!r}", lambda: self.dht.get(key, latest=latest, return_future=True),
                                 timeout)
        if found is None:
            return None
        value = found.value
        if isinstance(value, dict):
            return {k: v.value for k, v in value.items()}
        return value

    def get_many(self, keys: Sequence[str], latest: bool = True, timeout: float = DHT_GET_TIMEOUT_S) -> dict:
        """`get` of several keys in one DHT traversal (hivemind batches the lookups: one RPC per peer asked,
        whatever the number of keys). Keys not found map to None; a failed or late traversal raises
        TransportError."""
        from functools import partial

        future = self.dht.run_coroutine(partial(_get_many, keys=tuple(keys), latest=latest), return_future=True)
        try:
            found = future.result(timeout=timeout)
        except Exception as exc:
            raise TransportError(f"DHT get of {len(keys)} keys: {exc.__class__.__name__}: {exc}") from None
        out = {}
        for key in keys:
            item = found.get(key)
            value = item.value if item is not None else None
            out[key] = {k: v.value for k, v in value.items()} if isinstance(value, dict) else value
        return out

    def connected_peers(self, timeout: float = 10.0) -> dict[str, list[str]]:
        """Peers with an open connection and the address each connection actually comes from (what p2pd
        observed on the authenticated connection, not what any record claims)."""
        async def listing():
            return await self.p2p.list_peers()

        out: dict[str, list[str]] = {}
        for info in self.loops.run(listing(), timeout=timeout):
            out.setdefault(info.peer_id.to_base58(), []).extend(str(a) for a in info.addrs)
        return out

    def shutdown(self) -> None:
        try:
            self.loops.run(self.p2p.shutdown(), timeout=5)
        except Exception:
            pass
        self.loops.stop()
        self.executor.shutdown()
        self.dht.shutdown()  # asks it to stop; after DHT_SHUTDOWN_GRACE_S hivemind terminates it
        # The DHT process was forked after our SIGTERM handler was installed, so it inherited it and the
        # SIGTERM of hivemind's hard shutdown only sets a flag there; without this, interpreter exit would
        # wait forever to join it (e.g. after the whole process group got SIGTERM and p2pd died first).
        if self.dht.is_alive():
            try:
                os.kill(self.dht.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.dht.join(5)
        if (self.dht.exitcode or 0) < 0 and hivemind_private.free_orphaned_update_lock():
            # killed by a signal while it held MPFuture's shared lock: every later DHT of ours would hang
            logger.warning("a DHT process was killed holding hivemind's MPFuture update lock; released it")
