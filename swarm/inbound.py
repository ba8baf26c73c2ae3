"""Inbound budgets: what one node spends on requests it did not ask for, bounded whoever sends them.

Owned by the swarm transport (docs/transport.md). Every inbound stream of a `SwarmNode`, whatever its
handler, passes one `InboundGate` (shared by all handlers of the node), cheapest check first:

  1. streams: at most `max_streams` open at once, `max_streams_per_peer` of them per peer id
     (RATE_LIMITED; the request is only drained, at most `max_lingering` such streams at once, so that
     closing does not reset the refusal away: swarm/transport.py `_linger`);
  2. the handler's own `admit(peer)` (coordinator/trust/access.py: bans, per-peer token buckets);
  3. the 8-byte frame header must arrive within `header_timeout_s` (DEADLINE_EXCEEDED);
  4. the announced length is checked against the handler's cap (PAYLOAD_TOO_LARGE) and then *reserved*
     in the node's global in-flight byte budget `max_inflight_bytes` before a body byte is read
     (RATE_LIMITED when it does not fit: retryable, a volunteer's outbox keeps the batch). Peers the
     node vouches for (`trusted(peer)`: the coordinator's volunteers with accepted batches) may use all
     of it; everyone else together at most `untrusted_share` of it, so a flood from fresh peer ids
     cannot crowd out the volunteers already contributing;
  5. the body must arrive by `header_timeout_s + length / min_read_bps` (DEADLINE_EXCEEDED): a slow-drip
     stream is cut, its buffer and its reservation freed;
  6. blocking handler work goes to a `BoundedExecutor` — `workers` threads and an explicit queue of
     `queue` waiting calls; a call that finds the queue full is refused (RATE_LIMITED) instead of
     waiting behind an unbounded backlog.
The reservation is held until the answer is written, so request bytes held by handlers count too.

Peer ids are free to mint, so the per-peer cap only stops one peer from taking everything; the global
byte budget, the global stream cap and the deadlines bound all of them together: the memory hostile
streams can pin is at most `max_inflight_bytes`, for at most one deadline.

Threading: the gate's counters are touched only on the node's event loop (no lock needed); the
executor's pool threads run the handlers' blocking work.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from asyncrl.protocol.errors import ProtocolError, RejectCode

MiB = 1024 * 1024


@dataclass(frozen=True)
class InboundLimits:
    max_inflight_bytes: int = 128 * MiB
    """Request bytes being received or handled, all streams and handlers together."""
    max_streams: int = 1024
    """Inbound streams open at once, all peers together."""
    max_inflight_bytes_per_peer: int = 32 * MiB
    """...of which one peer id may hold this much (at least the largest request a handler accepts)."""
    untrusted_share: float = 0.5
    """Fraction of max_inflight_bytes that peers without a track record may hold together."""
    max_streams_per_peer: int = 32
    """Inbound streams one peer id may hold open at once (a fetcher long-polls up to 16 chunks of one peer)."""
    header_timeout_s: float = 10.0
    """The 8-byte frame header must arrive within this."""
    min_read_bps: float = 64 * 1024
    """Slowest accepted upload: a body of L bytes must arrive within header_timeout_s + L / min_read_bps."""
    workers: int = 8
    """Threads for handlers' blocking work (signature checks, decoding, re-scoring)."""
    queue: int = 64
    """Blocking calls that may wait for a thread; more are refused (RATE_LIMITED)."""
    max_lingering: int = 256
    """Streams refused for want of a slot that may still drain their caller's request (a bounded read, so
    that closing does not reset the stream before the caller has read the refusal); beyond this they close
    at once."""

    def __post_init__(self):
        if not (self.max_inflight_bytes > 0 and self.max_inflight_bytes_per_peer > 0 and self.max_streams >= 1 and self.max_streams_per_peer >= 1
                and self.header_timeout_s > 0 and self.min_read_bps > 0 and self.workers >= 1 and self.queue >= 0
                and 0 < self.untrusted_share <= 1 and self.max_lingering >= 0):
            raise ValueError(f"invalid inbound limits: {self}")

    def body_deadline_s(self, length: int) -> float:
        return self.header_timeout_s + length / self.min_read_bps


@dataclass
class InboundStats:
    streams_refused: int = 0       # stream caps (global or per peer)
    bytes_refused: int = 0         # requests refused because the byte budget was spent
    deadline_cut: int = 0          # slow headers or bodies
    executor_refused: int = 0      # blocking calls refused with a full queue
    peak_inflight_bytes: int = 0
    peak_streams: int = 0
    peak_queued: int = 0
    unlingered: int = 0            # streams closed at once because max_lingering were waiting already
    latency_ms: dict[str, deque] = field(default_factory=dict)  # handler -> recent wall times (ms)

    def record_latency(self, name: str, ms: float, keep: int = 4096) -> None:
        self.latency_ms.setdefault(name, deque(maxlen=keep)).append(ms)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "latency_ms"}
        d["latency_p99_ms"] = {k: _quantile(v, 0.99) for k, v in self.latency_ms.items() if v}
        return d


