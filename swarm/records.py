"""Swarm records on the hivemind DHT: the validator every node runs, and who writes/reads what.

Owned by the swarm transport (docs/transport.md, docs/scale.md); the record formats and checks
themselves are pure and live in `asyncrl.protocol.swarm`. Components:

  SwarmRecordValidator  hivemind RecordValidatorBase: on every node (coordinator and volunteers),
                        refuses pointer and providers records not signed by the coordinator, and presence
                        records not signed by the peer they describe or filed under another peer's shard,
                        whether asked to store them or handed them in an answer. Other keys pass untouched.
  PointerRecord         coordinator side: store the signed pointer (refresh = re-seal + store); on each new
                        version first let the ProviderDesk (swarm/providers.py) issue the providers record,
                        then push the pointer straight to the peers it vouches for, then store it in the DHT.
  PresenceBeacon        volunteer side: a thread that re-announces this peer in its own presence shard
                        every ~8 s (jittered, so a swarm's announcements do not come in waves).
  read_presence         the live, verified presence records of some (the coordinator: all) shards, at most
                        MAX_RECORDS_PER_SHARD verified per shard.
  PresenceTracker       coordinator side: reads every shard (jittered), reports each volunteer's version lag,
                        and remembers where the volunteers it vouches for actually connect from (peers.json).
                        A record missing from one read (a shard lookup that timed out under load, or a
                        flood) is kept until swarm.PRESENCE_TTL_S after it was first read: only expiry
                        forgets a volunteer, so the ProviderDesk does not drop a vouched seeder on a bad read.

Call-backs after a restart dial only addresses p2pd *observed* on an authenticated connection of a peer
the coordinator vouches for — never the addresses a record claims: a presence record is signed by its
peer, but what it says about addresses could name anyone's machine.

hivemind hashes keys before they reach a validator (`record.key` is DHTID bytes), so the validator
precomputes the ids of the keys it protects; it therefore needs the run id and the coordinator's
peer id, which every asyncrl node knows from its join address.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Callable

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from asyncrl.protocol import swarm
from asyncrl.protocol.errors import ProtocolError
from asyncrl.protocol.identity import Identity, public_key_from_peer_id

from .streams import POINTER, stream_name

PRESENCE_EVERY_S = 8.0
"""A volunteer re-announces itself about this often, +-JITTER (records expire after swarm.PRESENCE_TTL_S)."""
ANNOUNCE_SOON_S = 1.5
"""...and this long after it holds a new version."""
JITTER = 0.2
TRACK_EVERY_S = 5.0
"""The coordinator re-reads every presence shard about this often (+-JITTER)."""
PUSH_PARALLEL = 32
MAX_CALL_BACKS = 256
PUSH_TIMEOUT_S = 5.0

_REGULAR = MSGPackSerializer.dumps(None)  # hivemind's subkey tag for a plain (non-dictionary) value


def _key_id(key: str) -> bytes:
    return DHTID.generate(source=key).to_bytes()


class SwarmRecordValidator(RecordValidatorBase):
    def __init__(self, run_id: str, coordinator_peer_id: str):
        self.run_id = run_id
        self.coordinator_key = public_key_from_peer_id(coordinator_peer_id)
        self._pointer_id = _key_id(swarm.pointer_key(run_id, coordinator_peer_id))
        self._providers_id = _key_id(swarm.providers_key(run_id, coordinator_peer_id))
        self._providers = {_key_id(swarm.providers_key(run_id, coordinator_peer_id, s)): s
                           for s in range(swarm.MAX_PROVIDER_SHARDS)}
        self._shards = {_key_id(swarm.presence_key(run_id, s)): s for s in range(swarm.PRESENCE_SHARDS)}

    def validate(self, record: DHTRecord) -> bool:
        shard = self._shards.get(record.key)
        if shard is None and record.key != self._pointer_id and record.key not in self._providers:
            return True  # not ours to police
        try:
            value = MSGPackSerializer.loads(record.value)
            if not isinstance(value, bytes):
                return False
            if shard is None:
                if record.subkey != _REGULAR:
                    return False
                if record.key == self._pointer_id:
                    swarm.check_pointer(value, coordinator_key=self.coordinator_key, run_id=self.run_id,
                                        expiration_time=record.expiration_time)
                else:
                    swarm.check_providers(value, coordinator_key=self.coordinator_key, run_id=self.run_id,
                                          expiration_time=record.expiration_time, shard=self._providers[record.key])
            else:
                subkey = MSGPackSerializer.loads(record.subkey)
                if not isinstance(subkey, str):
                    return False
                swarm.check_presence(value, subkey=subkey, run_id=self.run_id, shard=shard,
                                     expiration_time=record.expiration_time)
            return True
        except ProtocolError:
            return False
        except Exception:  # hostile bytes may break msgpack in any way
            return False

    def merge_with(self, other: RecordValidatorBase) -> bool:
        # Two validators for the same run and coordinator are one; others stay separate.
        return (isinstance(other, SwarmRecordValidator) and other._pointer_id == self._pointer_id
                and other._providers_id == self._providers_id)


def install_validator(node, run_id: str, coordinator_peer_id: str) -> SwarmRecordValidator:
    """Add the validator to a running SwarmNode's DHT (before it stores or reads swarm records)."""
    validator = SwarmRecordValidator(run_id, coordinator_peer_id)
    node.dht.add_validators([validator])
    return validator


