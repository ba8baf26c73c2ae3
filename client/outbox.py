"""Outbox: finished batches on disk until the coordinator has acknowledged (or refused) each one.

What is spooled is the batch's *payload* — the encoded RolloutBatch, unsigned — under its batch id
(sha256 of the payload). The envelope (timestamp, nonce, signature) is sealed afresh at every upload
attempt (client/delivery.py), so a batch outlives a coordinator outage of any length: the coordinator's
timestamp window (`EXPIRED`) only ever sees a fresh seal. The id never changes, so the coordinator's
idempotent ingest still turns retries into exactly-once.

Each payload is written atomically (temp + fsync + rename + fsync of the directory) *before* its
first upload and removed only after an ack (accepted, or DUPLICATE_BATCH: the coordinator already has
it), or after the coordinator read it and refused it for good (its code is counted). A batch the
coordinator cannot take at all — too large for its cap (and not splittable), from a key it does not
admit — is *quarantined*: moved to `quarantine/` beside a JSON note of why, counted and reported,
never deleted unread, and no longer in the way of the batches behind it. `requeue` moves a batch to
the back of the line (it keeps failing for its own reasons; the others go first).

Spool files from older clients (`<id>.batch`, sealed envelopes) are converted to payloads on start.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from asyncrl.protocol.atomic import is_temp, write_atomic, write_json_atomic

SUFFIX = ".payload"
LEGACY_SUFFIX = ".batch"


class OutboxFull(Exception):
    pass


class Outbox:
    def __init__(self, path: Path, *, max_bytes: int = 512 * 1024 * 1024):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.quarantine_path = self.path / "quarantine"
        self.max_bytes = max_bytes
        for stale in self.path.iterdir():  # a crash mid-write leaves only temp files: never half a batch
            if is_temp(stale) or stale.suffix == ".tmp":
                stale.unlink(missing_ok=True)
        self.migrated = self._migrate_sealed()

    # ---- writing ---------------------------------------------------------------------------------
    def put(self, payload: bytes) -> bytes:
        """Spool `payload` durably; returns its batch id. Raises OutboxFull over the disk cap."""
        size = self.size_bytes()
        if size + len(payload) > self.max_bytes:
            raise OutboxFull(f"outbox at {self.path} holds {size} bytes (cap {self.max_bytes}); "
                             "is the coordinator reachable?")
        batch_id = hashlib.sha256(payload).digest()
        write_atomic(self._file(batch_id), payload)
        return batch_id

    def remove(self, batch_id: bytes) -> None:
        self._file(batch_id).unlink(missing_ok=True)

    def requeue(self, batch_id: bytes) -> None:
        """Move a batch to the back of the line (it is retried after the ones spooled before now)."""
        try:
            os.utime(self._file(batch_id))
        except FileNotFoundError:
            pass

    def quarantine(self, batch_id: bytes, code: str, detail: str = "") -> Path:
        """Set a batch aside, with why; it no longer counts against the cap or blocks the line."""
        self.quarantine_path.mkdir(exist_ok=True)
        src, dst = self._file(batch_id), self.quarantine_path / f"{batch_id.hex()}{SUFFIX}"
        if src.exists():
            write_json_atomic(dst.with_suffix(".json"), {"batch_id": batch_id.hex(), "code": code,
                                                         "detail": detail[:1024], "at": time.time(),
                                                         "bytes": src.stat().st_size}, indent=1)
            os.replace(src, dst)
        return dst

    # ---- reading ---------------------------------------------------------------------------------
    def pending(self) -> list[bytes]:
        """Batch ids waiting for upload, oldest first (read each with `read`: the outbox may hold GiBs)."""
        files = []
        for p in self.path.glob(f"*{SUFFIX}"):
            try:
                files.append((p.stat().st_mtime_ns, p.name, p))
            except FileNotFoundError:
                continue
        return [bytes.fromhex(p.stem) for _, _, p in sorted(files)]

    def read(self, batch_id: bytes) -> bytes | None:
        try:
            return self._file(batch_id).read_bytes()
        except FileNotFoundError:
            return None

    def quarantined(self) -> list[dict]:
        notes = []
        for p in sorted(self.quarantine_path.glob("*.json")) if self.quarantine_path.exists() else ():
            try:
                notes.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
        return notes

    def size_bytes(self) -> int:
        total = 0
        for p in self.path.glob(f"*{SUFFIX}"):
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                continue
        return total

    def __len__(self) -> int:
        return sum(1 for _ in self.path.glob(f"*{SUFFIX}"))

    # ---- internals -------------------------------------------------------------------------------
    def _file(self, batch_id: bytes) -> Path:
        return self.path / f"{batch_id.hex()}{SUFFIX}"

    def _migrate_sealed(self) -> int:
        """Older clients spooled sealed envelopes: keep their payloads (the seal is redone at upload)."""
        from asyncrl.protocol import envelope
        from asyncrl.protocol.errors import ProtocolError

        n = 0
        for old in sorted(self.path.glob(f"*{LEGACY_SUFFIX}")):
            data = old.read_bytes()
            try:
                opened = envelope.open_envelope(data, max_bytes=max(len(data), 1), expected_kind="rollout_batch",
                                                expected_audience=None, window_s=None)
            except ProtocolError as exc:
                self.quarantine_path.mkdir(exist_ok=True)
                write_json_atomic(self.quarantine_path / f"{old.stem}.json",
                                  {"batch_id": old.stem, "code": exc.code.value, "detail": "unreadable legacy spool "
                                   "file", "at": time.time(), "bytes": len(data)}, indent=1)
                os.replace(old, self.quarantine_path / old.name)
                continue
            stamp = old.stat()
            write_atomic(self._file(opened.payload_id), opened.payload)
            os.utime(self._file(opened.payload_id), ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # keep its place
            old.unlink()
            n += 1
        return n
