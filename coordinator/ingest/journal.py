"""IngestJournal: every accepted batch on the coordinator's disk *before* its ack leaves.

Why: a volunteer deletes its spooled copy on the ack, so between the last checkpoint and a crash an
acked batch would otherwise exist nowhere. With the journal, an ack means "durable here":
`--resume` re-queues every journalled batch the restored checkpoint had not trained yet (and settles
its lease on the restored task board), so each accepted batch is trained exactly once in the run's
final lineage. Entries are deleted once a retained checkpoint covers them (`discard_trained`).

Format: one file per batch, `<batch id hex>.entry`, msgpack of `JournalEntry` (verified, decoded
groups plus the prompt ids they answer) — no pickle; written to a temp name, fsynced, renamed, so a
crash leaves whole entries or none. Each group's token ids and sampling logprobs are written as the
little-endian int32 / float32 bytes they arrived as (`GroupArrays`; ~270 KB and ~0.1 ms per 8 x 8 x 512
batch, against 433 KB and 1.7 ms as msgpack lists) and come back as numpy arrays; entries written before
(`arrays` empty, lists inside `groups`) still read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import numpy as np

from asyncrl.protocol.atomic import write_atomic

from ..learner.learner import TrainGroup, encode_hook


class GroupArrays(msgspec.Struct, frozen=True, array_like=True):
    """One group's completions (int32 LE) and sampling logprobs (float32 LE), one bytes per completion."""

    tokens: list[bytes]
    logprobs: list[bytes]


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
    engine_dtype: str = ""   # its engine's dtype and kind (the pending audit's tolerance)
    engine_kind: str = ""
    arrays: list[GroupArrays] = []  # per group, its ids and logprobs (then empty in `groups`); [] = older entry


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
                             prompt_ids=list(batch.prompt_ids),
                             groups=[dataclasses.replace(g, completions=[], sampling_logprobs=[]) for g in batch.groups],
                             arrays=[_arrays_of(g) for g in batch.groups],
                             signer=getattr(batch, "signer", ""), signer_key=getattr(batch, "signer_key", b""),
                             engine_dtype=getattr(batch, "engine_dtype", ""), engine_kind=getattr(batch, "engine_kind", ""))
        final = self.path / f"{entry.batch_id.hex()}.entry"
        write_atomic(final, _encoder.encode(entry))  # fsyncs the file and the directory

    def remove(self, batch_id: bytes) -> None:
        (self.path / f"{batch_id.hex()}.entry").unlink(missing_ok=True)

    def ids(self) -> set[bytes]:
        return {bytes.fromhex(p.stem) for p in self.path.glob("*.entry")}

    def entries(self) -> list[JournalEntry]:
        """All entries, in the order they were received."""
        out = [_joined(_decoder.decode(p.read_bytes())) for p in self.path.glob("*.entry")]
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


def _arrays_of(group: TrainGroup) -> GroupArrays:
    return GroupArrays(tokens=[np.asarray(c, dtype="<i4").tobytes() for c in group.completions],
                       logprobs=[np.asarray(lp, dtype="<f4").tobytes() for lp in group.sampling_logprobs])


def _joined(entry: JournalEntry) -> JournalEntry:
    """The entry with each group's arrays back inside it (an older entry, lists inside, as it is)."""
    if not entry.arrays:
        return entry
    if len(entry.arrays) != len(entry.groups) or any(len(a.tokens) != len(g.rewards) or len(a.logprobs) != len(a.tokens)
                                                     for g, a in zip(entry.groups, entry.arrays)):
        raise ValueError(f"journal entry {entry.batch_id.hex()}: its arrays do not match its groups")
    groups = [dataclasses.replace(g, completions=[np.frombuffer(t, dtype="<i4") for t in a.tokens],
                                  sampling_logprobs=[np.frombuffer(lp, dtype="<f4") for lp in a.logprobs])
              for g, a in zip(entry.groups, entry.arrays)]
    return msgspec.structs.replace(entry, groups=groups, arrays=[])