class PointerRecord:
    """The coordinator's pointer in the DHT. `store` a freshly sealed pointer; `refresh` re-seals the
    latest one (a new timestamp lets the record live another TTL; see protocol/swarm.py). `providers`
    (a swarm/providers.py ProviderDesk) issues the providers record for each new version before anyone
    can see its pointer, and names the peers to push each pointer to."""

    def __init__(self, node, identity: Identity, run_id: str, providers=None):
        self.node = node
        self.identity = identity
        self.run_id = run_id
        self.key = swarm.pointer_key(run_id, identity.peer_id)
        self.providers = providers
        self.pushed = 0
        self.last: bytes | None = None

    def store(self, sealed_pointer: bytes) -> bool:
        self.last = sealed_pointer
        if self.providers is not None:
            pointer, _ = swarm.check_pointer(sealed_pointer, coordinator_key=self.identity.public_key,
                                             run_id=self.run_id)
            self.providers.on_publish(pointer.version)  # seeders for this version, in the DHT first
            self.push_to(self.providers.push_targets())
        return self.node.store(self.key, sealed_pointer, swarm.POINTER_TTL_S)

    def push_to(self, peers: list[str]) -> None:
        """Push the latest pointer to `peers` in the background (does not wait)."""
        if self.last is not None and peers:
            self.node.loops.submit(self._push(self.last, peers))

    async def _push(self, sealed_pointer: bytes, peers: list[str]) -> None:
        import asyncio

        slots = asyncio.Semaphore(PUSH_PARALLEL)

        async def one(peer: str) -> None:
            async with slots:
                try:
                    await asyncio.wait_for(self.node.acall(peer, stream_name(self.run_id, POINTER), sealed_pointer,
                                                           max_response_bytes=64), PUSH_TIMEOUT_S)
                    self.pushed += 1
                except Exception:
                    pass  # best effort: that volunteer will read the DHT on its next poll

        await asyncio.gather(*(one(p) for p in peers))

    def refresh(self, sealed_pointer: bytes) -> bool:
        return self.store(swarm.reseal_pointer(self.identity, sealed_pointer))


class PresenceBeacon:
    """Re-announces this volunteer every `every_s`, and `ANNOUNCE_SOON_S` after `announce_soon()` (a new
    version held: late joiners should learn it soon, but not while the swarm is still busy fetching it).
    `snapshot()` returns the PresenceRecord fields that change: adapter_version, versions, throughput..."""

    def __init__(self, node, identity: Identity, run_id: str, name: str, snapshot: Callable[[], dict], *,
                 every_s: float = PRESENCE_EVERY_S, out=None):
        self.node, self.identity, self.run_id, self.name = node, identity, run_id, name
        self.snapshot = snapshot
        self.every_s = every_s
        self.out = out
        self.announced = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._due = 0.0  # monotonic time of the next announcement
        self._thread = threading.Thread(target=self._loop, name="presence", daemon=True)

    def start(self) -> "PresenceBeacon":
        self._thread.start()
        return self

    def announce_soon(self, delay_s: float | None = None) -> None:
        self._due = min(self._due, time.monotonic() + (ANNOUNCE_SOON_S if delay_s is None else delay_s))
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def record(self) -> swarm.PresenceRecord:
        fields = self.snapshot()
        return swarm.PresenceRecord(run_id=self.run_id, peer_id=self.identity.peer_id, name=self.name[:64],
                                    adapter_version=int(fields.get("adapter_version", -1)),
                                    versions=tuple(fields.get("versions", ()))[-swarm.MAX_VERSIONS_SERVED:],
                                    serving=bool(fields.get("serving", False)),
                                    upload_bps=int(fields.get("upload_bps", 0)),
                                    throughput=float(fields.get("throughput", 0.0)), last_seen=time.time(),
                                    maddrs=tuple(fields.get("maddrs", ()))[:swarm.MAX_MADDRS])

    def _loop(self) -> None:
        while not self._stop.is_set():
            left = self._due - time.monotonic()
            if left > 0:
                self._wake.wait(left)
                self._wake.clear()
                continue
            self._due = time.monotonic() + self.every_s * random.uniform(1 - JITTER, 1 + JITTER)
            try:
                sealed = swarm.seal_presence(self.identity, self.record())
                self.node.store(swarm.presence_key(self.run_id, swarm.presence_shard(self.identity.peer_id)), sealed,
                                swarm.PRESENCE_TTL_S, subkey=self.identity.peer_id)
                self.announced += 1
            except Exception as exc:  # the DHT may be briefly unhappy (coordinator restarting)
                if self.out is not None:
                    self.out(f"presence announce failed: {exc.__class__.__name__}: {exc}")


