"""Adapter serving: the `manifest` and `chunk` P2P handlers, shared by the coordinator and volunteers.

Owned by the swarm transport (docs/transport.md). Components:

  AdapterStore   versions this peer holds, complete or still arriving (a volunteer's copy); thread-safe;
                 coroutines on the P2P loop can wait for a chunk that is on its way.
  AdapterServer  serves whatever a *source* holds: the coordinator's Publisher (complete versions) or
                 an AdapterStore. Counts what it sent (the benchmark's coordinator uplink figure).
  ServeBudget    the byte rate this peer serves at, favouring peers vouched for (the coordinator: keys
                 with accepted batches): they share `trusted_bps` and are paced; everyone else shares
                 `stranger_bps`, at most `stranger_peer_bps` each, and a request that would wait more
                 than `max_wait_s` is refused (RATE_LIMITED: the fetcher asks another peer or retries).
                 Minting peer ids buys a chunk drainer nothing beyond the strangers' shared rate.

Wire format (unchanged from the walking skeleton, so old fetchers still work)::

    asyncrl.<run>.manifest   request  u64 version [| u32 wait_ms]        -> sealed manifest bytes
    asyncrl.<run>.chunk      request  u64 version | u32 index [| u32 wait_ms] -> chunk bytes

The optional `wait_ms` turns a request into a long poll: a volunteer that is itself still downloading
that version answers as soon as the chunk arrives (bounded by MAX_WAIT_S) instead of refusing. A
refusal is `STALE_VERSION` ("not held"). A source is anything with `get(version)` returning an object
with `.manifest_bytes` and `.chunks` (entries may be None while missing) — Publisher.get fits.

Nothing here checks hashes: every fetcher verifies what it receives against the coordinator's
signature (manifests) and the signed manifest's sha256 (chunks), whoever served it.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Callable

from asyncrl.protocol.errors import ProtocolError, RejectCode

from . import streams
from .rate import TokenBucket
from .streams import stream_name

MAX_WAIT_S = 10.0
"""Longest a long-poll request is held open on the serving side."""
MAX_REQUEST_BYTES = 64


def manifest_request(version: int, wait_s: float = 0.0) -> bytes:
    return struct.pack(">QI", version, int(wait_s * 1000)) if wait_s > 0 else struct.pack(">Q", version)


def chunk_request(version: int, index: int, wait_s: float = 0.0) -> bytes:
    if wait_s > 0:
        return struct.pack(">QII", version, index, int(wait_s * 1000))
    return struct.pack(">QI", version, index)


@dataclass
class HeldVersion:
    version: int
    manifest_bytes: bytes
    chunks: list[bytes | None]
    is_keyframe: bool = False

    @property
    def complete(self) -> bool:
        return all(c is not None for c in self.chunks)


class AdapterStore:
    """What a volunteer can serve. Keeps the newest `keep` versions and never drops the chain from the
    newest complete keyframe it holds (late joiners walk it), unless that chain is longer than `keep`."""

    def __init__(self, keep: int = 12):
        self.keep = keep
        self._versions: OrderedDict[int, HeldVersion] = OrderedDict()
        self._lock = threading.Lock()
        self._waiters: dict[tuple[int, int], list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = defaultdict(list)
        self.on_unknown_version: Callable[[int], None] | None = None

    # ---- writers (any thread) ---------------------------------------------------------------
    def begin(self, version: int, manifest_bytes: bytes, n_chunks: int, *, is_keyframe: bool) -> HeldVersion:
        with self._lock:
            held = self._versions.get(version)
            if held is None or held.manifest_bytes != manifest_bytes:
                held = HeldVersion(version, manifest_bytes, [None] * n_chunks, is_keyframe)
                self._versions[version] = held
                self._versions = OrderedDict(sorted(self._versions.items()))
            return held

    def put_chunk(self, version: int, index: int, data: bytes, *, manifest_bytes: bytes | None = None) -> None:
        """Add a chunk that the caller has already verified against the signed manifest (`manifest_bytes`:
        only if that is still the manifest held for `version`)."""
        with self._lock:
            held = self._versions.get(version)
            if held is None or index >= len(held.chunks):
                return
            if manifest_bytes is not None and held.manifest_bytes != manifest_bytes:
                return  # the version was re-begun under another manifest (a restarted coordinator)
            held.chunks[index] = data
            waiters = self._waiters.pop((version, index), [])
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve, fut, data)

    def drop(self, version: int) -> None:
        with self._lock:
            self._versions.pop(version, None)

    def clear(self) -> None:
        with self._lock:
            self._versions.clear()

    def prune(self) -> None:
        with self._lock:
            complete = [v for v, h in self._versions.items() if h.complete]
            if len(complete) <= self.keep:
                return
            keyframes = [v for v in complete if self._versions[v].is_keyframe]
            newest = complete[-1]
            floor = keyframes[-1] if keyframes and newest - keyframes[-1] < self.keep else newest - self.keep + 1
            for v in [v for v in complete if v < floor]:
                del self._versions[v]

    # ---- readers ----------------------------------------------------------------------------
    def get(self, version: int) -> HeldVersion | None:
        with self._lock:
            return self._versions.get(version)

    def complete_versions(self) -> list[int]:
        with self._lock:
            return [v for v, h in self._versions.items() if h.complete]

    async def wait_chunk(self, version: int, index: int, timeout: float) -> bytes | None:
        """The chunk as soon as this peer has it, or None after `timeout` (call on an event loop)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            held = self._versions.get(version)
            if held is not None and index < len(held.chunks) and held.chunks[index] is not None:
                return held.chunks[index]
            if held is None and self.on_unknown_version is not None and self._newer_than_held(version):
                self.on_unknown_version(version)  # a hint: go and look at the pointer now
            self._waiters[(version, index)].append((loop, fut))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            with self._lock:
                lst = self._waiters.get((version, index), [])
                if (loop, fut) in lst:
                    lst.remove((loop, fut))
                if not lst:
                    self._waiters.pop((version, index), None)
            return None

    def _newer_than_held(self, version: int) -> bool:
        return not self._versions or version > max(self._versions)


