"""A volunteer's AdapterSync trusts only the key in its join address.

It refuses pointers and manifests signed by anyone else, manifests that differ from the signed pointer,
chunks that fail their signed sha256, and never goes back to an older version when an old (genuine)
pointer is replayed. The publisher is the real coordinator one; the network is replaced at its seam by
`ScriptedNode` (what the DHT returns) and `ScriptedFetcher` (what peers serve) — small named fakes.
The same attacks over the real swarm: tests/adversarial/test_adapter.py.
"""

from __future__ import annotations

import os

import pytest

from asyncrl.client.adapter_sync import AdapterSync
from asyncrl.coordinator.publisher import Publisher
from asyncrl.protocol import codec, envelope, messages, swarm
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity

COORDINATOR = Identity.from_seed(bytes(range(32)))
MALLORY = Identity.from_seed(bytes(range(3, 35)))
RUN = "trust"
SPECS = [messages.TensorSpec("a.lora_A.weight", "bf16", (8, 32)), messages.TensorSpec("a.lora_B.weight", "bf16", (32, 8))]
LORA = messages.LoraSpec(r=8, alpha=16.0, dropout=0.0, target_modules=("a",))


class ScriptedNode:
    """The DHT as the volunteer sees it: `get(key)` returns whatever the test put there."""

    def __init__(self):
        self.peer_id = "volunteer"
        self.values: dict[str, bytes] = {}

    def get(self, key: str):
        return self.values.get(key)


class ScriptedFetcher:
    """Serves manifests and payloads the way the swarm would: from a dict the test controls."""

    def __init__(self):
        self.manifests: dict[int, bytes] = {}
        self.payloads: dict[int, bytes] = {}

    def manifest(self, version, verify, *, peers=True):
        raw = self.manifests[version]
        return raw, verify(raw)

    def payload(self, manifest, manifest_bytes):
        return self.payloads[manifest.version]


@pytest.fixture
def published():
    pub = Publisher(COORDINATOR, run_id=RUN, base_model="m", base_revision="r", lora=LORA, keyframe_every=10,
                    chunk_bytes=4096)
    return [pub.publish(v, SPECS, {s.name: os.urandom(s.nbytes) for s in SPECS}) for v in range(3)]


@pytest.fixture
def sync():
    node = ScriptedNode()
    s = AdapterSync(node, coordinator_peer_id=COORDINATOR.peer_id, coordinator_key=COORDINATOR.public_key, run_id=RUN)
    s.fetcher = ScriptedFetcher()
    return s


def serve(sync, pubs, pointer_of):
    sync.node.values[swarm.pointer_key(RUN, COORDINATOR.peer_id)] = pointer_of.pointer_bytes
    for p in pubs:
        sync.fetcher.manifests[p.version] = p.manifest_bytes
        sync.fetcher.payloads[p.version] = b"".join(p.chunks)


def code_of(fn, *a) -> RejectCode:
    with pytest.raises(ProtocolError) as e:
        fn(*a)
    return e.value.code


def test_genuine_adapter_is_followed(sync, published):
    serve(sync, published, published[2])
    got = sync.refresh()
    assert got.version == 2 and sorted(got.tensors) == sorted(s.name for s in SPECS)


def test_pointer_signed_by_another_key_is_refused(sync, published):
    opened = envelope.open_envelope(published[2].pointer_bytes, max_bytes=4096, expected_kind="adapter_pointer",
                                    expected_audience=envelope.BROADCAST, window_s=None)
    forged = envelope.seal(MALLORY, "adapter_pointer", opened.payload)  # same content, mallory's signature
    serve(sync, published, published[2])
    sync.node.values[swarm.pointer_key(RUN, COORDINATOR.peer_id)] = forged
    assert code_of(sync.refresh) is RejectCode.NOT_ALLOWED and sync.current is None


def test_manifest_not_signed_by_the_coordinator_is_refused(sync, published):
    serve(sync, published, published[2])
    opened = envelope.open_envelope(published[2].manifest_bytes, max_bytes=1 << 20, expected_kind="adapter_manifest",
                                    expected_audience=envelope.BROADCAST, window_s=None)
    resealed = envelope.seal(MALLORY, "adapter_manifest", opened.payload)
    sync.fetcher.manifests[2] = resealed
    assert code_of(sync.refresh) is RejectCode.HASH_MISMATCH  # not the manifest the signed pointer names
    assert code_of(sync._manifest, 2) is RejectCode.NOT_ALLOWED  # nor signed by the coordinator at all
    assert sync.current is None


def test_chunk_failing_its_hash_is_refused(published):
    pub = published[0]
    manifest = messages.decode_manifest(envelope.open_envelope(
        pub.manifest_bytes, max_bytes=1 << 20, expected_kind="adapter_manifest", expected_audience=envelope.BROADCAST,
        expected_signer=COORDINATOR.public_key, window_s=None).payload)
    codec.verify_chunk(pub.chunks[0], manifest.chunk_hashes[0])
    bad = bytes([pub.chunks[0][0] ^ 1]) + pub.chunks[0][1:]
    assert code_of(codec.verify_chunk, bad, manifest.chunk_hashes[0]) is RejectCode.HASH_MISMATCH


def test_versions_never_go_backwards(sync, published):
    serve(sync, published, published[2])
    assert sync.refresh().version == 2
    serve(sync, published, published[1])  # a genuine but older pointer, replayed into the DHT
    assert sync.refresh() is None and sync.current.version == 2


def test_pointer_with_stretched_expiration_is_refused(published):
    pointer_bytes = published[2].pointer_bytes
    signed_at = envelope.open_envelope(pointer_bytes, max_bytes=4096, expected_kind="adapter_pointer",
                                       expected_audience=envelope.BROADCAST, window_s=None).timestamp
    swarm.check_pointer(pointer_bytes, coordinator_key=COORDINATOR.public_key, run_id=RUN,
                        expiration_time=signed_at + swarm.POINTER_TTL_S)
    assert code_of(lambda: swarm.check_pointer(pointer_bytes, coordinator_key=COORDINATOR.public_key, run_id=RUN,
                                               expiration_time=signed_at + 100 * swarm.POINTER_TTL_S)) \
        is RejectCode.EXPIRED
    assert code_of(lambda: swarm.check_pointer(pointer_bytes, coordinator_key=COORDINATOR.public_key,
                                               run_id="other")) is RejectCode.WRONG_RUN
