"""Fetch sources the coordinator vouches for: the signed providers record (docs/scale.md).

Owned by the swarm transport. Presence records are self-declared: anyone can mint keys and announce
"I serve every version" for free, so volunteers never pick sources from presence. The coordinator does,
once, for everyone, and signs the result:

  ProviderDesk   coordinator side. Vouches for a peer after it *answered* a probe on the chunk stream
                 (a request for a version nobody has: an honest server refuses it at once with
                 STALE_VERSION — proof that a live node with that peer id speaks our protocol; a record
                 with no node behind it, or a tarpit, never answers within PROBE_TIMEOUT_S). At most
                 PROBES_PER_ROUND probes per round, PROBE_PARALLEL at once; a failed peer is retried
                 with a doubling pause (at most PROBE_BACKOFF_MAX_S), so a flood of fake records costs a
                 bounded trickle of dials. Volunteers with accepted batches (`proven`) are probed and
                 chosen first. From the vouched peers it issues a ProvidersRecord:
                   seeders  (<= SEEDERS_PER_VERSION) serving peers fit to seed; chosen when a version
                            is published and kept until the next, so every fetcher computes the same
                            chunk -> seeder assignment for that version;
                   holders  (<= HOLDERS_PER_SHARD per shard) vouched peers and the complete versions
                            they announce.
                 The record is sharded so that no value grows with the swarm: ceil(vouched / 8) shards
                 (at most 64), each with the same seeders and its own slice of the holders, under
                 providers_key(run, coordinator, shard). It stores them before the version's pointer
                 (PointerRecord calls `on_publish`), re-issues them every few seconds (holders change as
                 peers finish; a shard index issued in the last TTL is re-issued too, so a reader of a
                 shard that no longer exists learns the new count), and names the peers the pointer is
                 pushed to (`push_targets`). Seeders are chosen and dropped on measured service
                 (swarm/seeder_service.py): right after a version is published each of its seeders is asked
                 for one of its chunks as fetchers ask it; one that refuses at once, never answers, serves
                 wrong bytes or keeps missing the wait leaves the record at once and for a doubling while;
                 those that served rank first among the unproven.
  ProvidersCache volunteer side: the newest verified record of the shard its own peer id hashes to
                 (shard 0 until a record says how many there are), re-read at most every `max_age_s`, or
                 at once when a pointer names a newer version than the record (`ensure`). One small DHT
                 value per read, whatever the swarm size.

A vouched peer can still lie about what it holds or serve garbage; fetchers check every byte against
the signed manifest and avoid such a peer (swarm/fetch.py), with short per-peer timeouts.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

from asyncrl.protocol import swarm
from asyncrl.protocol.errors import ProtocolError
from asyncrl.protocol.identity import Identity

from . import streams
from .seeder_service import SERVICE_GRACE_S, SERVICE_WAIT_S, SeederService
from .serving import chunk_request
from .streams import stream_name

PROBE_VERSION = 2**64 - 1
"""The version a probe asks for: nobody holds it, so an honest server refuses at once."""
PROBE_TIMEOUT_S = 3.0
PROBE_PARALLEL = 8
PROBES_PER_ROUND = 32
PROBE_BACKOFF_S = 15.0
PROBE_BACKOFF_MAX_S = 600.0
REPROBE_S = 300.0
"""A vouched peer is probed again after this long (it may have gone away behind a live presence record)."""
ISSUE_EVERY_S = 5.0
ENSURE_READS = 3
"""Reads of the record a volunteer spends on one new version's seeders (ProvidersCache.ensure)."""
MIN_SEED_BPS = 1 << 20
"""Peers capped below this upload rate (bytes/s) are not made seeders (they would hold everyone up)."""
MAX_PUSH_TARGETS = 128


@dataclass
class _Probe:
    vouched_at: float | None = None  # monotonic; None = not (or no longer) vouched
    next_probe: float = 0.0
    failures: int = 0


