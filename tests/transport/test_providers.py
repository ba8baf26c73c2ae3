"""ProviderDesk and the fetch plan without a network: a scripted swarm answers probes, the desk vouches
only for peers that answered, and fetchers plan only with what the signed record names."""

from __future__ import annotations

import asyncio
import struct
import time

from asyncrl.protocol import swarm
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity
from asyncrl.swarm import providers as providers_mod
from asyncrl.swarm import seeder_service
from asyncrl.swarm.fetch import MAX_PLAN_PEERS, PeerClock, ProviderView, SwarmFetcher
from asyncrl.swarm.providers import ProviderDesk, ProvidersCache
from asyncrl.swarm.serving import AdapterStore

RUN = "r"
COORD = Identity.from_seed(bytes(range(32)))


class Loops:
    """The one thing the desk needs of a LoopThread: run a coroutine to completion."""

    def run(self, coro, timeout=None):
        return asyncio.run(asyncio.wait_for(coro, timeout))


class ScriptedSwarm:
    """A node whose peers behave as scripted: `honest` answer a probe with a refusal (a live asyncrl
    server), `tarpits` never answer, everyone else does not exist. Stores land in `stored`."""

    def __init__(self, honest=(), tarpits=()):
        self.peer_id = COORD.peer_id
        self.honest, self.tarpits = set(honest), set(tarpits)
        self.loops = Loops()
        self.calls: list[str] = []
        self.stored: dict[str, bytes] = {}

    async def acall(self, peer, name, request, *, max_response_bytes):
        self.calls.append(peer)
        if peer in self.honest:
            raise ProtocolError(RejectCode.STALE_VERSION, "chunk not held")
        if peer in self.tarpits:
            await asyncio.sleep(3600)
        raise ConnectionError("no such peer")

    def store(self, key, value, ttl, subkey=None):
        self.stored[key] = value
        return True

    def get(self, key):
        return self.stored.get(key)


class Tracker:
    def __init__(self, records):
        self._records = records

    def records(self):
        return dict(self._records)


def presence(identity: Identity, versions=(0, 1, 2), upload_bps=0) -> swarm.PresenceRecord:
    return swarm.PresenceRecord(run_id=RUN, peer_id=identity.peer_id, name="x", adapter_version=max(versions),
                                versions=tuple(versions), serving=True, upload_bps=upload_bps, throughput=0.0,
                                last_seen=time.time())


def test_fake_and_tarpit_records_are_never_vouched_for_and_probing_them_is_bounded(monkeypatch):
    monkeypatch.setattr(providers_mod, "PROBE_TIMEOUT_S", 0.2)
    alice, bob = Identity.generate(), Identity.generate()
    sybils = [Identity.generate() for _ in range(200)]
    tarpit = Identity.generate()
    everyone = [alice, bob, tarpit, *sybils]
    node = ScriptedSwarm(honest=[alice.peer_id, bob.peer_id], tarpits=[tarpit.peer_id])
    desk = ProviderDesk(node, COORD, RUN, Tracker({i.peer_id: presence(i, versions=range(64)) for i in everyone}),
                        proven=lambda peer: peer in (alice.peer_id, bob.peer_id))
    desk.probe_round()
    assert len(node.calls) == providers_mod.PROBES_PER_ROUND  # one round probes a bounded number of peers
    assert desk.vouched(alice.peer_id) and desk.vouched(bob.peer_id)  # proven volunteers are probed first
    rounds = 1
    while any(desk._probes[i.peer_id].failures == 0 for i in sybils):  # until every fake was tried once
        desk.probe_round()
        rounds += 1
    calls = len(node.calls)
    desk.probe_round()  # everyone failed once is now backing off: nothing to do
    assert len(node.calls) == calls and rounds <= 1 + 203 // providers_mod.PROBES_PER_ROUND
    desk.on_publish(5)
    record = swarm.check_providers(node.stored[swarm.providers_key(RUN, COORD.peer_id)],
                                   coordinator_key=COORD.public_key, run_id=RUN)
    assert set(record.seeders) == {alice.peer_id, bob.peer_id} and record.version == 5
    assert {h.peer_id for h in record.holders} == {alice.peer_id, bob.peer_id}
    assert all(len(h.versions) <= swarm.MAX_HOLDER_VERSIONS for h in record.holders)
    assert set(desk.push_targets()) == {alice.peer_id, bob.peer_id}
    assert not desk.vouched(tarpit.peer_id)


