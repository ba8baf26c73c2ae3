"""Publisher: adapter tensors -> codec -> signed manifest -> signed pointer in the DHT, on its own thread.

Two pieces, one job each:
  Publisher      encode + sign one version. Per version it keeps the signed manifest and the payload
                 chunks in memory (the last `keep` versions and the chain from the newest keyframe) and
                 serves them over P2P (asyncrl.swarm.serving.AdapterServer, wired by the service).
  PublishWorker  the publisher thread: a newest-wins mailbox between the learner and the Publisher, the
                 DHT pointer store and its refresh. Its docstring holds the back-pressure invariant and
                 the order of the steps that make a version visible (lineage and audit copy first).

The DHT holds only the small signed pointer: {run, version, manifest sha256, keyframe version}.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

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
    parent_version: int | None = None


class Publisher:
    def __init__(self, identity: Identity, *, run_id: str, base_model: str, base_revision: str,
                 lora: messages.LoraSpec, keyframe_every: int, chunk_bytes: int, keep: int = 16,
                 base_weights_sha256: str = "", tokenizer_sha256: str = "", stop_token_ids: tuple[int, ...] = (),
                 max_context_tokens: int = 0):
        self.identity = identity
        # The base model pin (models/pinning.py) every manifest carries; volunteers verify it before generating.
        self.pin_fields = dict(base_weights_sha256=base_weights_sha256, tokenizer_sha256=tokenizer_sha256,
                               stop_token_ids=tuple(stop_token_ids), max_context_tokens=max_context_tokens)
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

    def publish(self, version: int, specs, tensors: dict[str, bytes], canary: messages.Canary | None = None) -> Published:
        enc = self.encoder.encode(version, specs, tensors)
        chunks = codec.split_chunks(enc.payload, self.chunk_bytes)
        now = time.time()
        keyframe_version = self.encoder.last_keyframe_version
        manifest = messages.AdapterManifest(
            run_id=self.run_id, version=version, parent_version=enc.parent_version,
            keyframe_version=keyframe_version, base_model=self.base_model, base_revision=self.base_revision,
            lora=self.lora, codec=enc.codec, tensors=tuple(specs), raw_bytes=enc.raw_bytes,
            compressed_bytes=len(enc.payload), chunk_bytes=self.chunk_bytes,
            chunk_hashes=codec.chunk_hashes(chunks), created_at=now, canary=canary, **self.pin_fields)
        manifest_env = envelope.seal(self.identity, "adapter_manifest", messages.encode(manifest))
        pointer = messages.AdapterPointer(
            run_id=self.run_id, version=version, manifest_sha256=hashlib.sha256(manifest_env).digest(),
            keyframe_version=keyframe_version, published_at=now)
        pointer_env = envelope.seal(self.identity, "adapter_pointer", messages.encode(pointer))
        pub = Published(version, manifest_env, chunks, pointer_env, len(enc.payload), enc.raw_bytes, enc.codec, now,
                        enc.parent_version)
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


POINTER_REFRESH_S = 60.0
"""Re-store the newest pointer when it has not been stored for this long (its DHT record expires)."""
SKIPPED_MEMORY = 4096
"""Superseded (never published) versions remembered for `is_published`; older claims are stale anyway."""
CLOSE_WAIT_S = 10.0


@dataclass(frozen=True)
class Export:
    """One version as the learner thread hands it over: the LoRA tensors in the publish dtype, already
    copied off the live parameters (so the learner may step on while this is encoded)."""

    version: int
    specs: tuple
    blobs: dict[str, bytes]
    learner_steps: int   # learner.steps when exported (the auditor reuses the learner's pass while equal)
    export_s: float      # what the export cost the learner thread
    canary: messages.Canary | None = None  # models/canary.py: the probe scored under this version
    exported_at: float = field(default_factory=time.monotonic)


def export_version(learner, dtype: str) -> Export:
    """Learner thread: the live LoRA weights copied to CPU in the publish dtype — the only part of
    publishing the learner waits for (a memcpy-sized cost; `export_s` in the publish event)."""
    from asyncrl.models.lora import export_lora

    from asyncrl.models.canary import make_canary

    t0 = time.perf_counter()
    specs, blobs = export_lora(learner.model, dtype)
    try:  # two forward passes of a few dozen tokens; a version without a canary is still published
        canary = make_canary(learner.model, learner.tokenizer, dtype)
    except Exception:  # noqa: BLE001 - e.g. a wrapped model without PEFT's disable_adapter
        canary = None
    return Export(learner.version, tuple(specs), blobs, learner.steps, export_s=time.perf_counter() - t0,
                  canary=canary)


class PublishWorker:
    """The publisher thread: everything after the export, off the learner's critical path.

    The learner thread exports (copies the LoRA weights to CPU in the publish dtype) and calls `submit`,
    which only swaps a reference under a lock. This thread encodes, signs, makes the chunks servable and
    stores the pointer in the DHT (which can take up to DHT_STORE_TIMEOUT_S).

    Back-pressure invariant (the queue is here): a one-slot mailbox, newest wins. At most one export
    waits and at most one is being published; `submit` never blocks, and a submit that finds the slot
    full replaces the waiting export, which is *superseded* (counted, never published). So memory is
    bounded (two raw adapters in flight plus the Publisher's retained versions), the learner never waits
    on encode, sign or the network, and a stalled DHT costs only freshness: volunteers keep the last
    published version until the store returns, then get the newest one.

    Per version, in this order (every step before anything a volunteer can see):
      1. `before_visible(export)`: the hub remembers it for audits and records it in lineage.json
         (checkpoint.record_published: a resumed run numbers its versions above it);
      2. `Publisher.publish`: encode (a delta against the last *published* version: a superseded one
         never reaches the encoder), sign manifest and pointer; chunks servable;
      3. `published_version` advances (ingest now accepts batches claiming it);
      4. the pointer goes to the DHT (a failure is retried by the refresh below);
      5. `on_published(record)`: the metrics event.
    A superseded version goes through none of these: no lineage entry, no audit copy, no encoder state,
    and `is_published` is False for it (ingest refuses batches claiming it: FUTURE_VERSION). A version
    whose step 1 or 2 fails is skipped the same way (counted in `errors`).

    This thread is also the pointer's only writer: it re-stores the newest pointer when none was stored
    for `refresh_s`, so a refresh can never put an older pointer back over a newer one.

    `close()` abandons a waiting export (the final checkpoint holds those weights; a resumed run
    publishes above them) and waits a bounded time for the one in flight.
    """

    def __init__(self, publisher: Publisher, pointer, *, before_visible: Callable[[Export], None] | None = None,
                 on_published: Callable[[dict], None] | None = None, published_floor: int = -1,
                 refresh_s: float = POINTER_REFRESH_S, out=print):
        self.publisher = publisher
        self.pointer = pointer  # .store(sealed) / .refresh(sealed): asyncrl.swarm.records.PointerRecord
        self.before_visible = before_visible
        self.on_published = on_published
        self.refresh_s = refresh_s
        self.out = out
        self._cond = threading.Condition()
        self._pending: Export | None = None
        self._in_flight: Export | None = None
        self._in_flight_since: float | None = None
        self._closing = False
        self._finishing = False  # finish(): store the run's final pointer, then refresh that one
        self.final_pointer: bytes | None = None
        self._skipped: set[int] = set()
        # Versions up to the floor may be held by volunteers already (a resumed run's pre-crash lineage).
        self.published_version = published_floor
        self.published = self.superseded = self.errors = self.abandoned = 0
        self.last_latency_s: float | None = None
        self._last_store = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="publisher", daemon=True)

    def start(self) -> PublishWorker:
        self._thread.start()
        return self

    # ---- learner side ------------------------------------------------------------------------
    def submit(self, export: Export) -> None:
        """Hand a version over; never blocks. A version still waiting is superseded by this one."""
        with self._cond:
            if self._closing:
                raise RuntimeError("publisher is closed")
            if self._pending is not None:
                self._skip_locked(self._pending.version)
                self.superseded += 1
            self._pending = export
            self._cond.notify_all()

    # ---- anyone ------------------------------------------------------------------------------
    def is_published(self, version: int) -> bool:
        """Could a volunteer hold `version`? (Not ahead of the newest published, not a skipped one.)"""
        with self._cond:
            return version <= self.published_version and version not in self._skipped

    def wait_published(self, version: int, timeout: float | None = None) -> bool:
        """Block until `version` (or a newer one) is published; False if it was skipped (superseded, or
        its publish failed), on timeout or on close."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.published_version < version and version not in self._skipped and not self._closing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return self.published_version >= version

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing waits and nothing is in flight (tests, benchmarks)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._in_flight is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def finish(self, timeout: float | None = None) -> bool:
        """The run is over: after whatever export still waits, store the final pointer (the newest version,
        `finished` set: protocol/swarm.py finish_pointer) from this thread, the pointer's only writer; later
        refreshes re-seal that one. True once it was stored (or tried: a failed store is refreshed too).
        An export still waiting or in flight is published first: the final pointer names the newest version,
        and a run whose first version has not reached the Publisher yet still ends with one. False only
        on timeout, on close, or when no version was ever published."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._finishing = True
            self._cond.notify_all()
            while self.final_pointer is None and not self._closing and (
                    self.publisher.latest is not None or self._pending is not None or self._in_flight is not None):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return self.final_pointer is not None

    def stats(self) -> dict:
        with self._cond:
            busy = self._in_flight_since
            return {"published_version": self.published_version, "published": self.published,
                    "superseded": self.superseded, "errors": self.errors, "abandoned": self.abandoned,
                    "queue_depth": int(self._pending is not None),
                    "in_flight": self._in_flight.version if self._in_flight is not None else None,
                    "in_flight_s": time.monotonic() - busy if busy is not None else None,
                    "last_latency_s": self.last_latency_s}

    def close(self, timeout: float = CLOSE_WAIT_S) -> bool:
        """Stop: abandon the waiting export, wait up to `timeout` for the one in flight. True if it ended."""
        with self._cond:
            self._closing = True
            if self._pending is not None:
                self.abandoned += 1
                self._pending = None
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the publisher thread ----------------------------------------------------------------
    def _skip_locked(self, version: int) -> None:
        self._skipped.add(version)
        if len(self._skipped) > SKIPPED_MEMORY:
            self._skipped = set(sorted(self._skipped)[-SKIPPED_MEMORY // 2:])

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing and not self._final_due_locked():
                    wait = self._last_store + self.refresh_s - time.monotonic()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._closing:
                    return
                export, self._pending = self._pending, None
                self._in_flight, self._in_flight_since = export, time.monotonic()
            try:
                if export is not None:
                    self._publish(export)
                elif self._final_due_locked():
                    self._store_final()
                else:
                    self._refresh()
            finally:
                with self._cond:
                    self._in_flight = self._in_flight_since = None
                    self._cond.notify_all()

    def _final_due_locked(self) -> bool:
        return self._finishing and self.final_pointer is None and self.publisher.latest is not None

    def _store_final(self) -> None:
        from asyncrl.protocol import swarm

        final = swarm.finish_pointer(self.pointer.identity, self.publisher.latest.pointer_bytes)
        self._last_store = time.monotonic()
        try:
            self.pointer.store(final)  # DHT + a push to the live volunteers
        except Exception as exc:  # the refresh below stores it again
            self.out(f"warning: final pointer not stored: {exc}")
        with self._cond:
            self.final_pointer = final
            self._cond.notify_all()

    def _refresh(self) -> None:
        self._last_store = time.monotonic()
        latest = self.final_pointer or (self.publisher.latest.pointer_bytes if self.publisher.latest else None)
        if latest is None:
            return
        try:
            self.pointer.refresh(latest)  # re-sealed: a fresh timestamp bounds its expiry
        except Exception as exc:  # keep refreshing; the DHT may be briefly unhappy
            self.out(f"warning: pointer refresh failed: {exc}")

    def _publish(self, export: Export) -> None:
        from asyncrl.swarm.transport import TransportError

        t0 = time.monotonic()
        try:
            if self.before_visible is not None:
                self.before_visible(export)
            pub = self.publisher.publish(export.version, export.specs, export.blobs, canary=export.canary)
        except Exception as exc:  # e.g. lineage.json not writable: never announce what a resume could reuse
            with self._cond:
                self._skip_locked(export.version)
                self.errors += 1
                self._cond.notify_all()
            self.out(f"warning: v{export.version} not published: {exc.__class__.__name__}: {exc}")
            return
        t1 = time.monotonic()
        with self._cond:
            self.published_version = export.version
            self.published += 1
            self._cond.notify_all()
        stored = True
        visible_at = time.time()  # from here volunteers may see it (pushed, then stored)
        try:
            self.pointer.store(pub.pointer_bytes)
        except TransportError as exc:  # the refresh stores it again
            stored = False
            self.out(f"warning: pointer for v{export.version} not stored: {exc}")
        t2 = self._last_store = time.monotonic()
        with self._cond:
            self.last_latency_s = t2 - export.exported_at
            record = {"version": pub.version, "codec": pub.codec, "compressed_bytes": pub.compressed_bytes,
                      "raw_bytes": pub.raw_bytes, "parent_version": pub.parent_version, "stored": stored,
                      "visible_at": visible_at,
                      "latency_s": t2 - export.exported_at, "queue_wait_s": t0 - export.exported_at,
                      "export_s": export.export_s, "encode_s": t1 - t0, "store_s": t2 - t1,
                      "superseded_total": self.superseded, "queue_depth": int(self._pending is not None)}
        if self.on_published is not None:
            try:
                self.on_published(record)
            except Exception as exc:  # e.g. the run log closed at shutdown
                if not self._closing:
                    self.out(f"warning: publish event for v{export.version} lost: {exc}")
