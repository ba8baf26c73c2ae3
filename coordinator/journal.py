"""IngestJournal: every accepted batch on the coordinator's disk *before* its ack leaves.

Why: a volunteer deletes its spooled copy on the ack, so between the last checkpoint and a crash an
acked batch would otherwise exist nowhere. With the journal, an ack means "durable here":
`--resume` re-queues every journalled batch the restored checkpoint had not trained yet (and settles
its lease on the restored task board), so each accepted batch is trained exactly once in the run's
final lineage. Entries are deleted once a retained checkpoint covers them (`discard_trained`).

Format: one file per batch, `<batch id hex>.entry`, msgpack of `JournalEntry` (verified, decoded
groups plus the prompt ids they answer) — no pickle; written to a temp name, fsynced, renamed, so a
crash leaves whole entries or none.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from asyncrl.protocol.atomic import write_atomic

from .learner import TrainGroup, encode_hook


class JournalEntry(msgspec.Struct, frozen=True):
    batch_id: bytes
    client: str
    version: int
    reward_mean: float
    received_at: float
    prompt_ids: list[str]
    groups: list[TrainGroup]
    signer: str = ""
    signer_key: bytes = b""  # the raw key: a replayed batch's pending audit can credit or strike it
    engine_dtype: str = ""   # its engine's dtype (the pending audit's tolerance)


_decoder = msgspec.msgpack.Decoder(JournalEntry)
_encoder = msgspec.msgpack.Encoder(enc_hook=encode_hook)  # ingest's groups hold numpy arrays


class IngestJournal:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in self.path.glob("*.tmp"):  # a crash mid-write: the batch was never acked
            stale.unlink(missing_ok=True)

    def put(self, batch) -> None:
        """Durably record an `ingest.AcceptedBatch` (call before acking it)."""
        entry = JournalEntry(batch_id=batch.batch_id, client=batch.client, version=batch.version,
                             reward_mean=batch.reward_mean, received_at=batch.received_at,
                             prompt_ids=list(batch.prompt_ids), groups=list(batch.groups),
                             signer=getattr(batch, "signer", ""), signer_key=getattr(batch, "signer_key", b""),
                             engine_dtype=getattr(batch, "engine_dtype", ""))
        final = self.path / f"{entry.batch_id.hex()}.entry"
        write_atomic(final, _encoder.encode(entry))  # fsyncs the file and the directory

    def remove(self, batch_id: bytes) -> None:
        (self.path / f"{batch_id.hex()}.entry").unlink(missing_ok=True)

    def ids(self) -> set[bytes]:
        return {bytes.fromhex(p.stem) for p in self.path.glob("*.entry")}

    def entries(self) -> list[JournalEntry]:
        """All entries, in the order they were received."""
        out = [_decoder.decode(p.read_bytes()) for p in self.path.glob("*.entry")]
        return sorted(out, key=lambda e: e.received_at)

    def discard_trained(self, trained: set[bytes]) -> int:
        """Delete the entries a retained checkpoint has trained (or dropped as stale)."""
        gone = 0
        for batch_id in self.ids() & trained:
            self.remove(batch_id)
            gone += 1
        return gone

    def __len__(self) -> int:
        return sum(1 for _ in self.path.glob("*.entry"))
