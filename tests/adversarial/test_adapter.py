"""mallory vs the policy path: a fake adapter pointer in the DHT, and a seeder that serves corrupted chunks.

Volunteers trust only the key in their join address: a pointer or manifest signed by anyone else is
refused (NOT_ALLOWED), a chunk that fails its sha256 in the signed manifest is refused (HASH_MISMATCH)
and its provider avoided, and alice and bob keep following the real adapter meanwhile.
"""

from __future__ import annotations

import hashlib
import time

import pytest

from asyncrl.protocol import envelope, limits, messages
from asyncrl.protocol import swarm as swarm_proto
from asyncrl.protocol.errors import ProtocolError
from asyncrl.protocol.identity import Identity
from asyncrl.swarm.streams import stream_name

from tests.adversarial.swarm import RUN_ID, refresh, wait_for

pytestmark = pytest.mark.integration


def versions_loaded(swarm) -> dict[str, int]:
    return {name: v["versions_loaded"] for name, v in swarm.honest_view().items()}


def honest_keep_following(swarm, before: dict[str, int], more: int = 2, timeout: float = 180.0) -> None:
    wait_for(lambda: all(versions_loaded(swarm)[n] >= before[n] + more for n in before), timeout,
             "alice and bob to keep loading new adapter versions")


def test_fake_adapter_pointer(mallory, swarm, attack):
    rec = attack("fake adapter pointer", "a pointer (and manifest) for version +1000 signed by mallory, stored "
                                         "under the run's DHT key")
    before = versions_loaded(swarm)
    key = swarm_proto.pointer_key(RUN_ID, swarm.coordinator_peer)
    manifest_env = envelope.seal(mallory.identity, "adapter_manifest", b"\x80")
    pointer = messages.AdapterPointer(run_id=RUN_ID, version=mallory.sync.current.version + 1000,
                                      manifest_sha256=hashlib.sha256(manifest_env).digest(),
                                      keyframe_version=0, published_at=time.time() + 1)
    fake = envelope.seal(mallory.identity, swarm_proto.POINTER_KIND, messages.encode(pointer))
    mallory.node.store(key, fake, swarm_proto.POINTER_TTL_S)  # honest DHT nodes refuse to keep it
    # a newcomer with the volunteers' DHT record validator reads the coordinator's pointer, not hers ...
    from asyncrl.swarm.records import install_validator

    victim = mallory.new_node()
    install_validator(victim, RUN_ID, swarm.coordinator_peer)
    raw = wait_for(lambda: victim.get(key), 60, "the pointer as an honest newcomer sees it")
    got, _ = swarm_proto.check_pointer(raw, coordinator_key=swarm.coordinator_key, run_id=RUN_ID)
    assert got.version < pointer.version
    # ... and the forged one itself is refused outright, as is the forged manifest
    for sealed, check in ((fake, lambda b: swarm_proto.check_pointer(b, coordinator_key=swarm.coordinator_key,
                                                                     run_id=RUN_ID)),
                          (manifest_env, lambda b: envelope.open_envelope(
                              b, max_bytes=limits.MAX_MANIFEST_BYTES, expected_kind="adapter_manifest",
                              expected_audience=envelope.BROADCAST, expected_signer=swarm.coordinator_key,
                              window_s=None))):
        with pytest.raises(ProtocolError) as e:
            check(sealed)
        rec.saw(e.value.code.value)
        assert e.value.code.value == "NOT_ALLOWED"
    honest_keep_following(swarm, before)


def test_corrupted_adapter_chunk(mallory, swarm, attack):
    rec = attack("corrupted adapter chunk", "a seeder announcing every version and serving chunks with a flipped "
                                            "bit, to alice, bob and a victim follower")
    from asyncrl.client.adapter_sync import AdapterSync
    from asyncrl.swarm.fetch import SwarmFetcher
    from asyncrl.swarm.records import PresenceBeacon
    from asyncrl.swarm.serving import AdapterServer, AdapterStore
    from asyncrl.swarm.transport import SwarmNode

    class TamperingServer(AdapterServer):
        def outgoing_chunk(self, version: int, index: int, data: bytes) -> bytes:
            return bytes([data[0] ^ 1]) + data[1:] if data else data

    seeder_id = Identity.generate()
    path = swarm.root / "mallory-seeder.identity"
    seeder_id.write_libp2p_identity(path)
    seeder = SwarmNode(initial_peers=[swarm.join], identity_path=str(path))
    mallory.extra_nodes.append(seeder)
    sync = AdapterSync(seeder, coordinator_peer_id=swarm.coordinator_peer, coordinator_key=swarm.coordinator_key,
                       run_id=RUN_ID)
    wait_for(lambda: refresh(sync) or sync.current, 120, "the seeder's first adapter")
    sync.serve(server_cls=TamperingServer)
    sync.start_following(poll_s=0.2)  # holds every new version at once, to serve it corrupted
    beacon = PresenceBeacon(seeder, seeder_id, RUN_ID, "mallory-seeder", lambda: {
        "adapter_version": sync.current.version, "versions": sync.versions_served(), "serving": True}, every_s=1.0)
    beacon.start()
    before = versions_loaded(swarm)
    try:
        # a victim follower that finds only mallory in the presence records
        version = sync.current.version
        raw = mallory.node.call(swarm.coordinator_peer, stream_name(RUN_ID, "manifest"), version.to_bytes(8, "big"),
                                max_response_bytes=limits.MAX_MANIFEST_BYTES)
        manifest = messages.decode_manifest(envelope.open_envelope(
            raw, max_bytes=limits.MAX_MANIFEST_BYTES, expected_kind="adapter_manifest",
            expected_audience=envelope.BROADCAST, expected_signer=swarm.coordinator_key, window_s=None).payload)
        # as if the coordinator had vouched for her (she answers probes like any honest server does)
        record = swarm_proto.ProvidersRecord(run_id=RUN_ID, version=version, issued_at=time.time(), seeders=(),
                                             holders=(swarm_proto.ProviderHolder(seeder.peer_id, (version,)),))
        victim = SwarmFetcher(mallory.node, run_id=RUN_ID, coordinator_peer_id=swarm.coordinator_peer,
                              store=AdapterStore(), providers=lambda: record)
        payload = victim.payload(manifest, raw)
        assert victim.stats.hash_mismatches >= 1 and seeder.peer_id in victim.banned
        for _ in range(victim.stats.hash_mismatches):
            rec.saw("HASH_MISMATCH")
        assert hashlib.sha256(payload).digest() == hashlib.sha256(b"".join(
            victim.store.get(version).chunks)).digest() and len(payload) == manifest.compressed_bytes
        honest_keep_following(swarm, before)  # alice and bob ask her too, ban her, and carry on
    finally:
        beacon.stop()
        sync.stop()
    served = sync.server.stats.chunks_sent if sync.server is not None else 0
    rec.note = f"{served} corrupted chunks served in all; every one refused"
