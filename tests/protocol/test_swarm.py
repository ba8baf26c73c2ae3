"""protocol/swarm.py: who may write pointer and presence records, and which pointer is newer."""

from __future__ import annotations

import time

import pytest

from asyncrl.protocol import envelope, messages, swarm
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity

COORD = Identity.from_seed(bytes(range(32)))
MALLORY = Identity.from_seed(bytes(range(1, 33)))
ALICE = Identity.from_seed(bytes(range(2, 34)))
NOW = 1_800_000_000.0


def pointer(version=3, *, published_at=NOW, sha=b"\x01" * 32, run="r") -> messages.AdapterPointer:
    return messages.AdapterPointer(run_id=run, version=version, manifest_sha256=sha, keyframe_version=0,
                                   published_at=published_at)


def sealed_pointer(identity=COORD, *, at=NOW, **kw) -> bytes:
    return envelope.seal(identity, swarm.POINTER_KIND, messages.encode(pointer(**kw)), now=at)


def check(value, **kw):
    return swarm.check_pointer(value, coordinator_key=COORD.public_key, run_id="r", now=NOW, **kw)


def test_pointer_signed_by_the_coordinator_is_accepted():
    p, ts = check(sealed_pointer(), expiration_time=NOW + swarm.POINTER_TTL_S)
    assert (p.version, ts) == (3, NOW)


@pytest.mark.parametrize("value, code", [
    (sealed_pointer(MALLORY), RejectCode.NOT_ALLOWED),
    (sealed_pointer(run="other"), RejectCode.WRONG_RUN),
    (sealed_pointer(at=NOW + 3600), RejectCode.EXPIRED),  # signed in the future
    (envelope.seal(COORD, "adapter_manifest", messages.encode(pointer()), now=NOW), RejectCode.MALFORMED),
    (b"\x00" * 10, RejectCode.MALFORMED),
])
def test_other_pointers_are_refused(value, code):
    with pytest.raises(ProtocolError) as exc:
        check(value)
    assert exc.value.code == code


def test_a_replayed_pointer_cannot_outlive_its_signed_timestamp():
    old = sealed_pointer(at=NOW - 3600)
    check(old, expiration_time=NOW - 3600 + swarm.POINTER_TTL_S)  # as it was stored: fine
    with pytest.raises(ProtocolError) as exc:  # re-stored by someone with a far-future expiration
        check(old, expiration_time=NOW + 10 * swarm.POINTER_TTL_S)
    assert exc.value.code == RejectCode.EXPIRED


def test_reseal_keeps_the_payload_under_a_fresh_timestamp():
    old = sealed_pointer(at=time.time() - 3600)
    new = swarm.reseal_pointer(COORD, old)
    p_old, ts_old = swarm.check_pointer(old, coordinator_key=COORD.public_key, run_id="r")
    p_new, ts_new = swarm.check_pointer(new, coordinator_key=COORD.public_key, run_id="r")
    assert p_old == p_new and ts_new > ts_old + 3000


def test_which_pointer_is_newer():
    held = pointer(5, published_at=NOW)
    assert swarm.pointer_is_newer(held, None)
    assert not swarm.pointer_is_newer(pointer(5, published_at=NOW + 9), held)  # same manifest: a refresh
    assert swarm.pointer_is_newer(pointer(6, published_at=NOW + 1, sha=b"\x02" * 32), held)
    # a restarted coordinator without its checkpoint: numbered lower, published later -> followed
    assert swarm.pointer_is_newer(pointer(0, published_at=NOW + 60, sha=b"\x03" * 32), held)
    # a replayed old pointer: published earlier -> never
    assert not swarm.pointer_is_newer(pointer(4, published_at=NOW - 1, sha=b"\x04" * 32), held)


def presence(identity=ALICE, **kw) -> swarm.PresenceRecord:
    fields = dict(run_id="r", peer_id=identity.peer_id, name="alice", adapter_version=3, versions=(2, 3),
                  serving=True, upload_bps=0, throughput=1.5, last_seen=NOW, maddrs=("/ip4/127.0.0.1/tcp/1",))
    fields.update(kw)
    return swarm.PresenceRecord(**fields)


def check_presence(value, subkey=ALICE.peer_id, **kw):
    return swarm.check_presence(value, subkey=subkey, run_id="r", now=NOW, **kw)


def test_presence_signed_by_the_peer_it_names_is_accepted():
    record = check_presence(envelope.seal(ALICE, swarm.PRESENCE_KIND, messages.encode(presence()), now=NOW),
                            expiration_time=NOW + swarm.PRESENCE_TTL_S)
    assert record.versions == (2, 3) and record.maddrs == ("/ip4/127.0.0.1/tcp/1",)


