"""Publisher: adapter tensors -> codec -> signed manifest -> signed pointer in the DHT.

Per version it keeps the signed manifest and the payload chunks in memory (the last `keep` versions)
and serves them over P2P (asyncrl.swarm.serving.AdapterServer, wired by the service). The DHT holds only
the small signed pointer: {run, version, manifest sha256, keyframe version}.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from asyncrl.protocol import codec, envelope, messages
from asyncrl.protocol.identity import Identity

# The pointer's DHT key, TTL and who may write it: asyncrl.protocol.swarm / asyncrl.swarm.records.


@dataclass
class Published:
    version: int
    manifest_bytes: bytes  # sealed envelope
    chunks: list[bytes]
    pointer_bytes: bytes   # sealed envelope
    compressed_bytes: int
    raw_bytes: int
    codec: str
    published_at: float


class Publisher:
    def __init__(self, identity: Identity, *, run_id: str, base_model: str, base_revision: str,
                 lora: messages.LoraSpec, keyframe_every: int, chunk_bytes: int, keep: int = 16):
        self.identity = identity
        self.run_id = run_id
        self.base_model = base_model
        self.base_revision = base_revision
        self.lora = lora
        self.chunk_bytes = chunk_bytes
        self.encoder = codec.AdapterEncoder(keyframe_every=keyframe_every)
        self.keep = keep
        self._versions: OrderedDict[int, Published] = OrderedDict()
        self._lock = threading.Lock()
        self.latest: Published | None = None

    def publish(self, version: int, specs, tensors: dict[str, bytes]) -> Published:
        enc = self.encoder.encode(version, specs, tensors)
        chunks = codec.split_chunks(enc.payload, self.chunk_bytes)
        now = time.time()
        keyframe_version = self.encoder.last_keyframe_version
        manifest = messages.AdapterManifest(
            run_id=self.run_id, version=version, parent_version=enc.parent_version,
            keyframe_version=keyframe_version, base_model=self.base_model, base_revision=self.base_revision,
            lora=self.lora, codec=enc.codec, tensors=tuple(specs), raw_bytes=enc.raw_bytes,
            compressed_bytes=len(enc.payload), chunk_bytes=self.chunk_bytes,
            chunk_hashes=codec.chunk_hashes(chunks), created_at=now)
        manifest_env = envelope.seal(self.identity, "adapter_manifest", messages.encode(manifest))
        pointer = messages.AdapterPointer(
            run_id=self.run_id, version=version, manifest_sha256=hashlib.sha256(manifest_env).digest(),
            keyframe_version=keyframe_version, published_at=now)
        pointer_env = envelope.seal(self.identity, "adapter_pointer", messages.encode(pointer))
        pub = Published(version, manifest_env, chunks, pointer_env, len(enc.payload), enc.raw_bytes, enc.codec, now)
        with self._lock:
            self._versions[version] = pub
            # Late joiners need the chain from the latest keyframe; keep that plus `keep` recent versions.
            horizon = min(keyframe_version, version - self.keep)
            for old in [v for v in self._versions if v < horizon]:
                del self._versions[old]
            self.latest = pub
        return pub

    def get(self, version: int) -> Published | None:
        with self._lock:
            return self._versions.get(version)
