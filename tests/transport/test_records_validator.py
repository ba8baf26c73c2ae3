"""SwarmRecordValidator: the check every DHT node runs on pointer, providers and presence records (no network:
records are built the way hivemind hands them to a validator — hashed key, msgpack-serialized value)."""

from __future__ import annotations

import time

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from asyncrl.protocol import envelope, messages, swarm
from asyncrl.protocol.identity import Identity
from asyncrl.swarm.records import SwarmRecordValidator

COORD = Identity.from_seed(bytes(range(32)))
MALLORY = Identity.from_seed(bytes(range(1, 33)))
ALICE = Identity.from_seed(bytes(range(2, 34)))
REGULAR = MSGPackSerializer.dumps(None)


def record(key: str, value: bytes, *, subkey=None, ttl: float = 60.0) -> DHTRecord:
    return DHTRecord(key=DHTID.generate(source=key).to_bytes(),
                     subkey=REGULAR if subkey is None else MSGPackSerializer.dumps(subkey),
                     value=MSGPackSerializer.dumps(value), expiration_time=time.time() + ttl)


def pointer(identity: Identity, version: int = 1) -> bytes:
    p = messages.AdapterPointer(run_id="r", version=version, manifest_sha256=b"\x01" * 32, keyframe_version=0,
                                published_at=time.time())
    return envelope.seal(identity, swarm.POINTER_KIND, messages.encode(p))


def presence(identity: Identity, peer_id: str | None = None) -> bytes:
    p = swarm.PresenceRecord(run_id="r", peer_id=peer_id or identity.peer_id, name="x", adapter_version=1,
                             versions=(1,), serving=True, upload_bps=0, throughput=0.0, last_seen=time.time())
    return envelope.seal(identity, swarm.PRESENCE_KIND, messages.encode(p))


def providers(identity: Identity, seeders=()) -> bytes:
    p = swarm.ProvidersRecord(run_id="r", version=1, issued_at=time.time(), seeders=tuple(seeders), holders=())
    return swarm.seal_providers(identity, p)


V = SwarmRecordValidator("r", COORD.peer_id)
POINTER_KEY = swarm.pointer_key("r", COORD.peer_id)
PROVIDERS_KEY = swarm.providers_key("r", COORD.peer_id)
PRESENCE_KEY = swarm.presence_key("r", swarm.presence_shard(ALICE.peer_id))


def test_only_the_coordinator_writes_its_pointer():
    assert V.validate(record(POINTER_KEY, pointer(COORD)))
    assert not V.validate(record(POINTER_KEY, pointer(MALLORY, version=999)))
    assert not V.validate(record(POINTER_KEY, b"garbage"))
    assert not V.validate(record(POINTER_KEY, pointer(COORD), subkey="x"))  # the pointer is a plain value
    assert not V.validate(record(POINTER_KEY, pointer(COORD), ttl=100 * swarm.POINTER_TTL_S))  # replay + long expiry
    # Mallory's own pointer key is not ours to police (and no asyncrl node reads it).
    assert V.validate(record(swarm.pointer_key("r", MALLORY.peer_id), pointer(MALLORY)))


def test_presence_is_written_only_by_the_peer_it_names():
    assert V.validate(record(PRESENCE_KEY, presence(ALICE), subkey=ALICE.peer_id))
    assert not V.validate(record(PRESENCE_KEY, presence(MALLORY, ALICE.peer_id), subkey=ALICE.peer_id))
    assert not V.validate(record(PRESENCE_KEY, presence(MALLORY), subkey=ALICE.peer_id))
    assert not V.validate(record(PRESENCE_KEY, presence(ALICE)))  # a plain value would replace the dictionary
    assert not V.validate(record(PRESENCE_KEY, presence(ALICE), subkey=7))


def test_presence_lives_only_in_its_peers_shard():
    other = swarm.presence_key("r", (swarm.presence_shard(ALICE.peer_id) + 1) % swarm.PRESENCE_SHARDS)
    assert not V.validate(record(other, presence(ALICE), subkey=ALICE.peer_id))


def test_only_the_coordinator_writes_the_providers_record():
    assert V.validate(record(PROVIDERS_KEY, providers(COORD, [ALICE.peer_id])))
    assert not V.validate(record(PROVIDERS_KEY, providers(MALLORY, [MALLORY.peer_id])))  # "trust me"
    assert not V.validate(record(PROVIDERS_KEY, providers(COORD), subkey="x"))
    assert not V.validate(record(PROVIDERS_KEY, providers(COORD), ttl=100 * swarm.PROVIDERS_TTL_S))


def test_unrelated_keys_pass_untouched():
    assert V.validate(record("some/other/key", b"anything"))


def test_two_validators_for_the_same_run_merge():
    assert V.merge_with(SwarmRecordValidator("r", COORD.peer_id))
    assert not V.merge_with(SwarmRecordValidator("other", COORD.peer_id))


def test_providers_shards_are_the_coordinators_and_each_lives_under_its_own_key():
    def shard_record(identity: Identity, shard: int) -> bytes:
        return swarm.seal_providers(identity, swarm.ProvidersRecord(
            run_id="r", version=1, issued_at=time.time(), seeders=(), holders=(), shard=shard, shards=4))

    key2 = swarm.providers_key("r", COORD.peer_id, 2)
    assert V.validate(record(key2, shard_record(COORD, 2)))
    assert not V.validate(record(key2, shard_record(COORD, 1)))  # shard 1's record replayed under shard 2's key
    assert not V.validate(record(key2, shard_record(MALLORY, 2)))
    assert not V.validate(record(PROVIDERS_KEY, shard_record(COORD, 2)))