def test_seeders_stay_fixed_for_a_version_and_change_with_the_next():
    alice, bob, carol = (Identity.generate() for _ in range(3))
    records = {i.peer_id: presence(i) for i in (alice, bob)}
    node = ScriptedSwarm(honest=[alice.peer_id, bob.peer_id, carol.peer_id])
    tracker = Tracker(records)
    desk = ProviderDesk(node, COORD, RUN, tracker)
    desk.probe_round()
    desk.on_publish(1)
    assert desk.last_record.seeders == tuple(sorted([alice.peer_id, bob.peer_id]))
    records[carol.peer_id] = presence(carol, versions=(1,))
    desk.probe_round()
    desk.issue()  # holders follow the swarm, seeders of v1 do not: every fetcher must plan alike
    assert carol.peer_id not in desk.last_record.seeders
    assert carol.peer_id in {h.peer_id for h in desk.last_record.holders}
    desk.on_publish(2)
    assert carol.peer_id in desk.last_record.seeders
    del records[bob.peer_id]  # its presence expired: no longer named
    desk.probe_round()
    desk.on_publish(3)
    assert bob.peer_id not in desk.last_record.seeders


def test_slow_uploaders_hold_versions_but_do_not_seed():
    fast, slow = Identity.generate(), Identity.generate()
    node = ScriptedSwarm(honest=[fast.peer_id, slow.peer_id])
    desk = ProviderDesk(node, COORD, RUN, Tracker({fast.peer_id: presence(fast),
                                                   slow.peer_id: presence(slow, upload_bps=100_000)}))
    desk.probe_round()
    desk.on_publish(0)
    assert desk.last_record.seeders == (fast.peer_id,)
    assert {h.peer_id for h in desk.last_record.holders} == {fast.peer_id, slow.peer_id}


class Node:
    def __init__(self, peer_id):
        self.peer_id = peer_id


def test_the_plan_names_only_vouched_peers_and_is_capped():
    me = Identity.generate().peer_id
    seeders = sorted(Identity.generate().peer_id for _ in range(5))
    holders = tuple(swarm.ProviderHolder(Identity.generate().peer_id, (7,)) for _ in range(10))
    record = swarm.ProvidersRecord(run_id=RUN, version=7, issued_at=time.time(), seeders=(*seeders, me),
                                   holders=holders)
    fetcher = SwarmFetcher(Node(me), run_id=RUN, coordinator_peer_id=COORD.peer_id, store=AdapterStore(),
                           providers=lambda: record)
    view = fetcher.view()
    named = set(seeders) | {h.peer_id for h in holders}
    for i in range(12):
        plan = fetcher.plan(7, i, view)
        assert plan[-1] == (COORD.peer_id, 0.0) and len(plan) <= MAX_PLAN_PEERS + 1
        assert {p for p, _ in plan[:-1]} <= named
    # every fetcher computes the same seeder for a chunk; the one named seeds from the coordinator itself
    all_seeders = tuple(sorted((*seeders, me)))
    for i in range(12):
        assert fetcher.seeder(7, i, view) == all_seeders[(i + 7) % len(all_seeders)]
        if fetcher.seeder(7, i, view) == me:
            assert [p for p, w in fetcher.plan(7, i, ProviderView(view.seeders, {}))] == [COORD.peer_id]
    assert SwarmFetcher(Node(me), run_id=RUN, coordinator_peer_id=COORD.peer_id, store=AdapterStore()).plan(
        7, 0, ProviderView.of(None, me)) == [(COORD.peer_id, 0.0)]  # nobody vouched for: a star


def test_peer_timeouts_are_short_and_adapt():
    clock = PeerClock(COORD.peer_id)
    assert clock.timeout("p", 1 << 20) == 5.0  # first contact
    for _ in range(5):
        clock.observe("p", 0.05, 1 << 20)  # a fast peer
    assert clock.timeout("p", 1 << 20) == 2.0  # the floor
    for _ in range(20):
        clock.observe("p", 30.0, 1 << 20)  # a tarpit-like one
    assert clock.timeout("p", 1 << 20) == 10.0  # the ceiling: seconds, never a minute
    assert clock.timeout(COORD.peer_id, 1 << 20) == 30.0  # the coordinator: behind a slow uplink, still bounded


