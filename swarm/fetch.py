"""Swarm fetch: one adapter version's manifest and chunks, from vouched peers first, the coordinator last.

Owned by the swarm transport (docs/transport.md, docs/scale.md). Used by the volunteer's AdapterSync.

Candidates come only from the coordinator-signed providers record (swarm/providers.py) — never from
self-declared presence, which anyone can forge in bulk. Who is asked for chunk i of version v
(`SwarmFetcher.plan`), in order, at most MAX_PLAN_PEERS peers before the coordinator:
  1. up to two vouched holders of v (complete), rotated by i and by the fetcher, so requests spread;
  2. the chunk's *seeder*: the record's seeders for this version (sorted; the fetcher included if
     named) take turns, chunk i -> seeders[(i + v) % n]. The seeder fetches its chunks from the
     coordinator; everyone else *long-polls* it (`wait_ms`), which answers the moment the chunk has
     arrived, and polls again while it says "not yet" (up to SEEDER_PATIENCE_S). So each fresh chunk
     leaves the coordinator about once, and every fetcher computes the same assignment without talking;
  3. the coordinator — always last, and the only source when nobody is vouched for yet.
The manifest goes the same way (holders, then the seeder of chunk 0, then the coordinator).

Timeouts are per peer and short (`PeerClock`): a peer's requests are timed (seconds per MiB, moving
average) and a request gets MARGIN x the expected time, within [MIN_PEER_TIMEOUT_S, MAX_PEER_TIMEOUT_S];
a peer never heard from gets FIRST_CONTACT_TIMEOUT_S. So a tarpit costs seconds, not a minute. The
coordinator is the source of truth behind a possibly slow uplink: COORDINATOR_TIMEOUT_S.

Seeders are kept on measured service: an honest seeder holds a long poll until the chunk arrives (or
`wait_s` passes), so one that answers "not yet" in less than half the wait is not serving. Each such quick
refusal backs that seeder off (POLL_BACKOFF_S, doubling to MAX_POLL_BACKOFF_S, for every chunk it was
asked for: the count is per peer), and QUICK_REFUSALS_TO_DEMOTE of them in a row demote it (skipped for
UNREACHABLE_S; the chunk goes to the coordinator) — a fetcher never spins on a seeder that refuses at once.
A tarpit costs one peer timeout per request in flight, then the peer is skipped.

A chunk that fails its sha256 against the signed manifest bans its provider (BAN_S) and is asked of
the next candidate; a provider that vanishes or times out is skipped (UNREACHABLE_S). Candidates are
re-planned (fresh providers record) and retried with backoff until `fetch_timeout_s`. If the
*coordinator* says it does not hold the version (STALE_VERSION: pruned, or it restarted and publishes
other versions now), the fetch is abandoned at once, so the follower goes back to the pointer.

Chunks are put into the local AdapterStore as soon as they verify, so this peer serves them (long
polls included) while it is still downloading. Runs on the SwarmNode's event loop; the blocking entry
points (`manifest`, `payload`) are for other threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from asyncrl.protocol import codec, limits, messages, swarm
from asyncrl.protocol.errors import ProtocolError, RejectCode

from . import streams
from .serving import AdapterStore, chunk_request, manifest_request
from .streams import stream_name

BAN_S = 600.0
"""A provider that served a chunk failing its hash is not asked again for this long."""
UNREACHABLE_S = 20.0
"""A provider whose stream broke or timed out is skipped for this long (it may be restarting)."""
MAX_PLAN_PEERS = 3
"""Peers asked for one chunk before the coordinator (two holders and the seeder)."""
FIRST_CONTACT_TIMEOUT_S = 5.0
MIN_PEER_TIMEOUT_S = 2.0
MAX_PEER_TIMEOUT_S = 10.0
MARGIN = 4.0
COORDINATOR_TIMEOUT_S = 30.0
SEEDER_PATIENCE_S = 20.0
"""How long a fetcher keeps long-polling a seeder that answers "not yet" before asking the coordinator."""
EWMA = 0.3
QUICK_REFUSALS_TO_DEMOTE = 6
"""Quick "not yet" answers in a row (all chunks together) after which a seeder is skipped for UNREACHABLE_S."""
POLL_BACKOFF_S, MAX_POLL_BACKOFF_S = 0.25, 4.0
"""Wait before long-polling a seeder again after a quick "not yet": doubles with each one in a row."""


class PeerClock:
    """Per-peer request timing -> short adaptive timeouts (module docstring)."""

    def __init__(self, coordinator: str):
        self.coordinator = coordinator
        self._s_per_mib: dict[str, float] = {}

    def timeout(self, peer: str, nbytes: int) -> float:
        if peer == self.coordinator:
            return COORDINATOR_TIMEOUT_S
        rate = self._s_per_mib.get(peer)
        if rate is None:
            return FIRST_CONTACT_TIMEOUT_S
        expected = rate * max(nbytes, 64 * 1024) / (1 << 20)
        return min(MAX_PEER_TIMEOUT_S, max(MIN_PEER_TIMEOUT_S, MARGIN * expected))

    def observe(self, peer: str, seconds: float, nbytes: int) -> None:
        sample = seconds / (max(nbytes, 64 * 1024) / (1 << 20))
        old = self._s_per_mib.get(peer)
        self._s_per_mib[peer] = sample if old is None else (1 - EWMA) * old + EWMA * sample


@dataclass
class FetchStats:
    chunks_from_peers: int = 0
    chunks_from_coordinator: int = 0
    bytes_from_peers: int = 0
    bytes_from_coordinator: int = 0
    manifests_from_peers: int = 0
    manifests_from_coordinator: int = 0
    hash_mismatches: int = 0
    refusals: int = 0
    quick_refusals: int = 0  # a long poll answered "not yet" in less than half its wait
    seeders_demoted: int = 0  # ...QUICK_REFUSALS_TO_DEMOTE times in a row: skipped for UNREACHABLE_S
    failures: int = 0
    timeouts: int = 0
    bytes_by_provider: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "bytes_by_provider"}
        d["bytes_by_provider"] = dict(self.bytes_by_provider)
        return d


@dataclass(frozen=True)
class ProviderView:
    seeders: tuple[str, ...]  # vouched seeders of the record's version, sorted (the fetcher included if named)
    holders: dict[int, tuple[str, ...]]  # version -> vouched peers holding it complete

    @classmethod
    def of(cls, record: swarm.ProvidersRecord | None, me: str) -> "ProviderView":
        if record is None:
            return cls((), {})
        holders: dict[int, list[str]] = defaultdict(list)
        for h in record.holders:
            if h.peer_id != me:
                for v in h.versions:
                    holders[v].append(h.peer_id)
        return cls(tuple(sorted(set(record.seeders))), {v: tuple(sorted(ps)) for v, ps in holders.items()})


class SwarmFetcher:
    def __init__(self, node, *, run_id: str, coordinator_peer_id: str, store: AdapterStore,
                 providers: Callable[[], swarm.ProvidersRecord | None] | None = None,
                 max_peer_requests: int = 16, max_coordinator_requests: int = 4, peer_wait_s: float = 8.0,
                 fetch_timeout_s: float = 120.0):
        self.node = node
        self.run_id = run_id
        self.coordinator = coordinator_peer_id
        self.me = node.peer_id
        self.store = store
        self.providers = providers or (lambda: None)
        self.max_peer_requests = max_peer_requests
        self.max_coordinator_requests = max_coordinator_requests
        self.peer_wait_s = peer_wait_s
        self.fetch_timeout_s = fetch_timeout_s
        self.clock = PeerClock(coordinator_peer_id)
        self.stats = FetchStats()
        self._avoid: dict[str, float] = {}  # peer -> monotonic time until which it is skipped
        self._quick: dict[str, int] = {}  # peer -> quick "not yet" answers in a row (measured service)
        self._spread = int.from_bytes(hashlib.sha256(self.me.encode()).digest()[:4], "big")

    # ---- provider choice ----------------------------------------------------------------------
    def _usable(self, peer: str) -> bool:
        return peer != self.me and peer != self.coordinator and self._avoid.get(peer, 0.0) <= time.monotonic()

    def view(self) -> ProviderView:
        return ProviderView.of(self.providers(), self.me)

    def _holders(self, version: int, index: int, view: ProviderView) -> list[str]:
        holders = [p for p in view.holders.get(version, ()) if self._usable(p)]
        if not holders:
            return []
        k = (index + self._spread) % len(holders)
        return (holders[k:] + holders[:k])[:2]

    def seeder(self, version: int, index: int, view: ProviderView) -> str | None:
        return view.seeders[(index + version) % len(view.seeders)] if view.seeders else None

    def plan(self, version: int, index: int, view: ProviderView) -> list[tuple[str, float]]:
        """(peer, long-poll seconds) to try in order; at most MAX_PLAN_PEERS peers, the coordinator last."""
        out = [(p, 0.0) for p in self._holders(version, index, view)]
        seeder = self.seeder(version, index, view)
        if seeder is not None and self._usable(seeder) and seeder not in [p for p, _ in out]:
            out.append((seeder, self.peer_wait_s))
        return out[:MAX_PLAN_PEERS] + [(self.coordinator, 0.0)]

    # ---- blocking entry points (from any thread but the loop's) --------------------------------
    def manifest(self, version: int, verify: Callable[[bytes], messages.AdapterManifest], *,
                 peers: bool = True) -> tuple[bytes, messages.AdapterManifest]:
        return self.node.loops.run(self._manifest(version, verify, peers), timeout=self.fetch_timeout_s + 5)

    def payload(self, manifest: messages.AdapterManifest, manifest_bytes: bytes) -> bytes:
        return self.node.loops.run(self._payload(manifest, manifest_bytes), timeout=self.fetch_timeout_s + 5)

    # ---- coroutines ------------------------------------------------------------------------------
    async def _manifest(self, version: int, verify, peers: bool) -> tuple[bytes, messages.AdapterManifest]:
        deadline = time.monotonic() + self.fetch_timeout_s
        attempt = 0
        while True:
            plan = self.plan(version, 0, self.view()) if peers else [(self.coordinator, 0.0)]
            for peer, wait_s in plan:
                timeout = self.clock.timeout(peer, limits.MAX_MANIFEST_BYTES // 8) + wait_s
                started = time.monotonic()
                try:
                    raw = await asyncio.wait_for(
                        self.node.acall(peer, stream_name(self.run_id, streams.MANIFEST), manifest_request(version, wait_s),
                                        max_response_bytes=limits.MAX_MANIFEST_BYTES), timeout)
                except ProtocolError as exc:
                    self.stats.refusals += 1
                    if peer == self.coordinator and exc.code == RejectCode.STALE_VERSION:
                        raise  # the source of truth does not hold it (any more): back to the pointer
                    continue
                except Exception as exc:
                    self._failed(peer, exc)
                    continue
                if wait_s == 0:
                    self.clock.observe(peer, time.monotonic() - started, len(raw))
                try:
                    manifest = verify(raw)
                except ProtocolError:
                    if peer == self.coordinator:
                        raise
                    self.stats.hash_mismatches += 1
                    self._skip(peer, BAN_S)
                    continue
                if peer == self.coordinator:
                    self.stats.manifests_from_coordinator += 1
                else:
                    self.stats.manifests_from_peers += 1
                return raw, manifest
            attempt += 1
            if time.monotonic() > deadline:
                raise ProtocolError(RejectCode.STALE_VERSION, f"nobody served the manifest of v{version}")
            await asyncio.sleep(min(5.0, 0.25 * 2 ** attempt))

    async def _payload(self, manifest: messages.AdapterManifest, manifest_bytes: bytes) -> bytes:
        version, n = manifest.version, len(manifest.chunk_hashes)
        held = self.store.begin(version, manifest_bytes, n, is_keyframe=manifest.parent_version is None)
        view = self.view()
        plans = {i: self.plan(version, i, view) for i in range(n)}
        # Chunks only the coordinator can give go first: everyone else is waiting for them.
        order = sorted(range(n), key=lambda i: (plans[i][0][0] != self.coordinator, i))
        peer_slots = asyncio.Semaphore(self.max_peer_requests)
        coordinator_slots = asyncio.Semaphore(self.max_coordinator_requests)
        deadline = time.monotonic() + self.fetch_timeout_s

        results: list[bytes | None] = list(held.chunks)

        async def one(i: int) -> None:
            if results[i] is not None:
                return
            attempt = 0
            while True:
                for peer, wait_s in plans[i]:
                    if peer != self.coordinator and not self._usable(peer):
                        continue
                    slots = coordinator_slots if peer == self.coordinator else peer_slots
                    patience = time.monotonic() + (SEEDER_PATIENCE_S if wait_s > 0 else 0.0)
                    while True:
                        asked = time.monotonic()
                        async with slots:
                            data, outcome = await self._chunk(peer, manifest, i, wait_s)
                        # a seeder that says "not yet" is polled again: its copy is on the way
                        if outcome != "refused" or wait_s == 0 or time.monotonic() > patience or not self._usable(peer):
                            break
                        if time.monotonic() - asked < wait_s / 2:  # it did not hold the poll: not serving
                            backoff = self._quick_refusal(peer)
                            if backoff is None:
                                break  # demoted: on to the next candidate
                            await asyncio.sleep(backoff)
                    if data is not None:
                        results[i] = data
                        self.store.put_chunk(version, i, data, manifest_bytes=manifest_bytes)
                        return
                attempt += 1
                if time.monotonic() > deadline:
                    raise ProtocolError(RejectCode.STALE_VERSION, f"chunk {i} of v{version}: no provider delivered")
                await asyncio.sleep(min(5.0, 0.25 * 2 ** attempt))
                plans[i] = self.plan(version, i, self.view())

        tasks = [asyncio.ensure_future(one(i)) for i in order]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            held_now = self.store.get(version)
            if held_now is not None and not held_now.complete:
                self.store.drop(version)  # an abandoned partial copy would never be completed or pruned
            raise
        finally:
            for t in tasks:
                t.cancel()
        payload = b"".join(results)
        if len(payload) != manifest.compressed_bytes:
            raise ProtocolError(RejectCode.MALFORMED, "payload size differs from the manifest")
        return payload

    async def _chunk(self, peer: str, manifest: messages.AdapterManifest, index: int,
                     wait_s: float) -> tuple[bytes | None, str]:
        """(chunk, "ok") or (None, "refused" | "failed" | "bad")."""
        started = time.monotonic()
        try:
            data = await asyncio.wait_for(
                self.node.acall(peer, stream_name(self.run_id, streams.CHUNK), chunk_request(manifest.version, index, wait_s),
                                max_response_bytes=manifest.chunk_bytes),
                wait_s + self.clock.timeout(peer, manifest.chunk_bytes))
        except ProtocolError as exc:
            self.stats.refusals += 1  # not held (yet), or rate-limited: not the provider's fault
            if peer == self.coordinator and exc.code == RejectCode.STALE_VERSION:
                raise  # the coordinator does not hold this version: abandon the fetch (see module docstring)
            return None, "refused"
        except Exception as exc:
            self._failed(peer, exc)
            return None, "failed"
        if wait_s == 0:
            self.clock.observe(peer, time.monotonic() - started, len(data))
        try:
            codec.verify_chunk(data, manifest.chunk_hashes[index])
        except ProtocolError:
            self.stats.hash_mismatches += 1
            self._skip(peer, BAN_S)
            return None, "bad"
        if peer == self.coordinator:
            self.stats.chunks_from_coordinator += 1
            self.stats.bytes_from_coordinator += len(data)
        else:
            self._quick.pop(peer, None)  # it serves
            self.stats.chunks_from_peers += 1
            self.stats.bytes_from_peers += len(data)
        self.stats.bytes_by_provider[peer] += len(data)
        return data, "ok"

    def _quick_refusal(self, peer: str) -> float | None:
        """Count a quick "not yet" from `peer`: seconds to wait before polling it again, or None once it is
        demoted (skipped for UNREACHABLE_S)."""
        self.stats.quick_refusals += 1
        n = self._quick[peer] = self._quick.get(peer, 0) + 1
        if n >= QUICK_REFUSALS_TO_DEMOTE:
            self._quick.pop(peer, None)
            self.stats.seeders_demoted += 1
            self._skip(peer, UNREACHABLE_S)
            return None
        return min(MAX_POLL_BACKOFF_S, POLL_BACKOFF_S * 2 ** (n - 1))

    def _failed(self, peer: str, exc: BaseException) -> None:
        self.stats.failures += 1  # vanished, unreachable or timed out
        if isinstance(exc, asyncio.TimeoutError):
            self.stats.timeouts += 1
        self._skip(peer, UNREACHABLE_S)

    def _skip(self, peer: str, seconds: float) -> None:
        if peer != self.coordinator:  # the coordinator is never avoided: it is the source of truth
            self._avoid[peer] = max(self._avoid.get(peer, 0.0), time.monotonic() + seconds)

    @property
    def banned(self) -> list[str]:
        now = time.monotonic()
        return sorted(p for p, until in self._avoid.items() if until - now > UNREACHABLE_S)