def _quantile(values, q: float) -> float:
    xs = sorted(values)
    return float(xs[min(len(xs) - 1, int(q * len(xs)))])


class InboundGate:
    """The budgets of one node (see the module docstring). Loop-thread only."""

    def __init__(self, limits: InboundLimits | None = None, trusted=None):
        self.limits = limits or InboundLimits()
        self.trusted = trusted or (lambda peer: False)  # set by the owner (coordinator/trust/access.py) once it exists
        self.inflight_bytes = 0
        self.untrusted_bytes = 0
        self.streams = 0
        self.by_peer: dict[str, int] = {}        # open streams, only peers that have some
        self.lingering = 0                       # streams waiting for their caller's EOF (max_lingering)
        self.bytes_by_peer: dict[str, int] = {}  # reserved bytes, only peers that have some
        self.stats = InboundStats()

    @contextlib.contextmanager
    def stream(self, peer: str):
        """Hold one stream slot for `peer`, or refuse (RATE_LIMITED) when a cap is reached."""
        lim = self.limits
        held = self.by_peer.get(peer, 0)
        if self.streams >= lim.max_streams or held >= lim.max_streams_per_peer:
            self.stats.streams_refused += 1
            raise ProtocolError(RejectCode.RATE_LIMITED, "too many open streams; retry later")
        self.streams += 1
        self.by_peer[peer] = held + 1
        self.stats.peak_streams = max(self.stats.peak_streams, self.streams)
        try:
            yield
        finally:
            self.streams -= 1
            left = self.by_peer[peer] - 1
            if left:
                self.by_peer[peer] = left
            else:
                del self.by_peer[peer]  # the table holds only peers with open streams

    @contextlib.contextmanager
    def linger_slot(self):
        """True while a stream may wait for its caller to hang up (a refusal draining its request, or an answered
        stream: swarm/transport.py `_linger`); False beyond max_lingering."""
        if self.lingering >= self.limits.max_lingering:
            self.stats.unlingered += 1
            yield False
            return
        self.lingering += 1
        try:
            yield True
        finally:
            self.lingering -= 1

    @contextlib.contextmanager
    def reserve(self, peer: str, nbytes: int):
        """Hold `nbytes` of the in-flight budget (and of `peer`'s share), or refuse (RATE_LIMITED).

        `bytes_by_peer` holds only peers with a positive reservation: a zero-byte request reserves nothing and
        records nothing, so it can end before or after a same-peer request that overlaps it in any order."""
        if nbytes <= 0:
            yield
            return
        lim = self.limits
        mine = self.bytes_by_peer.get(peer, 0)
        stranger = not self.trusted(peer)
        if (self.inflight_bytes + nbytes > lim.max_inflight_bytes or mine + nbytes > lim.max_inflight_bytes_per_peer
                or (stranger and self.untrusted_bytes + nbytes > lim.untrusted_share * lim.max_inflight_bytes)):
            self.stats.bytes_refused += 1
            raise ProtocolError(RejectCode.RATE_LIMITED, "busy receiving other requests; retry later")
        self.inflight_bytes += nbytes
        self.untrusted_bytes += nbytes if stranger else 0
        self.bytes_by_peer[peer] = mine + nbytes
        self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, self.inflight_bytes)
        try:
            yield
        finally:
            self.inflight_bytes -= nbytes
            self.untrusted_bytes -= nbytes if stranger else 0
            left = self.bytes_by_peer[peer] - nbytes
            if left:
                self.bytes_by_peer[peer] = left
            else:
                del self.bytes_by_peer[peer]

    async def read_exactly(self, reader: asyncio.StreamReader, n: int, timeout: float, what: str) -> bytes:
        try:
            return await asyncio.wait_for(reader.readexactly(n), timeout)
        except asyncio.TimeoutError:
            self.stats.deadline_cut += 1
            raise ProtocolError(RejectCode.DEADLINE_EXCEEDED, f"{what} not received within {timeout:.0f}s") from None


class BoundedExecutor:
    """`workers` threads and at most `queue` calls waiting for one; `run` refuses beyond that.

    `run` is awaited on the node's event loop (its counter is loop-thread only)."""

    def __init__(self, workers: int, queue: int, stats: InboundStats | None = None, name: str = "asyncrl-handler"):
        self.capacity = workers + queue
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self.pending = 0
        self.stats = stats or InboundStats()

    async def run(self, fn, *args):
        if self.pending >= self.capacity:
            self.stats.executor_refused += 1
            raise ProtocolError(RejectCode.RATE_LIMITED, "handlers busy; retry later")
        self.pending += 1
        self.stats.peak_queued = max(self.stats.peak_queued, self.pending - self.workers)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.pending -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def monotonic_ms() -> float:
    return time.perf_counter() * 1000.0