def read_presence(node, run_id: str, *, shards=None, now: float | None = None,
                  stats: dict | None = None) -> dict[str, swarm.PresenceRecord]:
    """Verified, unexpired presence records of `run_id` by peer id, from `shards` (default: all of them;
    one DHT lookup each, concurrently); at most MAX_RECORDS_PER_SHARD verified per shard. Unreachable or
    empty shards add nothing. `stats` (optional) counts records read, refused and over the bound."""
    shards = range(swarm.PRESENCE_SHARDS) if shards is None else shards
    keys = {swarm.presence_key(run_id, s): s for s in shards}
    try:
        found = node.get_many(list(keys))
    except Exception:
        return {}
    now = time.time() if now is None else now
    out = {}
    for key, raw in found.items():
        if not isinstance(raw, dict):
            continue
        verified = 0
        for peer_id, value in raw.items():
            if not isinstance(peer_id, str) or not isinstance(value, bytes):
                continue
            if verified >= swarm.MAX_RECORDS_PER_SHARD:
                _count(stats, "over_bound")
                continue
            verified += 1
            try:
                record = swarm.check_presence(value, subkey=peer_id, run_id=run_id, now=now, shard=keys[key])
            except ProtocolError:
                _count(stats, "refused")
                continue
            _count(stats, "records")
            _count(stats, "bytes", len(value))
            if now - record.last_seen <= swarm.PRESENCE_TTL_S + swarm.CLOCK_SLACK_S:
                out[peer_id] = record
    return out


def carry_presence(held: dict[str, swarm.PresenceRecord], first_read: dict[str, float],
                   read: dict[str, swarm.PresenceRecord], now: float):
    """Merge one read of the presence shards into what the tracker holds -> (records, first_read).

    A record read now replaces an older one of the same peer; a held record the read missed is kept while
    `now` (a local monotonic clock) is within swarm.PRESENCE_TTL_S of when that record was first read
    (`first_read[peer]`): it was in the DHT then, and its DHT entry expires at most that long after it was
    stored, so this is skew-proof (the peer's own `last_seen` clock is not trusted for it). Per shard, at most
    MAX_RECORDS_PER_SHARD are held, the ones just read first, so memory stays bounded whatever a flood of
    rotating keys does."""
    records = dict(read)
    stamps = {}
    for peer, record in read.items():
        old = held.get(peer)
        if old is not None and old.last_seen > record.last_seen:
            records[peer] = record = old  # a lagging replica answered: keep the newer record
        same = old is not None and old.last_seen == record.last_seen and peer in first_read
        stamps[peer] = first_read[peer] if same else now
    per_shard: dict[int, int] = {}
    for peer in records:
        shard = swarm.presence_shard(peer)
        per_shard[shard] = per_shard.get(shard, 0) + 1
    carried = sorted((p for p in held if p not in records and now - first_read[p] <= swarm.PRESENCE_TTL_S),
                     key=lambda p: -first_read[p])
    for peer in carried:
        shard = swarm.presence_shard(peer)
        if per_shard.get(shard, 0) < swarm.MAX_RECORDS_PER_SHARD:
            per_shard[shard] = per_shard.get(shard, 0) + 1
            records[peer], stamps[peer] = held[peer], first_read[peer]
    return records, stamps


def _count(stats: dict | None, key: str, n: int = 1) -> None:
    if stats is not None:
        stats[key] = stats.get(key, 0) + n


