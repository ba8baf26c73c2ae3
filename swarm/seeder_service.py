"""Seeders kept on measured service, coordinator side (docs/SECURITY.md "Seeders kept on measured service").

Owned by the swarm transport; used by swarm/providers.py's ProviderDesk. A probe (a request for a version
nobody has) proves only that a live asyncrl node answers: a peer that refuses every chunk at once, one that
holds every request and never answers (a tarpit), or one that holds every long poll to its end and then says
"not yet" passes it. With fewer proven volunteers than seeder slots such peers are chosen, and every fetcher
assigned a chunk to them pays for it. So, right after each version is published, the coordinator asks each of
its seeders for one chunk of that version as every fetcher does (a long poll of SERVICE_WAIT_S: an honest
seeder is fetching that version from the coordinator this very moment and answers as soon as the chunk
lands) and compares the answer with its own bytes:

  served   the right bytes within the wait                         -> ranked first among unproven peers
  slow     "not yet" after holding at least half the wait          -> a miss; SLOW_MISSES_TO_DROP in a row drop it
  quick    "not yet" in less than half the wait (not serving)      -> dropped
  failed   no answer within the wait + SERVICE_GRACE_S, or no handler -> dropped; for a volunteer with accepted
           batches a miss (it may just be reconnecting, e.g. after a coordinator restart)
  bad      bytes that differ from the coordinator's                -> dropped

A dropped peer leaves the current version's seeders at once (the record is re-issued without it) and is named
in no record (seeder, holder or push target) for SERVICE_BACKOFF_S, doubling with each drop in a row up to
SERVICE_BACKOFF_MAX_S; a check it then serves clears its count. Dropping is no verdict on a volunteer — seeding
is a service, and the coordinator serves every chunk a seeder does not — so an honest but overloaded seeder
may be dropped for a while at no cost to itself. The check is one chunk per seeder per version. Its limit: a
seeder that serves the coordinator's peer id and no one else is caught only by each fetcher's own back-off
(swarm/fetch.py: quick refusals, timeouts).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from asyncrl.protocol.errors import ProtocolError

from . import streams
from .serving import chunk_request
from .streams import stream_name

SERVICE_WAIT_S = 8.0
"""The long poll a service check asks for (a seeder holds it at most serving.MAX_WAIT_S)."""
SERVICE_GRACE_S = 10.0
"""Beyond the wait, how long an answer may take before the seeder counts as a tarpit."""
SLOW_MISSES_TO_DROP = 2
SERVICE_BACKOFF_S, SERVICE_BACKOFF_MAX_S = 60.0, 600.0
OUTCOMES = ("served", "slow", "quick", "failed", "bad")
DROPPING = ("quick", "failed", "bad")


@dataclass
class _Service:
    served: int = 0
    misses: int = 0  # slow answers in a row
    drops: int = 0  # drops in a row (reset by a served check)
    excluded_until: float = 0.0  # monotonic
    last: str = ""


class SeederService:
    """Per-peer measured service: what each check found, who is excluded, and the order seeders are preferred
    in. Thread-safe; `check` runs on the node's event loop."""

    def __init__(self, node, run_id: str, *, clock=time.monotonic):
        self.node, self.run_id = node, run_id
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[str, _Service] = {}
        self.stats = {"service_checks": 0, "seeders_dropped": 0, **{f"service_{o}": 0 for o in OUTCOMES}}

    def excluded(self, peer: str) -> bool:
        with self._lock:
            s = self._peers.get(peer)
            return s is not None and s.excluded_until > self._clock()

    def rank(self, peer: str) -> int:
        """0: its last check was served; 1: not measured yet; 2: its last check was a miss."""
        with self._lock:
            s = self._peers.get(peer)
        if s is None or not s.last:
            return 1
        return 0 if s.last == "served" else 2

    def record(self, peer: str, outcome: str, proven: bool = False) -> bool:
        """Book one check's outcome; True when it drops the peer. `proven`: a volunteer with accepted batches,
        for which a check that got no answer is a miss, not a drop."""
        now = self._clock()
        with self._lock:
            s = self._peers.setdefault(peer, _Service())
            s.last = outcome
            self.stats["service_checks"] += 1
            self.stats[f"service_{outcome}"] += 1
            if outcome == "served":
                s.served, s.misses, s.drops = s.served + 1, 0, 0
                return False
            if outcome == "slow" or (proven and outcome == "failed"):
                s.misses += 1
                if s.misses < SLOW_MISSES_TO_DROP:
                    return False
            s.misses = 0
            s.drops += 1
            s.excluded_until = now + min(SERVICE_BACKOFF_MAX_S, SERVICE_BACKOFF_S * 2 ** (s.drops - 1))
            self.stats["seeders_dropped"] += 1
            return True

    def forget(self, keep) -> None:
        """Drop the books of peers `keep(peer)` is False for (their presence expired), once excluded no more."""
        now = self._clock()
        with self._lock:
            for peer in [p for p, s in self._peers.items() if not keep(p) and s.excluded_until <= now]:
                del self._peers[peer]

    async def check(self, version: int, seeders: tuple[str, ...], chunks: list[bytes]) -> dict[str, str]:
        """Ask each seeder (sorted, as fetchers assign them) for one of its own chunks of `version`; the
        outcome per seeder (not yet booked: `record` does that)."""
        n = len(seeders)

        async def one(pos: int, peer: str) -> tuple[str, str]:
            index = ((pos - version) % n) % len(chunks)  # a chunk fetchers long-poll this seeder for
            started = time.monotonic()  # a duration: the real clock, whatever books exclusions
            try:
                data = await asyncio.wait_for(
                    self.node.acall(peer, stream_name(self.run_id, streams.CHUNK),
                                    chunk_request(version, index, SERVICE_WAIT_S),
                                    max_response_bytes=max(64, len(chunks[index]))),
                    SERVICE_WAIT_S + SERVICE_GRACE_S)
            except ProtocolError:
                return peer, "slow" if time.monotonic() - started >= SERVICE_WAIT_S / 2 else "quick"
            except Exception:  # timed out (a tarpit), vanished, or no chunk handler
                return peer, "failed"
            return peer, "served" if data == chunks[index] else "bad"

        if not seeders or not chunks:
            return {}
        return dict(await asyncio.gather(*(one(i, p) for i, p in enumerate(seeders))))

    def status(self) -> dict:
        now = self._clock()
        with self._lock:
            excluded = sum(1 for s in self._peers.values() if s.excluded_until > now)
        return {**self.stats, "seeders_excluded": excluded}
