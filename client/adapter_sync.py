"""AdapterSync: follow the coordinator's signed adapter pointer and fetch new versions.

Trust: the join address carries the coordinator's Ed25519 peer id; pointer and manifest must be
signed by that key (anything else in the DHT is ignored). Every chunk is checked against the signed
manifest's sha256 before it is decoded. Versions never go backwards. A delta is decoded against the
parent we hold; a client that does not hold the parent walks from the latest keyframe.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from asyncrl.protocol import codec, envelope, limits, messages
from asyncrl.protocol.errors import ProtocolError, RejectCode

MAX_CHAIN = 256


@dataclass
class AdapterVersion:
    version: int
    manifest: messages.AdapterManifest
    tensors: dict[str, bytes]


class AdapterSync:
    def __init__(self, node, *, coordinator_peer_id: str, coordinator_key: bytes, run_id: str):
        self.node = node
        self.peer = coordinator_peer_id
        self.key = coordinator_key
        self.run_id = run_id
        self.current: AdapterVersion | None = None
        self._held: dict[int, AdapterVersion] = {}

    def _handler(self, what: str) -> str:
        return f"asyncrl.{self.run_id}.{what}"

    def poll(self) -> AdapterVersion | None:
        """Return a newer verified adapter version if one is published, else None."""
        raw = self.node.get(f"asyncrl/{self.run_id}/adapter")
        if not isinstance(raw, bytes):
            return None
        opened = envelope.open_envelope(raw, max_bytes=limits.MAX_POINTER_BYTES * 2, expected_kind="adapter_pointer",
                                        expected_audience=envelope.BROADCAST, expected_signer=self.key,
                                        window_s=None)
        pointer = messages.decode_pointer(opened.payload)
        if pointer.run_id != self.run_id:
            raise ProtocolError(RejectCode.WRONG_RUN, f"pointer for run {pointer.run_id!r}")
        if self.current is not None and pointer.version <= self.current.version:
            return None  # nothing new (and never backwards)
        start = pointer.version
        # Walk parent links back to something we can decode from: a keyframe or a version we hold.
        chain = [self._manifest(start, expected_sha256=pointer.manifest_sha256)]
        while chain[-1].parent_version is not None and chain[-1].parent_version not in self._held:
            if len(chain) > MAX_CHAIN:
                raise ProtocolError(RejectCode.MALFORMED, "delta chain longer than any keyframe interval")
            chain.append(self._manifest(chain[-1].parent_version))
        for manifest in reversed(chain):
            parent = self._held.get(manifest.parent_version) if manifest.parent_version is not None else None
            payload = self._payload(manifest)
            tensors = codec.decode(manifest.codec, manifest.tensors, payload,
                                   parent.tensors if parent else None, max_raw_bytes=manifest.raw_bytes)
            held = AdapterVersion(manifest.version, manifest, tensors)
            self._held[manifest.version] = held
        for v in [v for v in self._held if v < start]:  # only the newest is needed as a parent
            del self._held[v]
        self.current = self._held[start]
        return self.current

    def _manifest(self, version: int, expected_sha256: bytes | None = None) -> messages.AdapterManifest:
        raw = self.node.call(self.peer, self._handler("manifest"), struct.pack(">Q", version),
                             max_response_bytes=limits.MAX_MANIFEST_BYTES)
        if expected_sha256 is not None and hashlib.sha256(raw).digest() != expected_sha256:
            raise ProtocolError(RejectCode.HASH_MISMATCH, "manifest differs from the signed pointer")
        opened = envelope.open_envelope(raw, max_bytes=limits.MAX_MANIFEST_BYTES, expected_kind="adapter_manifest",
                                        expected_audience=envelope.BROADCAST, expected_signer=self.key,
                                        window_s=None)
        manifest = messages.decode_manifest(opened.payload)
        if manifest.version != version or manifest.run_id != self.run_id:
            raise ProtocolError(RejectCode.MALFORMED, "manifest does not match the requested version")
        return manifest

    def _payload(self, manifest: messages.AdapterManifest) -> bytes:
        parts = []
        for index, expected in enumerate(manifest.chunk_hashes):
            chunk = self.node.call(self.peer, self._handler("chunk"), struct.pack(">QI", manifest.version, index),
                                   max_response_bytes=manifest.chunk_bytes)
            codec.verify_chunk(chunk, expected)
            parts.append(chunk)
        payload = b"".join(parts)
        if len(payload) != manifest.compressed_bytes:
            raise ProtocolError(RejectCode.MALFORMED, "payload size differs from the manifest")
        return payload
