"""Swarm fetch: one adapter version's manifest and chunks, from peers first and the coordinator last.

Owned by the swarm transport (docs/transport.md). Used by the volunteer's AdapterSync.

Who is asked for chunk i of version v (`SwarmFetcher.plan`), in order:
  1. peers whose presence record says they hold v completely, rotated by i and by the fetcher, so
     requests spread over all holders;
  2. the chunk's *seeder*: the live serving peers (from presence, sorted by peer id, the fetcher
     included) take turns, chunk i -> peers[(i + v) % n]. The seeder fetches its chunks from the
     coordinator; everyone else long-polls the seeder (`wait_ms`), which answers the moment the chunk
     has arrived. So each fresh chunk leaves the coordinator about once and the copies fan out from
     peers, while every fetcher computes the same assignment without talking to anyone;
  3. the coordinator — always last, and the only source when no peer is known.
A chunk that fails its sha256 against the signed manifest bans its provider (BAN_S) and is asked of
the next candidate; a provider that vanishes or refuses is skipped for this chunk. Candidates are
re-planned (fresh presence) and retried with backoff until `fetch_timeout_s`. If the *coordinator*
says it does not hold the version (STALE_VERSION: pruned, or it restarted and publishes other versions
now), the fetch is abandoned at once, so the follower goes back to the pointer instead of waiting for
bytes nobody will serve.

Chunks are put into the local AdapterStore as soon as they verify, so this peer serves them
(long polls included) while it is still downloading. Runs on the SwarmNode's event loop; the
blocking entry points (`manifest`, `payload`) are for other threads.
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
"""A provider whose stream broke is skipped for this long (it may be restarting)."""
MIN_SEED_BPS = 1 << 20
"""Peers capped below this upload rate (bytes/s) are not made seeders (they would hold everyone up)."""
PRESENCE_MAX_AGE_S = 5.0


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
    failures: int = 0
    bytes_by_provider: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "bytes_by_provider"}
        d["bytes_by_provider"] = dict(self.bytes_by_provider)
        return d


@dataclass(frozen=True)
class ProviderView:
    seeders: tuple[str, ...]  # live serving peers fit to seed, sorted (the fetcher included if it serves)
    holders: dict[int, tuple[str, ...]]  # version -> peers that announced it complete


class PresenceCache:
    """Presence records, re-read from the DHT at most every `max_age_s` (by whoever calls refresh)."""

    def __init__(self, node, run_id: str, max_age_s: float = PRESENCE_MAX_AGE_S):
        from .records import read_presence

        self._read = lambda: read_presence(node, run_id)
        self.max_age_s = max_age_s
        self.records: dict[str, swarm.PresenceRecord] = {}
        self.read_at = 0.0

    def maybe_refresh(self) -> None:
        if time.monotonic() - self.read_at >= self.max_age_s:
            self.records = self._read()
            self.read_at = time.monotonic()


class SwarmFetcher:
    def __init__(self, node, *, run_id: str, coordinator_peer_id: str, store: AdapterStore,
                 presence: Callable[[], dict[str, swarm.PresenceRecord]] | None = None,
                 serving_self: bool = True, max_peer_requests: int = 16, max_coordinator_requests: int = 4,
                 peer_wait_s: float = 4.0, request_timeout_s: float = 60.0, fetch_timeout_s: float = 120.0):
        self.node = node
        self.run_id = run_id
        self.coordinator = coordinator_peer_id
        self.me = node.peer_id
        self.store = store
        self.presence = presence or (lambda: {})
        self.serving_self = serving_self
        self.max_peer_requests = max_peer_requests
        self.max_coordinator_requests = max_coordinator_requests
        self.peer_wait_s = peer_wait_s
        self.request_timeout_s = request_timeout_s
        self.fetch_timeout_s = fetch_timeout_s
        self.stats = FetchStats()
        self._avoid: dict[str, float] = {}  # peer -> monotonic time until which it is skipped
        self._spread = int.from_bytes(hashlib.sha256(self.me.encode()).digest()[:4], "big")

    # ---- provider choice ----------------------------------------------------------------------
    def _usable(self, peer: str) -> bool:
        return peer != self.me and peer != self.coordinator and self._avoid.get(peer, 0.0) <= time.monotonic()

    def view(self) -> ProviderView:
        records = self.presence()
        seeders = {p for p, r in records.items()
                   if r.serving and (r.upload_bps == 0 or r.upload_bps >= MIN_SEED_BPS) and p != self.coordinator}
        if self.serving_self:
            seeders.add(self.me)
        holders: dict[int, list[str]] = defaultdict(list)
        for p, r in records.items():
            if r.serving and p != self.me:
                for v in r.versions:
                    holders[v].append(p)
        return ProviderView(tuple(sorted(seeders)), {v: tuple(sorted(ps)) for v, ps in holders.items()})

    def plan(self, version: int, index: int, view: ProviderView) -> list[tuple[str, float]]:
        """(peer, long-poll seconds) to try in order; the coordinator is always last."""
        out: list[tuple[str, float]] = []
        holders = [p for p in view.holders.get(version, ()) if self._usable(p)]
        if holders:
            k = (index + self._spread) % len(holders)
            out += [(p, 0.0) for p in (holders[k:] + holders[:k])[:2]]
        if view.seeders:
            seeder = view.seeders[(index + version) % len(view.seeders)]
            if self._usable(seeder) and seeder not in [p for p, _ in out]:
                out.append((seeder, self.peer_wait_s))
        out.append((self.coordinator, 0.0))
        return out

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
            view = self.view()
            holders = [p for p in view.holders.get(version, ()) if self._usable(p)] if peers else []
            k = self._spread % len(holders) if holders else 0
            for peer in (holders[k:] + holders[:k])[:2] + [self.coordinator]:
                try:
                    raw = await asyncio.wait_for(
                        self.node.acall(peer, stream_name(self.run_id, streams.MANIFEST), manifest_request(version),
                                        max_response_bytes=limits.MAX_MANIFEST_BYTES), self.request_timeout_s)
                except ProtocolError as exc:
                    self.stats.refusals += 1
                    if peer == self.coordinator and exc.code == RejectCode.STALE_VERSION:
                        raise  # the source of truth does not hold it (any more): back to the pointer
                    continue
                except Exception:
                    self.stats.failures += 1
                    self._skip(peer, UNREACHABLE_S)
                    continue
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
                    async with slots:
                        data = await self._chunk(peer, manifest, i, wait_s)
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

    async def _chunk(self, peer: str, manifest: messages.AdapterManifest, index: int, wait_s: float) -> bytes | None:
        try:
            data = await asyncio.wait_for(
                self.node.acall(peer, stream_name(self.run_id, streams.CHUNK), chunk_request(manifest.version, index, wait_s),
                                max_response_bytes=manifest.chunk_bytes),
                wait_s + self.request_timeout_s)
        except ProtocolError as exc:
            self.stats.refusals += 1  # not held (yet): not the provider's fault
            if peer == self.coordinator and exc.code == RejectCode.STALE_VERSION:
                raise  # the coordinator does not hold this version: abandon the fetch (see module docstring)
            return None
        except Exception:
            self.stats.failures += 1  # vanished, unreachable or timed out
            self._skip(peer, UNREACHABLE_S)
            return None
        try:
            codec.verify_chunk(data, manifest.chunk_hashes[index])
        except ProtocolError:
            self.stats.hash_mismatches += 1
            self._skip(peer, BAN_S)
            return None
        if peer == self.coordinator:
            self.stats.chunks_from_coordinator += 1
            self.stats.bytes_from_coordinator += len(data)
        else:
            self.stats.chunks_from_peers += 1
            self.stats.bytes_from_peers += len(data)
        self.stats.bytes_by_provider[peer] += len(data)
        return data

    def _skip(self, peer: str, seconds: float) -> None:
        if peer != self.coordinator:  # the coordinator is never avoided: it is the source of truth
            self._avoid[peer] = max(self._avoid.get(peer, 0.0), time.monotonic() + seconds)

    @property
    def banned(self) -> list[str]:
        now = time.monotonic()
        return sorted(p for p, until in self._avoid.items() if until - now > UNREACHABLE_S)