def test_the_cache_keeps_the_newest_verified_record_and_refuses_forgeries():
    node = ScriptedSwarm()
    key = swarm.providers_key(RUN, COORD.peer_id)
    cache = ProvidersCache(node, RUN, COORD.peer_id, COORD.public_key)
    mallory = Identity.generate()
    node.stored[key] = swarm.seal_providers(mallory, swarm.ProvidersRecord(
        run_id=RUN, version=9, issued_at=time.time(), seeders=(mallory.peer_id,), holders=()))
    assert cache.refresh() is None and cache.errors == 1
    good = swarm.ProvidersRecord(run_id=RUN, version=2, issued_at=time.time(), seeders=(), holders=())
    node.stored[key] = swarm.seal_providers(COORD, good)
    cache.ensure(2)
    assert cache.record == good and cache.bytes_read > 0


def test_a_late_record_costs_a_bounded_number_of_reads_per_version():
    """The follower calls `ensure` again after every failed fetch; a DHT still holding the previous record
    must not turn each retry into more reads (bench/swarm_scale.py at N = 32: ~50 reads a minute)."""
    from asyncrl.swarm.providers import ENSURE_READS

    node = ScriptedSwarm()
    key = swarm.providers_key(RUN, COORD.peer_id)
    now = [100.0]
    cache = ProvidersCache(node, RUN, COORD.peer_id, COORD.public_key, max_age_s=10.0, clock=lambda: now[0])
    node.stored[key] = swarm.seal_providers(COORD, swarm.ProvidersRecord(
        run_id=RUN, version=4, issued_at=time.time(), seeders=(), holders=()))
    for _ in range(20):  # twenty failed fetches of v5 while the DHT still answers with v4's record
        cache.ensure(5, pause_s=0.0)
        cache.maybe_refresh()
    assert cache.reads == ENSURE_READS and cache.record.version == 4
    cache.ensure(6, pause_s=0.0)  # the next version has a budget of its own
    assert cache.reads == 2 * ENSURE_READS
    node.stored[key] = swarm.seal_providers(COORD, swarm.ProvidersRecord(
        run_id=RUN, version=6, issued_at=time.time() + 1, seeders=(), holders=()))
    cache.ensure(6, pause_s=0.0)
    assert cache.reads == 2 * ENSURE_READS and cache.record.version == 4  # budget spent: no read
    now[0] += 10.0
    cache.maybe_refresh()  # the periodic read picks the late record up
    assert cache.reads == 2 * ENSURE_READS + 1 and cache.record.version == 6
    cache.ensure(7, pause_s=0.0)
    cache.ensure(6, pause_s=0.0)  # an older version than the record: nothing to read
    assert cache.reads == 2 * ENSURE_READS + 1 + ENSURE_READS


class Reader:
    """A volunteer's view of the DHT the desk stored into."""

    def __init__(self, identity: Identity, stored: dict[str, bytes]):
        self.peer_id, self.stored = identity.peer_id, stored

    def get(self, key):
        return self.stored.get(key)


def _desk_with(n: int, node: ScriptedSwarm, records: dict) -> tuple[ProviderDesk, list[Identity]]:
    peers = [Identity.generate() for _ in range(n)]
    node.honest |= {p.peer_id for p in peers}
    records.update({p.peer_id: presence(p) for p in peers})
    desk = ProviderDesk(node, COORD, RUN, Tracker(records))
    while desk.status()["vouched"] < len(records):
        desk.probe_round()
    return desk, peers


def _shards(node: ScriptedSwarm) -> dict[int, swarm.ProvidersRecord]:
    out = {}
    for shard in range(swarm.MAX_PROVIDER_SHARDS):
        raw = node.stored.get(swarm.providers_key(RUN, COORD.peer_id, shard))
        if raw is not None:
            out[shard] = swarm.check_providers(raw, coordinator_key=COORD.public_key, run_id=RUN, shard=shard)
    return out


