"""Outbox: finished batches on disk until the coordinator acknowledges them.

Each sealed batch is written atomically (temp name + fsync + rename) *before* upload, and deleted
only after an ack (accepted, or DUPLICATE_BATCH: the coordinator already has it). A client killed at
any point restarts with its unacknowledged batches still here and re-sends them; the coordinator's
idempotent ingest (batch id = sha256 of the payload) makes the retry exactly-once.
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.protocol.atomic import write_atomic


class OutboxFull(Exception):
    pass


class Outbox:
    def __init__(self, path: Path, *, max_bytes: int = 512 * 1024 * 1024):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        for stale in self.path.glob("*.tmp"):  # a crash mid-write leaves only temp files: never half a batch
            stale.unlink(missing_ok=True)

    def put(self, batch_id: bytes, sealed: bytes) -> Path:
        if self.size_bytes() + len(sealed) > self.max_bytes:
            raise OutboxFull(f"outbox at {self.path} holds {self.size_bytes()} bytes (cap {self.max_bytes}); "
                             "is the coordinator reachable?")
        final = self.path / f"{batch_id.hex()}.batch"
        return write_atomic(final, sealed)

    def pending(self) -> list[tuple[bytes, bytes]]:
        """(batch id, sealed bytes), oldest first."""
        files = sorted(self.path.glob("*.batch"), key=lambda p: p.stat().st_mtime)
        return [(bytes.fromhex(p.stem), p.read_bytes()) for p in files]

    def remove(self, batch_id: bytes) -> None:
        (self.path / f"{batch_id.hex()}.batch").unlink(missing_ok=True)

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.glob("*.batch"))

    def __len__(self) -> int:
        return sum(1 for _ in self.path.glob("*.batch"))