def _resolve(fut: asyncio.Future, data: bytes) -> None:
    if not fut.done():
        fut.set_result(data)


class ServeBudget:
    """Byte-rate admission for manifest/chunk answers (see the module docstring). Loop-thread only.
    Rates <= 0 mean unlimited (TokenBucket)."""

    MAX_STRANGERS = 4096  # per-stranger buckets kept (LRU); an evicted one starts with a fresh burst

    def __init__(self, *, trusted: Callable[[str], bool], trusted_bps: float = 0, stranger_bps: float,
                 stranger_peer_bps: float, max_wait_s: float = 2.0, burst_bytes: int = 4 << 20):
        self.trusted = trusted
        self.max_wait_s = max_wait_s
        self._burst = lambda rate: max(float(burst_bytes), rate)  # a whole chunk always fits
        self.trusted_bucket = TokenBucket(trusted_bps, self._burst(trusted_bps))
        self.stranger_bucket = TokenBucket(stranger_bps, self._burst(stranger_bps))
        self.stranger_peer_bps = stranger_peer_bps
        self._strangers: OrderedDict[str, TokenBucket] = OrderedDict()
        self.refused = 0
        self.bytes_trusted = 0
        self.bytes_strangers = 0

    async def charge(self, peer: str, nbytes: int) -> None:
        """Wait until `nbytes` may go to `peer`, or raise RATE_LIMITED."""
        if self.trusted(peer):
            self.bytes_trusted += nbytes
            await self.trusted_bucket.pace(nbytes)
            return
        own = self._strangers.get(peer)
        if own is None:
            own = self._strangers[peer] = TokenBucket(self.stranger_peer_bps, self._burst(self.stranger_peer_bps))
            while len(self._strangers) > self.MAX_STRANGERS:
                self._strangers.popitem(last=False)
        else:
            self._strangers.move_to_end(peer)
        wait_own = own.reserve(nbytes, max_wait=self.max_wait_s)
        if wait_own is None:
            self.refused += 1
            raise ProtocolError(RejectCode.RATE_LIMITED, "serving rate for new peers reached; retry later")
        wait_all = self.stranger_bucket.reserve(nbytes, max_wait=self.max_wait_s)
        if wait_all is None:
            own.tokens += nbytes  # give back what this refused request had spent
            self.refused += 1
            raise ProtocolError(RejectCode.RATE_LIMITED, "serving rate for new peers reached; retry later")
        self.bytes_strangers += nbytes
        delay = max(wait_own, wait_all)
        if delay > 0:
            await asyncio.sleep(delay)

    def status(self) -> dict:
        return {"refused": self.refused, "bytes_trusted": self.bytes_trusted, "bytes_strangers": self.bytes_strangers,
                "strangers_tracked": len(self._strangers)}