def test_the_record_is_sharded_so_no_value_grows_with_the_swarm():
    """issue 16: what a volunteer reads per refresh is O(1) in N — a constant number of seeders and one
    shard of at most HOLDERS_PER_SHARD holders — while every vouched holder is still named somewhere."""
    sizes = {}
    for n in (8, 32, 300):
        node = ScriptedSwarm()
        desk, peers = _desk_with(n, node, {})
        desk.on_publish(3)
        shards = _shards(node)
        want = max(1, -(-n // swarm.HOLDERS_PER_SHARD))
        assert sorted(shards) == list(range(want)) and all(r.shards == want for r in shards.values())
        assert len({r.seeders for r in shards.values()}) == 1  # every fetcher plans the same chunk -> seeder map
        assert len(shards[0].seeders) == min(n, swarm.SEEDERS_PER_VERSION)
        assert all(len(r.holders) <= swarm.HOLDERS_PER_SHARD for r in shards.values())
        assert {h.peer_id for r in shards.values() for h in r.holders} == {p.peer_id for p in peers}
        sizes[n] = max(len(node.stored[swarm.providers_key(RUN, COORD.peer_id, s)]) for s in shards)
        # A volunteer finds its shard: shard 0 first (it knows no count yet), then its own, then only its own.
        vol = peers[-1]
        cache = ProvidersCache(Reader(vol, node.stored), RUN, COORD.peer_id, COORD.public_key)
        cache.refresh()
        mine = swarm.providers_shard(vol.peer_id, want)
        assert cache.record.shard == mine and cache.reads == (1 if mine == 0 else 2)
        cache.refresh()
        assert cache.reads == (2 if mine == 0 else 3) and cache.record.shard == mine
    assert sizes[32] <= 1.2 * sizes[8] and sizes[300] <= 1.2 * sizes[8], sizes


def test_readers_of_a_shard_that_no_longer_exists_learn_the_new_count():
    node = ScriptedSwarm()
    records: dict = {}
    desk, peers = _desk_with(32, node, records)
    desk.on_publish(1)
    far = next(p for p in peers if swarm.providers_shard(p.peer_id, 4) == 3)
    cache = ProvidersCache(Reader(far, node.stored), RUN, COORD.peer_id, COORD.public_key)
    cache.refresh()
    assert cache.record.shard == 3 and cache.shards == 4
    for p in peers:  # the swarm shrinks to one volunteer
        if p is not far:
            del records[p.peer_id]
    desk.probe_round()
    time.sleep(0.01)
    desk.issue()
    assert _shards(node)[3].shards == 1  # shard 3 is re-issued for its readers, saying there is one shard now
    cache.refresh()
    assert cache.shards == 1 and cache.record.shard == 0
    assert {h.peer_id for h in cache.record.holders} == {far.peer_id}


def test_a_shard_record_is_valid_only_under_its_own_key():
    record = swarm.ProvidersRecord(run_id=RUN, version=1, issued_at=time.time(), seeders=(), holders=(),
                                   shard=1, shards=4)
    raw = swarm.seal_providers(COORD, record)
    assert swarm.check_providers(raw, coordinator_key=COORD.public_key, run_id=RUN, shard=1) == record
    for shard in (0, 2):  # a shard replayed under another shard's key
        try:
            swarm.check_providers(raw, coordinator_key=COORD.public_key, run_id=RUN, shard=shard)
        except ProtocolError as e:
            assert e.code == RejectCode.MALFORMED
        else:
            raise AssertionError("a shard record was accepted under another shard's key")
    for bad in ({"shard": 0, "shards": 0}, {"shard": 64, "shards": 64}, {"shard": 0, "shards": 65}):
        raw = swarm.seal_providers(COORD, swarm.ProvidersRecord(run_id=RUN, version=1, issued_at=time.time(),
                                                                seeders=(), holders=(), **bad))
        try:
            swarm.check_providers(raw, coordinator_key=COORD.public_key, run_id=RUN)
        except ProtocolError as e:
            assert e.code == RejectCode.MALFORMED
        else:
            raise AssertionError(f"shard fields {bad} were accepted")


class PresenceShards:
    """A node whose presence shards hold what `announce` put there; `fail` makes the next read raise (a
    get_many that timed out), `hide` leaves some peers' shards out of the next reads (lookups that failed)."""

    def __init__(self):
        self.shards: dict[str, dict[str, bytes]] = {}
        self.fail, self.hide = False, set()

    def announce(self, identity: Identity, last_seen: float | None = None) -> None:
        record = swarm.PresenceRecord(run_id=RUN, peer_id=identity.peer_id, name="x", adapter_version=0,
                                      versions=(0,), serving=True, upload_bps=0, throughput=0.0,
                                      last_seen=time.time() if last_seen is None else last_seen)
        key = swarm.presence_key(RUN, swarm.presence_shard(identity.peer_id))
        self.shards.setdefault(key, {})[identity.peer_id] = swarm.seal_presence(identity, record)

    def get_many(self, keys):
        if self.fail:
            raise TimeoutError("get_many timed out")
        hidden = {swarm.presence_key(RUN, swarm.presence_shard(p)) for p in self.hide}
        return {k: dict(self.shards[k]) for k in keys if k in self.shards and k not in hidden}


def test_a_missed_presence_read_does_not_unvouch_a_seeder_only_expiry_does():
    """Under a flood (or any load) a shard lookup can fail; the CI run of 2026-12-06 lost its seeders that way
    and sent one version 4x from the coordinator. A vouched peer must survive bad reads until its record's TTL."""
    from asyncrl.swarm.records import PresenceTracker

    alice, bob = Identity.generate(), Identity.generate()
    shards = PresenceShards()
    for who in (alice, bob):
        shards.announce(who)
    clock = [1000.0]
    tracker = PresenceTracker(shards, RUN, clock=lambda: clock[0])
    node = ScriptedSwarm(honest=[alice.peer_id, bob.peer_id])
    desk = ProviderDesk(node, COORD, RUN, tracker)
    tracker.refresh()
    desk.probe_round()
    assert desk.vouched(alice.peer_id) and desk.vouched(bob.peer_id)

    shards.fail = True  # the whole read failed
    clock[0] += 5
    tracker.refresh()
    shards.fail, shards.hide = False, {alice.peer_id}  # then alice's shard could not be looked up
    clock[0] += 5
    tracker.refresh()
    assert set(tracker.records()) == {alice.peer_id, bob.peer_id}
    desk.probe_round()
    desk.on_publish(1)
    assert desk.last_record.seeders == tuple(sorted([alice.peer_id, bob.peer_id]))

    shards.announce(bob)  # bob re-announces (a newer record); alice's stays unread past its TTL
    clock[0] = 1000.0 + swarm.PRESENCE_TTL_S - 1
    tracker.refresh()
    assert set(tracker.records()) == {alice.peer_id, bob.peer_id}  # alice: first read 29 s ago, still live
    clock[0] = 1000.0 + swarm.PRESENCE_TTL_S + 1
    tracker.refresh()
    assert set(tracker.records()) == {bob.peer_id}  # expired: only now forgotten
    desk.probe_round()
    desk.on_publish(2)
    assert desk.last_record.seeders == (bob.peer_id,)


def test_carried_presence_keeps_the_newest_record_and_the_per_shard_bound(monkeypatch):
    from asyncrl.swarm.records import carry_presence

    def record(ident, last_seen):
        return swarm.PresenceRecord(run_id=RUN, peer_id=ident.peer_id, name="x", adapter_version=0, versions=(0,),
                                    serving=True, upload_bps=0, throughput=0.0, last_seen=last_seen)

    alice = Identity.generate()
    held, stamps = carry_presence({}, {}, {alice.peer_id: record(alice, 50.0)}, now=0.0)
    held, stamps = carry_presence(held, stamps, {alice.peer_id: record(alice, 40.0)}, now=1.0)  # a lagging replica
    assert held[alice.peer_id].last_seen == 50.0 and stamps[alice.peer_id] == 0.0
    held, stamps = carry_presence(held, stamps, {alice.peer_id: record(alice, 58.0)}, now=8.0)
    assert stamps[alice.peer_id] == 8.0  # a new record restarts the carry clock
    held, stamps = carry_presence(held, stamps, {alice.peer_id: record(alice, 58.0)}, now=30.0)
    assert stamps[alice.peer_id] == 8.0  # the same record read again does not

    monkeypatch.setattr(swarm, "MAX_RECORDS_PER_SHARD", 2)
    same: list[Identity] = []
    while len(same) < 3:  # three peers of one shard
        ident = Identity.generate()
        if swarm.presence_shard(ident.peer_id) == swarm.presence_shard(alice.peer_id):
            same.append(ident)
    held, stamps = carry_presence(held, stamps, {same[0].peer_id: record(same[0], 60.0),
                                                 same[1].peer_id: record(same[1], 60.0)}, now=9.0)
    assert set(held) == {same[0].peer_id, same[1].peer_id}  # the shard is full with what was just read
    held, stamps = carry_presence(held, stamps, {same[2].peer_id: record(same[2], 61.0)}, now=10.0)
    assert len(held) == 2 and same[2].peer_id in held


class ServingSwarm(ScriptedSwarm):
    """Peers that pass the probe (a refusal in our framing) and then serve a version's chunks as scripted:
    `serve` answer with the coordinator's bytes, `quick` refuse at once, `slow` hold the long poll to its end
    and then refuse, `bad` answer other bytes, `tarpit` answer the probe and never a chunk request."""

    def __init__(self, chunks, **kinds):
        super().__init__(honest=[p for ps in kinds.values() for p in ps])
        self.chunks, self.kinds = chunks, {p: k for k, ps in kinds.items() for p in ps}
        self.asked: list[tuple[str, int, float]] = []  # (peer, chunk index, long poll s) of service checks

    async def acall(self, peer, name, request, *, max_response_bytes):
        version, index, wait_ms = struct.unpack(">QII", request) if len(request) == 16 else (None, None, 0)
        if version is None or version == providers_mod.PROBE_VERSION:
            return await super().acall(peer, name, request, max_response_bytes=max_response_bytes)
        self.asked.append((peer, index, wait_ms / 1000))
        kind = self.kinds[peer]
        if kind == "serve":
            return self.chunks[index]
        if kind == "bad":
            return b"x" + self.chunks[index][1:]
        if kind == "slow":
            await asyncio.sleep(wait_ms / 1000)
        if kind == "tarpit":
            await asyncio.sleep(3600)
        raise ProtocolError(RejectCode.STALE_VERSION, "chunk not held")


class Published:
    def __init__(self, chunks):
        self.chunks = chunks


class Source:
    def __init__(self, chunks):
        self.chunks = chunks

    def get(self, version):
        return Published(self.chunks)


def test_seeders_are_chosen_and_dropped_on_measured_service(monkeypatch):
    monkeypatch.setattr(seeder_service, "SERVICE_WAIT_S", 0.4)
    monkeypatch.setattr(seeder_service, "SERVICE_GRACE_S", 0.4)
    now = [1000.0]
    alice, bob, carol, quick, slow, bad, tarpit, dave = (Identity.generate() for _ in range(8))
    chunks = [bytes([i]) * 100 for i in range(3)]
    node = ServingSwarm(chunks, serve=[alice.peer_id, bob.peer_id, carol.peer_id, dave.peer_id],
                        quick=[quick.peer_id], slow=[slow.peer_id], bad=[bad.peer_id], tarpit=[tarpit.peer_id])
    records = {i.peer_id: presence(i, versions=(0,)) for i in (alice, bob, carol, quick, slow, bad, tarpit)}
    desk = ProviderDesk(node, COORD, RUN, Tracker(records), proven=lambda p: p in (alice.peer_id, bob.peer_id),
                        source=Source(chunks), clock=lambda: now[0])
    desk.probe_round()
    everyone = {i.peer_id for i in (alice, bob, carol, quick, slow, bad, tarpit)}
    desk.on_publish(1)
    assert set(desk.last_record.seeders) == everyone  # fewer proven volunteers than slots: unproven ones fill them
    found = desk.check_service()
    assert found == {alice.peer_id: "served", bob.peer_id: "served", carol.peer_id: "served", quick.peer_id: "quick",
                     slow.peer_id: "slow", bad.peer_id: "bad", tarpit.peer_id: "failed"}
    # each was long-polled for a chunk fetchers are assigned to it: seeders[(i + v) % n]
    seeders = sorted(everyone)
    assert {(p, i) for p, i, _ in node.asked} == {(p, ((pos - 1) % len(seeders)) % len(chunks))
                                                  for pos, p in enumerate(seeders)}
    assert {w for _, _, w in node.asked} == {0.4}
    # dropped at once from this version's record; a single slow answer is only a miss
    assert set(desk.last_record.seeders) == {alice.peer_id, bob.peer_id, carol.peer_id, slow.peer_id}
    assert desk.check_service() == {}  # once per version
    desk.on_publish(2)
    assert set(desk.last_record.seeders) == {alice.peer_id, bob.peer_id, carol.peer_id, slow.peer_id}
    assert desk.check_service()[slow.peer_id] == "slow"  # a second miss in a row: dropped
    assert set(desk.last_record.seeders) == {alice.peer_id, bob.peer_id, carol.peer_id}
    named = set(desk.last_record.seeders) | {h.peer_id for h in desk.last_record.holders} | set(desk.push_targets())
    assert named.isdisjoint({quick.peer_id, slow.peer_id, bad.peer_id, tarpit.peer_id})  # in no record at all
    assert desk.status()["seeders_dropped"] == 4
    # after the back-off they may seed again; dropped again, they wait twice as long
    now[0] += seeder_service.SERVICE_BACKOFF_S + 1
    desk.on_publish(3)
    assert quick.peer_id in desk.last_record.seeders
    assert desk.check_service()[quick.peer_id] == "quick"
    now[0] += seeder_service.SERVICE_BACKOFF_S + 1
    desk.on_publish(4)
    assert quick.peer_id not in desk.last_record.seeders
    now[0] += seeder_service.SERVICE_BACKOFF_S
    desk.on_publish(5)
    assert quick.peer_id in desk.last_record.seeders


def test_a_seeder_that_missed_gives_its_slot_to_one_not_measured_yet(monkeypatch):
    monkeypatch.setattr(seeder_service, "SERVICE_WAIT_S", 0.4)
    monkeypatch.setattr(swarm, "SEEDERS_PER_VERSION", 1)
    carol, dave = sorted((Identity.generate() for _ in range(2)), key=lambda i: i.peer_id, reverse=True)
    chunks = [b"c" * 100]
    node = ServingSwarm(chunks, serve=[carol.peer_id], slow=[dave.peer_id])
    desk = ProviderDesk(node, COORD, RUN, Tracker({i.peer_id: presence(i, versions=(0,)) for i in (carol, dave)}),
                        source=Source(chunks))
    desk.probe_round()  # both vouched in the same round: the lower peer id (dave's) comes first
    desk.on_publish(1)
    assert desk.last_record.seeders == (dave.peer_id,)
    assert desk.check_service() == {dave.peer_id: "slow"}  # a miss: still vouched, ranked last
    desk.on_publish(2)
    assert desk.last_record.seeders == (carol.peer_id,)
    assert desk.check_service() == {carol.peer_id: "served"}
    desk.on_publish(3)
    assert desk.last_record.seeders == (carol.peer_id,)


def test_a_proven_seeder_that_does_not_answer_misses_before_it_is_dropped(monkeypatch):
    """A volunteer with accepted batches may be reconnecting (after a coordinator restart, every one is): one
    check without an answer is a miss; two in a row drop it, as they drop an unproven tarpit at once."""
    monkeypatch.setattr(seeder_service, "SERVICE_WAIT_S", 0.2)
    monkeypatch.setattr(seeder_service, "SERVICE_GRACE_S", 0.2)
    alice, tarpit = Identity.generate(), Identity.generate()
    chunks = [b"c" * 100]
    node = ServingSwarm(chunks, tarpit=[alice.peer_id, tarpit.peer_id])
    desk = ProviderDesk(node, COORD, RUN, Tracker({i.peer_id: presence(i) for i in (alice, tarpit)}),
                        proven=lambda p: p == alice.peer_id, source=Source(chunks))
    desk.probe_round()
    desk.on_publish(1)
    assert desk.check_service() == {alice.peer_id: "failed", tarpit.peer_id: "failed"}
    assert desk.last_record.seeders == (alice.peer_id,)
    desk.on_publish(2)
    assert desk.check_service() == {alice.peer_id: "failed"}
    assert desk.last_record.seeders == ()