class PresenceTracker:
    """Coordinator side: reads every presence shard every ~`every_s` on a thread; `snapshot(current_version)`
    gives one dict per live volunteer with its version lag (what the dashboard and summary.json show).

    With `save_peers` / `load_peers` (the coordinator persists them in its run directory) and `keep(peer)`
    (whom it vouches for: swarm/providers.py), the addresses those volunteers' connections were *observed*
    coming from outlive a restart and `call_back()` dials them: the restarted coordinator's DHT knows
    nobody, and volunteers' libp2p dial backoff (grown while it was down) would otherwise delay their
    reconnect by up to minutes. Addresses a record merely claims are never dialled. This layer writes no
    files itself."""

    def __init__(self, node, run_id: str, *, every_s: float = TRACK_EVERY_S,
                 save_peers: Callable[[dict[str, list[str]]], None] | None = None,
                 load_peers: Callable[[], dict[str, list[str]]] | None = None,
                 keep: Callable[[str], bool] | None = None, clock=time.monotonic):
        self.node, self.run_id, self.every_s = node, run_id, every_s
        self.save_peers, self.load_peers = save_peers, load_peers
        self.keep = keep or (lambda peer: False)
        self._saved: dict[str, list[str]] = {}
        self.called_back: set[str] = set()  # answered call_back()
        self.read_stats: dict[str, int] = {}
        self.reads = 0
        self._records: dict[str, swarm.PresenceRecord] = {}
        self._first_read: dict[str, float] = {}  # peer -> when its held record was first read (monotonic)
        self._lock = threading.Lock()
        self._clock = clock
        self._stop = threading.Event()
        self.on_refresh: Callable[[], None] | None = None  # e.g. the ProviderDesk's probe round
        self._thread = threading.Thread(target=self._loop, name="presence-tracker", daemon=True)

    def start(self) -> "PresenceTracker":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while True:
            try:
                self.refresh()
                if self.on_refresh is not None:
                    self.on_refresh()
            except Exception:  # the DHT may be briefly unhappy; next round
                pass
            if self._stop.wait(self.every_s * random.uniform(1 - JITTER, 1 + JITTER)):
                return

    def refresh(self) -> None:
        records = read_presence(self.node, self.run_id, stats=self.read_stats)
        self.reads += 1
        with self._lock:
            self._records, self._first_read = carry_presence(self._records, self._first_read, records,
                                                             self._clock())
        if self.save_peers is not None:
            try:
                observed = self.node.connected_peers()
            except Exception:
                observed = {}
            known = {**self._saved, **{p: sorted(set(a))[:swarm.MAX_MADDRS] for p, a in observed.items()
                                       if self.keep(p)}}
            if known != self._saved:
                self.save_peers(known)
                self._saved = known

    def records(self) -> dict[str, swarm.PresenceRecord]:
        with self._lock:
            return dict(self._records)

    def call_back(self) -> list[str]:
        """Dial the volunteers `load_peers` remembers at the addresses they were seen connecting from (in
        this thread); returns those that answered."""
        from .bootstrap import rejoin

        saved = self.load_peers() if self.load_peers is not None else {}
        if not isinstance(saved, dict):
            return []
        self._saved = {p: a for p, a in saved.items() if isinstance(p, str) and isinstance(a, list)}
        answered = []
        for peer, maddrs in list(self._saved.items())[:MAX_CALL_BACKS]:
            targets = [f"{m.split('/p2p/')[0]}/p2p/{peer}" for m in maddrs[:swarm.MAX_MADDRS] if isinstance(m, str)]
            if targets and rejoin(self.node, targets):
                answered.append(peer)
        with self._lock:
            self.called_back = set(answered)
        return answered

    def snapshot(self, current_version: int) -> list[dict]:
        with self._lock:
            records = list(self._records.values())
        now = time.time()
        return [{"peer_id": r.peer_id, "name": r.name, "adapter_version": r.adapter_version,
                 "lag": (current_version - r.adapter_version) if r.adapter_version >= 0 else None,
                 "versions_served": list(r.versions), "serving": r.serving, "upload_bps": r.upload_bps,
                 "throughput": r.throughput, "last_seen": r.last_seen, "age_s": round(now - r.last_seen, 1),
                 "vouched": self.keep(r.peer_id)}
                for r in sorted(records, key=lambda r: r.name)]


def call_back_then_push(tracker: PresenceTracker, pointer: PointerRecord) -> None:
    """After a coordinator restart: dial the volunteers it knew, then push them the current pointer at once
    (its first publish happened before anyone was connected, so nobody was told)."""
    answered = tracker.call_back()
    if answered:
        pointer.push_to(answered)
