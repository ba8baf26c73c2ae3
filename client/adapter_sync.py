"""AdapterSync: follow the coordinator's signed adapter pointer and fetch new versions.

Trust: the join address carries the coordinator's Ed25519 peer id; pointer and manifest must be
signed by that key (anything else in the DHT is ignored). Every chunk is checked against the signed
manifest's sha256 before it is decoded. A delta is decoded against the parent we hold; a client that
does not hold the parent walks from the latest keyframe.

Swarm (docs/transport.md, docs/scale.md): manifests and chunks come from the peers the coordinator's
signed providers record vouches for first and the coordinator last (`asyncrl.swarm.fetch`,
`asyncrl.swarm.providers`); every version fetched is kept in an AdapterStore and, after `serve()`,
served to other volunteers (`asyncrl.swarm.serving`), also while it is still arriving.
`start_following()` moves pointer polling and fetching to a background thread, so a volunteer busy
generating still fetches (and serves) new versions at once; `poll()` then just hands over the newest.
Which pointer is newer is decided by `protocol.swarm.pointer_is_newer` (a later publish of another
manifest): a coordinator restarted without its checkpoint, whose versions start again at 0, is
followed; a replayed old pointer is not. A pointer with `finished` set ends the run (`finished`): the
worker then stops asking for work and exits with its summary (or waits for the next run: `--follow`).
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field

from asyncrl.protocol import codec, envelope, limits, messages, swarm
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.swarm import streams
from asyncrl.swarm.streams import stream_name

MAX_CHAIN = 256
REJOIN_AFTER_S = 5.0
"""The follower checks this often that a bootstrap peer is in the DHT routing table, and re-dials if not."""


@dataclass
class AdapterVersion:
    version: int
    manifest: messages.AdapterManifest
    tensors: dict[str, bytes]
    held_at: float = field(default_factory=time.time)  # when it was verified and decoded here


class AdapterSync:
    def __init__(self, node, *, coordinator_peer_id: str, coordinator_key: bytes, run_id: str):
        from asyncrl.swarm.fetch import SwarmFetcher
        from asyncrl.swarm.providers import ProvidersCache
        from asyncrl.swarm.serving import AdapterStore

        self.node = node
        self.peer = coordinator_peer_id
        self.key = coordinator_key
        self.run_id = run_id
        self.current: AdapterVersion | None = None
        self.pointer: messages.AdapterPointer | None = None
        self.finished = False  # the coordinator's signed pointer says the run is over (at self.current)
        self._held: dict[int, AdapterVersion] = {}
        self._manifest_raw: dict[int, bytes] = {}
        self._coordinator_manifests_only = False
        self.store = AdapterStore()
        self.providers = ProvidersCache(node, run_id, coordinator_peer_id, coordinator_key)
        self.fetcher = SwarmFetcher(node, run_id=run_id, coordinator_peer_id=coordinator_peer_id, store=self.store,
                                    providers=lambda: self.providers.record)
        self.server = None
        self.bootstrap: list[str] = []  # multiaddrs to re-dial when the coordinator dropped out of the DHT
        self.on_new_version = None  # called (follower thread) after each newly fetched version
        self.errors = 0
        self.last_timings: dict[str, float] = {}
        self._lock = threading.RLock()  # one fetch at a time (follower thread vs. --hold-version fetches)
        self._follower: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._newest: AdapterVersion | None = None
        self._taken: AdapterVersion | None = None
        self._pushed: bytes | None = None  # a pointer pushed to us by the coordinator (verified again on use)

    # ---- swarm wiring ---------------------------------------------------------------------------
    def serve(self, *, upload_bps: float = 0, server_cls=None):
        """Serve the versions we hold (manifest + chunk handlers) to other volunteers."""
        from asyncrl.swarm.serving import AdapterServer

        self.server = (server_cls or AdapterServer)(self.node, self.run_id, self.store, upload_bps=upload_bps).start()
        self.store.on_unknown_version = lambda version: self._wake.set()  # someone has news: look now

        async def pointer(request: bytes, peer: str) -> bytes:
            # Anyone may push; only a pointer the coordinator signed is kept (checked here and again on use).
            swarm.check_pointer(request, coordinator_key=self.key, run_id=self.run_id)
            self._pushed = request
            self._wake.set()
            return b""

        self.node.serve(stream_name(self.run_id, streams.POINTER), pointer, max_request_bytes=limits.MAX_POINTER_BYTES)
        return self.server

    def start_following(self, poll_s: float = 0.5, out=None) -> None:
        """Poll the pointer and fetch on a background thread; `poll()` then returns its newest result."""
        def loop() -> None:
            from asyncrl.swarm.bootstrap import knows_any, rejoin

            last_check, last_warning = time.monotonic(), ""
            while not self._stop.is_set():
                try:
                    self.providers.maybe_refresh()
                    got = self.refresh()
                    if got is not None:
                        self._newest = got
                        if self.on_new_version is not None:
                            self.on_new_version()
                except Exception as exc:  # TransportError, ProtocolError, timeouts: keep following
                    self.errors += 1
                    warning = f"adapter fetch: {exc.__class__.__name__}: {exc}"
                    if out is not None and warning != last_warning:
                        out(warning)
                    last_warning = warning
                    self._wake.wait(1.0)
                if self.bootstrap and time.monotonic() - last_check > REJOIN_AFTER_S:
                    last_check = time.monotonic()
                    if not knows_any(self.node, self.bootstrap):  # e.g. the coordinator restarted
                        rejoin(self.node, self.bootstrap)
                self._wake.wait(poll_s)
                self._wake.clear()

        self._follower = threading.Thread(target=loop, name="adapter-follower", daemon=True)
        self._follower.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def versions_served(self) -> list[int]:
        return self.store.complete_versions()

    def poll(self) -> AdapterVersion | None:
        """Return a newer verified adapter version if one is published, else None."""
        if self._follower is not None:
            newest = self._newest
            if newest is None or newest is self._taken:
                return None
            self._taken = newest
            return newest
        return self.refresh()

    def refresh(self) -> AdapterVersion | None:
        """Read the pointer (a pushed one, else the DHT's); if it names a newer version, fetch, verify and
        decode it (blocking)."""
        pointer = None
        pushed, self._pushed = self._pushed, None
        if pushed is not None:
            pointer, _ = swarm.check_pointer(pushed, coordinator_key=self.key, run_id=self.run_id)
            if not swarm.pointer_is_newer(pointer, self.pointer):
                pointer = None
        if pointer is None:
            raw = self.node.get(swarm.pointer_key(self.run_id, self.peer))
            if not isinstance(raw, bytes):
                return None
            pointer, _ = swarm.check_pointer(raw, coordinator_key=self.key, run_id=self.run_id)
        if not swarm.pointer_is_newer(pointer, self.pointer):
            return None  # nothing new (and never backwards)
        if pointer.finished and self.pointer is not None and pointer.manifest_sha256 == self.pointer.manifest_sha256:
            self.pointer, self.finished = pointer, True  # the run ended at the version we hold
            return None
        with self._lock:
            if self.current is not None and pointer.version <= self.current.version:
                # Published later but numbered lower: the coordinator restarted without its checkpoint.
                # Version numbers now name other tensors: forget everything held under the old ones.
                self._held.clear()
                self._manifest_raw.clear()
                self.store.clear()
            start = pointer.version
            t0 = time.monotonic()
            self.providers.ensure(start)  # this version's seeders, before anyone asks anyone
            # Walk parent links back to something we can decode from: a keyframe or a version we hold.
            chain = [self._manifest(start, expected_sha256=pointer.manifest_sha256)]
            while chain[-1].parent_version is not None and chain[-1].parent_version not in self._held:
                if len(chain) > MAX_CHAIN:
                    raise ProtocolError(RejectCode.MALFORMED, "delta chain longer than any keyframe interval")
                chain.append(self._manifest(chain[-1].parent_version))
            timings = {"manifests_s": time.monotonic() - t0, "chunks_s": 0.0, "decode_s": 0.0}
            for manifest in reversed(chain):
                parent = self._held.get(manifest.parent_version) if manifest.parent_version is not None else None
                t1 = time.monotonic()
                payload = self._payload(manifest)  # every chunk verified against the signed manifest
                t2 = time.monotonic()
                try:
                    tensors = codec.decode(manifest.codec, manifest.tensors, payload,
                                           parent.tensors if parent else None, max_raw_bytes=manifest.raw_bytes)
                except ProtocolError:
                    # Verified chunks that do not decode (crc32): a delta against a parent from another run of
                    # the coordinator. Start over from the keyframe, with manifests from the coordinator itself.
                    for m in chain:
                        self.store.drop(m.version)
                    self._held.clear()
                    self._coordinator_manifests_only = True
                    raise
                timings["chunks_s"] += t2 - t1
                timings["decode_s"] += time.monotonic() - t2
                held = AdapterVersion(manifest.version, manifest, tensors)
                self._held[manifest.version] = held
            self._coordinator_manifests_only = False
            for v in [v for v in self._held if v < start]:  # only the newest is needed as a parent
                del self._held[v]
            for v in [v for v in self._manifest_raw if v < start]:
                del self._manifest_raw[v]
            self.store.prune()
            self.pointer = pointer
            self.finished = pointer.finished
            self.last_timings = {k: round(v, 3) for k, v in timings.items()}  # of the newest fetch (status)
            self.current = self._held[start]
            return self.current

    def fetch(self, version: int, known: dict[int, AdapterVersion] | None = None) -> AdapterVersion:
        """A verified older `version` (for the experiment-only --hold-version; client/version_hold.py).

        Same trust path as `poll` (signed manifest, every chunk hashed) minus the pointer; walks parent
        links back to a keyframe, a version held here or one in `known`. Changes no state here."""
        have = {**self._held, **(known or {})}
        chain = [self._manifest(version)]
        while chain[-1].parent_version is not None and chain[-1].parent_version not in have:
            if len(chain) > MAX_CHAIN:
                raise ProtocolError(RejectCode.MALFORMED, "delta chain longer than any keyframe interval")
            chain.append(self._manifest(chain[-1].parent_version))
        for manifest in reversed(chain):
            parent = have.get(manifest.parent_version) if manifest.parent_version is not None else None
            tensors = codec.decode(manifest.codec, manifest.tensors, self._payload(manifest),
                                   parent.tensors if parent else None, max_raw_bytes=manifest.raw_bytes)
            have[manifest.version] = AdapterVersion(manifest.version, manifest, tensors)
        return have[version]

    def _manifest(self, version: int, expected_sha256: bytes | None = None) -> messages.AdapterManifest:
        """The signed manifest of `version`, from a peer holding it or the coordinator; a peer's copy
        passes the same checks (coordinator signature, and the pointer's sha256 for the newest)."""
        def verify(raw: bytes) -> messages.AdapterManifest:
            if expected_sha256 is not None and hashlib.sha256(raw).digest() != expected_sha256:
                raise ProtocolError(RejectCode.HASH_MISMATCH, "manifest differs from the signed pointer")
            opened = envelope.open_envelope(raw, max_bytes=limits.MAX_MANIFEST_BYTES, expected_kind="adapter_manifest",
                                            expected_audience=envelope.BROADCAST, expected_signer=self.key,
                                            window_s=None)
            manifest = messages.decode_manifest(opened.payload)
            if manifest.version != version or manifest.run_id != self.run_id:
                raise ProtocolError(RejectCode.MALFORMED, "manifest does not match the requested version")
            return manifest

        raw, manifest = self.fetcher.manifest(version, verify, peers=not self._coordinator_manifests_only)
        self._manifest_raw[version] = raw
        return manifest

    def _payload(self, manifest: messages.AdapterManifest) -> bytes:
        """Every chunk from the swarm, each checked against the manifest's sha256 before it is kept."""
        raw = self._manifest_raw.get(manifest.version)
        if raw is None:
            raise ProtocolError(RejectCode.INTERNAL, f"manifest of v{manifest.version} was not fetched here")
        return self.fetcher.payload(manifest, raw)