@dataclass
class ServerStats:
    manifests_sent: int = 0
    chunks_sent: int = 0
    bytes_sent: int = 0
    refused: int = 0
    bytes_by_version: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # newest KEEP_VERSIONS

    KEEP_VERSIONS = 256

    def sent(self, version: int, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.bytes_by_version[version] += nbytes
        if len(self.bytes_by_version) > self.KEEP_VERSIONS:  # bounded over a run of any length
            del self.bytes_by_version[min(self.bytes_by_version)]


class AdapterServer:
    """Registers `manifest` and `chunk` handlers for `run_id` on `node` and serves `source`."""

    def __init__(self, node, run_id: str, source, *, upload_bps: float = 0, max_wait_s: float = MAX_WAIT_S,
                 admit: Callable[[str], None] | None = None, budget: ServeBudget | None = None):
        """`admit(peer)`: runs before a request is read (the coordinator refuses banned peers);
        `budget`: byte-rate admission per peer (the coordinator's; volunteers pace with `upload_bps`)."""
        self.node = node
        self.run_id = run_id
        self.source = source
        self.bucket = TokenBucket(upload_bps, burst=upload_bps) if upload_bps and upload_bps > 0 else None  # 1 s of credit
        self.max_wait_s = max_wait_s
        self.admit = admit
        self.budget = budget
        self.stats = ServerStats()

    def start(self) -> "AdapterServer":
        for kind, handler in ((streams.MANIFEST, self._manifest), (streams.CHUNK, self._chunk)):
            self.node.serve(stream_name(self.run_id, kind), handler, max_request_bytes=MAX_REQUEST_BYTES,
                            admit=self.admit)
        return self

    async def _spend(self, peer: str, nbytes: int) -> None:
        if self.budget is not None:
            try:
                await self.budget.charge(peer, nbytes)
            except ProtocolError:
                self.stats.refused += 1
                raise
        if self.bucket is not None:
            await self.bucket.pace(nbytes)

    # Seam for fault injection: a subclass may alter what goes out (tests' TamperingProvider does).
    def outgoing_chunk(self, version: int, index: int, data: bytes) -> bytes:
        return data

    async def _manifest(self, request: bytes, peer: str) -> bytes:
        if len(request) == 8:
            (version,), wait_s = struct.unpack(">Q", request), 0.0
        elif len(request) == 12:
            version, wait_ms = struct.unpack(">QI", request)
            wait_s = min(wait_ms / 1000, self.max_wait_s)
        else:
            raise ProtocolError(RejectCode.MALFORMED, "manifest request is a u64 version [+ u32 wait_ms]")
        held = self.source.get(version)
        if held is None and wait_s > 0 and hasattr(self.source, "wait_chunk"):
            await self.source.wait_chunk(version, 0, wait_s)  # the manifest precedes any chunk
            held = self.source.get(version)
        if held is None:
            self.stats.refused += 1
            raise ProtocolError(RejectCode.STALE_VERSION, "version not held")
        await self._spend(peer, len(held.manifest_bytes))
        self.stats.manifests_sent += 1
        self.stats.sent(version, len(held.manifest_bytes))
        return held.manifest_bytes

    async def _chunk(self, request: bytes, peer: str) -> bytes:
        if len(request) == 12:
            (version, index), wait_s = struct.unpack(">QI", request), 0.0
        elif len(request) == 16:
            version, index, wait_ms = struct.unpack(">QII", request)
            wait_s = min(wait_ms / 1000, self.max_wait_s)
        else:
            raise ProtocolError(RejectCode.MALFORMED, "chunk request is (u64 version, u32 index [, u32 wait_ms])")
        held = self.source.get(version)
        data = held.chunks[index] if held is not None and index < len(held.chunks) else None
        if data is None and wait_s > 0 and hasattr(self.source, "wait_chunk"):
            data = await self.source.wait_chunk(version, index, wait_s)
        if data is None:
            self.stats.refused += 1
            raise ProtocolError(RejectCode.STALE_VERSION, "chunk not held")
        await self._spend(peer, len(data))
        self.stats.chunks_sent += 1
        self.stats.sent(version, len(data))
        return self.outgoing_chunk(version, index, data)