def test_presence_for_someone_else_is_refused():
    forged = envelope.seal(MALLORY, swarm.PRESENCE_KIND, messages.encode(presence()), now=NOW)
    with pytest.raises(ProtocolError) as exc:  # mallory writes under alice's subkey
        check_presence(forged)
    assert exc.value.code == RejectCode.NOT_ALLOWED
    claims_alice = envelope.seal(MALLORY, swarm.PRESENCE_KIND, messages.encode(presence(peer_id=ALICE.peer_id)),
                                 now=NOW)
    with pytest.raises(ProtocolError) as exc:  # under its own subkey, but describing alice
        check_presence(claims_alice, subkey=MALLORY.peer_id)
    assert exc.value.code == RejectCode.NOT_ALLOWED
    with pytest.raises(ProtocolError) as exc:
        check_presence(forged, subkey="not-a-peer-id")
    assert exc.value.code == RejectCode.MALFORMED
    with pytest.raises(ValueError):
        swarm.seal_presence(MALLORY, presence())


@pytest.mark.parametrize("bad, code", [
    (dict(run_id="other"), RejectCode.WRONG_RUN),
    (dict(versions=(-1,)), RejectCode.MALFORMED),
    (dict(adapter_version=-5), RejectCode.MALFORMED),
    (dict(throughput=float("nan")), RejectCode.MALFORMED),
    (dict(upload_bps=-1), RejectCode.MALFORMED),
])
def test_malformed_presence_is_refused(bad, code):
    value = envelope.seal(ALICE, swarm.PRESENCE_KIND, messages.encode(presence(**bad)), now=NOW)
    with pytest.raises(ProtocolError) as exc:
        check_presence(value)
    assert exc.value.code == code


def test_presence_expiration_is_bounded_by_its_signed_timestamp():
    value = swarm.seal_presence(ALICE, presence())
    with pytest.raises(ProtocolError) as exc:
        swarm.check_presence(value, subkey=ALICE.peer_id, run_id="r",
                             expiration_time=time.time() + 100 * swarm.PRESENCE_TTL_S)
    assert exc.value.code == RejectCode.EXPIRED


# ---- shards and the providers record -----------------------------------------------------------------


def test_presence_shards_spread_peers_and_keys_stay_apart():
    peers = [Identity.generate().peer_id for _ in range(2000)]
    counts = [0] * swarm.PRESENCE_SHARDS
    for p in peers:
        counts[swarm.presence_shard(p)] += 1
    assert max(counts) < 3 * 2000 / swarm.PRESENCE_SHARDS  # no shard grows with N much faster than N / shards
    assert len({swarm.presence_key("r", s) for s in range(swarm.PRESENCE_SHARDS)}) == swarm.PRESENCE_SHARDS
    with pytest.raises(ValueError):
        swarm.presence_key("r", swarm.PRESENCE_SHARDS)


def test_presence_in_another_shard_is_refused():
    value = envelope.seal(ALICE, swarm.PRESENCE_KIND, messages.encode(presence()), now=NOW)
    mine = swarm.presence_shard(ALICE.peer_id)
    assert check_presence(value, shard=mine).peer_id == ALICE.peer_id
    with pytest.raises(ProtocolError) as e:
        check_presence(value, shard=(mine + 1) % swarm.PRESENCE_SHARDS)
    assert e.value.code == RejectCode.NOT_ALLOWED


def providers(**kw) -> swarm.ProvidersRecord:
    fields = dict(run_id="r", version=3, issued_at=NOW, seeders=(ALICE.peer_id,),
                  holders=(swarm.ProviderHolder(ALICE.peer_id, (1, 2, 3)),))
    fields.update(kw)
    return swarm.ProvidersRecord(**fields)


def test_providers_signed_by_the_coordinator_are_accepted_and_nobody_elses():
    got = swarm.check_providers(swarm.seal_providers(COORD, providers()), coordinator_key=COORD.public_key,
                                run_id="r", now=NOW)
    assert got.seeders == (ALICE.peer_id,) and got.holders[0].versions == (1, 2, 3)
    for sealed, code in ((swarm.seal_providers(MALLORY, providers()), RejectCode.NOT_ALLOWED),
                         (swarm.seal_providers(COORD, providers(run_id="other")), RejectCode.WRONG_RUN),
                         (swarm.seal_providers(COORD, providers(seeders=("not-a-peer-id",))), RejectCode.MALFORMED),
                         (swarm.seal_providers(COORD, providers(holders=(swarm.ProviderHolder(ALICE.peer_id, (-1,)),))),
                          RejectCode.MALFORMED)):
        with pytest.raises(ProtocolError) as e:
            swarm.check_providers(sealed, coordinator_key=COORD.public_key, run_id="r", now=NOW)
        assert e.value.code == code


def test_the_providers_record_is_capped():
    many = tuple(Identity.generate().peer_id for _ in range(swarm.MAX_SEEDERS + 1))
    sealed = swarm.seal_providers(COORD, providers(seeders=many))
    with pytest.raises(ProtocolError) as e:
        swarm.check_providers(sealed, coordinator_key=COORD.public_key, run_id="r", now=NOW)
    assert e.value.code == RejectCode.MALFORMED
    full = providers(seeders=many[:swarm.MAX_SEEDERS],
                     holders=tuple(swarm.ProviderHolder(p, tuple(range(swarm.MAX_HOLDER_VERSIONS)))
                                   for p in many[:swarm.MAX_HOLDERS]))
    assert len(swarm.seal_providers(COORD, full)) <= swarm.MAX_PROVIDERS_BYTES  # the largest legal record fits