class ProviderDesk:
    def __init__(self, node, identity: Identity, run_id: str, tracker, *,
                 proven: Callable[[str], bool] = lambda peer: False, issue_every_s: float = ISSUE_EVERY_S,
                 source=None, clock=time.monotonic):
        """`source`: what the coordinator serves (anything whose `get(version)` has `.chunks`, e.g. the
        Publisher): the bytes a seeder's service check must return; None = no checks until it is set."""
        self.node, self.identity, self.run_id = node, identity, run_id
        self.tracker = tracker  # swarm/records.py PresenceTracker: .records()
        self.proven = proven
        self.issue_every_s = issue_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._issue_lock = threading.Lock()  # one record built and stored at a time: never an older one last
        self._probes: dict[str, _Probe] = {}
        self._version = -1
        self._seeders: tuple[str, ...] = ()
        self._shard_high: dict[int, float] = {}  # shard count -> when last issued (monotonic)
        self._stop = threading.Event()
        self.stats = {"probes": 0, "probe_failures": 0, "issued": 0, "issue_failures": 0}
        self.last_record: swarm.ProvidersRecord | None = None
        self.source = source
        self.service = SeederService(node, run_id, clock=clock)
        self._service_due = threading.Event()
        self._checked_version = -1

    # ---- who is vouched for ---------------------------------------------------------------------
    def vouched(self, peer: str) -> bool:
        with self._lock:
            p = self._probes.get(peer)
            return p is not None and p.vouched_at is not None

    def probe_round(self) -> int:
        """Probe the peers whose presence says they serve and that are due (blocking, bounded); returns
        how many answered."""
        now = self._clock()
        records = self.tracker.records()
        with self._lock:
            for peer in [p for p in self._probes if p not in records]:
                del self._probes[peer]  # presence expired: forgotten (a new record starts afresh)
        self.service.forget(lambda peer: peer in records)
        with self._lock:
            due = [p for p, r in records.items() if r.serving and p != self.identity.peer_id
                   and self._probes.setdefault(p, _Probe()).next_probe <= now]
        due.sort(key=lambda p: (not self.proven(p), self._probes[p].failures))
        due = due[:PROBES_PER_ROUND]
        if not due:
            return 0
        results = self.node.loops.run(self._probe_all(due), timeout=PROBE_TIMEOUT_S * (len(due) / PROBE_PARALLEL + 2))
        now = self._clock()
        answered = 0
        with self._lock:
            for peer, ok in results.items():
                p = self._probes.get(peer)
                if p is None:
                    continue
                self.stats["probes"] += 1
                if ok:
                    answered += 1
                    p.vouched_at = p.vouched_at or now
                    p.failures = 0
                    p.next_probe = now + REPROBE_S
                else:
                    self.stats["probe_failures"] += 1
                    p.vouched_at = None
                    p.failures += 1
                    p.next_probe = now + min(PROBE_BACKOFF_MAX_S, PROBE_BACKOFF_S * 2 ** (p.failures - 1))
        return answered

    async def _probe_all(self, peers: list[str]) -> dict[str, bool]:
        slots = asyncio.Semaphore(PROBE_PARALLEL)

        async def one(peer: str) -> tuple[str, bool]:
            async with slots:
                try:
                    await asyncio.wait_for(self.node.acall(peer, stream_name(self.run_id, streams.CHUNK),
                                                           chunk_request(PROBE_VERSION, 0), max_response_bytes=64),
                                           PROBE_TIMEOUT_S)
                except ProtocolError:
                    return peer, True  # a refusal in our framing: a live asyncrl node with this peer id
                except Exception:
                    return peer, False  # unreachable, no such node, no handler, or too slow
                return peer, False  # claims to hold a version nobody has: not a source to trust

        return dict(await asyncio.gather(*(one(p) for p in peers)))

    # ---- the signed record ----------------------------------------------------------------------
    def _vouched_records(self) -> list[swarm.PresenceRecord]:
        records = self.tracker.records()
        with self._lock:
            vouched = {p: v.vouched_at for p, v in self._probes.items() if v.vouched_at is not None}
        out = [r for p, r in records.items() if p in vouched and not self.service.excluded(p)]
        out.sort(key=lambda r: (not self.proven(r.peer_id), vouched[r.peer_id], r.peer_id))
        return out

    def _choose_seeders(self) -> tuple[str, ...]:
        fit = [r.peer_id for r in self._vouched_records()
               if r.serving and (r.upload_bps == 0 or r.upload_bps >= MIN_SEED_BPS)]
        fit.sort(key=lambda p: (not self.proven(p), self.service.rank(p)))  # stable: then longest vouched
        return tuple(sorted(fit[:swarm.SEEDERS_PER_VERSION]))

    def on_publish(self, version: int) -> None:
        """A new version is about to become visible: choose its seeders and store the record first."""
        with self._issue_lock:
            with self._lock:
                fresh = version != self._version
            if fresh:
                seeders = self._choose_seeders()
                with self._lock:
                    self._version, self._seeders = version, seeders
                self._service_due.set()
            self._issue()

    def check_service(self) -> dict[str, str]:
        """Check the current version's seeders (once per version; blocking, bounded by the check's wait):
        book each outcome and, when some are dropped, re-issue the record without them. Returns the outcomes."""
        with self._lock:
            version, seeders = self._version, self._seeders
        held = self.source.get(version) if self.source is not None and version >= 0 else None
        if held is None or version == self._checked_version or not seeders:
            return {}
        self._checked_version = version
        chunks = list(held.chunks)
        outcomes = self.node.loops.run(self.service.check(version, seeders, chunks),
                                       timeout=SERVICE_WAIT_S + SERVICE_GRACE_S + 5)
        dropped = {peer for peer, outcome in outcomes.items() if self.service.record(peer, outcome, self.proven(peer))}
        if dropped:
            with self._issue_lock:
                with self._lock:
                    if self._version != version:
                        return outcomes  # a newer version chose its seeders already (without them)
                    self._seeders = tuple(p for p in self._seeders if p not in dropped)
                self._issue()
        return outcomes

    def issue(self) -> bool:
        """Sign and store the current record (blocking DHT store). Until the first version, the seeders
        follow the vouched set; after it, they stay fixed until the next version."""
        with self._issue_lock:
            return self._issue()

    def _issue(self) -> bool:
        with self._lock:
            version, seeders = self._version, self._seeders
        if version < 0:
            seeders = self._choose_seeders()
            with self._lock:
                self._seeders = seeders
        vouched = self._vouched_records()
        cap = swarm.HOLDERS_PER_SHARD
        holders = [swarm.ProviderHolder(r.peer_id, tuple(sorted(r.versions))[-swarm.MAX_HOLDER_VERSIONS:])
                   for r in vouched if r.versions][:cap * swarm.MAX_PROVIDER_SHARDS]
        shards = max(1, min(swarm.MAX_PROVIDER_SHARDS, math.ceil(len(vouched) / cap)))
        now = self._clock()
        self._shard_high = {n: t for n, t in self._shard_high.items() if now - t < swarm.PROVIDERS_TTL_S}
        self._shard_high[shards] = now
        issued_at, ok, first = time.time(), True, None
        for shard in range(max(self._shard_high)):  # past the count too: those readers learn the new count
            base = (shard % shards) * cap
            mine = tuple(holders[(base + i) % len(holders)] for i in range(min(cap, len(holders))))
            record = swarm.ProvidersRecord(run_id=self.run_id, version=max(version, 0), issued_at=issued_at,
                                           seeders=seeders, holders=mine, shard=shard, shards=shards)
            first = first or record
            try:
                stored = self.node.store(swarm.providers_key(self.run_id, self.identity.peer_id, shard),
                                         swarm.seal_providers(self.identity, record), swarm.PROVIDERS_TTL_S)
            except Exception:
                stored = False
            ok = ok and bool(stored)
        self.stats["issued" if ok else "issue_failures"] += 1
        self.stats["shards"] = shards
        self.last_record = first
        return ok

    def push_targets(self) -> list[str]:
        """Whom to push a new pointer to: the vouched serving peers (seeders first), at most MAX_PUSH_TARGETS."""
        with self._lock:
            seeders = list(self._seeders)
        rest = [r.peer_id for r in self._vouched_records() if r.serving and r.peer_id not in seeders]
        return (seeders + rest)[:MAX_PUSH_TARGETS]

    # ---- the loop -------------------------------------------------------------------------------
    def start(self) -> "ProviderDesk":
        threading.Thread(target=self._loop, name="provider-desk", daemon=True).start()
        threading.Thread(target=self._service_loop, name="seeder-service", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._service_due.set()

    def _service_loop(self) -> None:
        """Checks the newest version's seeders, one version at a time (a version published meanwhile is
        the next one checked; those in between are not)."""
        while not self._stop.is_set():
            if not self._service_due.wait(1.0) or self._stop.is_set():
                continue
            self._service_due.clear()
            try:
                self.check_service()
            except Exception:  # the loop may be briefly unhappy; the next version is checked
                pass

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.probe_round()
                self.issue()
            except Exception:  # the DHT or the loop may be briefly unhappy; next round
                pass
            self._stop.wait(self.issue_every_s)

    def status(self) -> dict:
        with self._lock:
            vouched = sum(1 for p in self._probes.values() if p.vouched_at is not None)
            out = {"vouched": vouched, "tracked": len(self._probes), "seeders": len(self._seeders),
                   "version": self._version, **self.stats}
        return {**out, **self.service.status()}


class ProvidersCache:
    """The newest verified ProvidersRecord of a run (volunteer side); `view()` is what the fetcher plans with."""

    def __init__(self, node, run_id: str, coordinator_peer_id: str, coordinator_key: bytes, *,
                 max_age_s: float = 10.0, clock=time.monotonic):
        self.node, self.run_id, self.key_bytes = node, run_id, coordinator_key
        self.coordinator_peer_id = coordinator_peer_id
        self.shards = 1  # as the newest record read says; this reader's shard is providers_shard(me, shards)
        self.max_age_s = max_age_s
        self._clock = clock
        self.record: swarm.ProvidersRecord | None = None
        self.read_at = -1e18
        self.reads = 0
        self.bytes_read = 0
        self.errors = 0
        self._ensuring, self._ensure_reads = -1, 0  # the version `ensure` last read for, and its reads so far

    def refresh(self) -> swarm.ProvidersRecord | None:
        """Read this peer's shard; when the record says the shard count changed and so did this peer's
        shard, read the new shard at once (two reads, only when the count changes)."""
        shard = swarm.providers_shard(self.node.peer_id, self.shards)
        if self._read(shard):
            moved = swarm.providers_shard(self.node.peer_id, self.shards)
            if moved != shard:
                self._read(moved)
        return self.record

    def _read(self, shard: int) -> bool:
        """One read of `shard`; True when a verified record came back (its count is adopted if newest)."""
        self.read_at = self._clock()
        self.reads += 1
        try:
            raw = self.node.get(swarm.providers_key(self.run_id, self.coordinator_peer_id, shard))
        except Exception:
            self.errors += 1
            return False
        if not isinstance(raw, bytes):
            return False
        self.bytes_read += len(raw)
        try:
            record = swarm.check_providers(raw, coordinator_key=self.key_bytes, run_id=self.run_id, shard=shard)
        except ProtocolError:
            self.errors += 1
            return False
        if self.record is None or record.issued_at >= self.record.issued_at:
            self.record = record
            self.shards = record.shards
        return True

    def maybe_refresh(self) -> None:
        if self._clock() - self.read_at >= self.max_age_s:
            self.refresh()

    def ensure(self, version: int, attempts: int = ENSURE_READS, pause_s: float = 0.3) -> None:
        """Make sure the record is for `version` or newer if the coordinator has issued one (it stores the
        record before the pointer, so one read normally suffices).

        At most `attempts` reads per version, however often it is asked: the follower asks again after every
        failed fetch, and under load those retries would make a volunteer read the record ~5x as often as
        the refresh interval asks (bench/swarm_scale.py measures reads/min). A record that is late beyond that is
        picked up by `maybe_refresh` (every `max_age_s`); until then the fetch plans with the one held."""
        if version != self._ensuring:
            self._ensuring, self._ensure_reads = version, 0
        for i in range(attempts - self._ensure_reads):
            if self.record is not None and self.record.version >= version:
                return
            if i:
                time.sleep(pause_s)
            self._ensure_reads += 1
            self.refresh()
