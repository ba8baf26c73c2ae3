"""ReceiptDesk: issue a signed contribution receipt for every accepted batch (protocol/receipts.py).

Ingest calls `issue(...)` once a batch is accepted and queued, and puts the sealed receipt in the Ack;
a retry of an accepted batch (DUPLICATE_BATCH, e.g. after a lost ack) gets the same receipt again from
`lookup`. Each receipt carries the running totals of its key in this run, so the desk keeps them per
key, and appends every receipt to `<run_dir>/receipts.bin` (`u32 length | sealed receipt`, fsynced)
*before* the ack leaves: the log is the operator's record of who contributed what (`summary.json`
"receipts", the dashboard's contributors table). Every SNAPSHOT_EVERY receipts the totals and the log
offset they cover go to `receipts.totals.json` (atomic), so a restart reads the snapshot and replays
only the log after it — not days of receipts. Memory: the totals (one small record per key) and the
last LOOKUP_KEEP receipts.
A receipt is its volunteer's data (key, sequence number, running totals): `lookup` hands it only to the key it
was issued to, so a stranger who re-seals her payload under another key (same batch id: DUPLICATE_BATCH) gets
the "accepted" answer but not her receipt; ingest also withholds it from a copy delivered by another peer.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncrl.protocol import messages, receipts
from asyncrl.protocol.atomic import append_record, read_json, read_records, write_json_atomic
from asyncrl.protocol.identity import Identity, fingerprint

LOOKUP_KEEP = 16384
"""Receipts remembered by batch id for a retried batch (a lost ack is retried within minutes)."""
SNAPSHOT_EVERY = 256


@dataclass
class KeyTotals:
    batches: int = 0
    groups: int = 0
    tokens: int = 0


class ReceiptDesk:
    def __init__(self, identity: Identity, run_id: str, path: Path | None, *, clock=time.time):
        self.identity = identity
        self.run_id = run_id
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self.totals: dict[bytes, KeyTotals] = {}
        self._recent: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()  # batch id -> (volunteer, sealed)
        self._good_length = 0
        self._since_snapshot = 0
        if path is not None:
            self.snapshot_path = path.with_name(path.name + ".totals.json")
            self._load()

    def _load(self) -> None:
        snap = read_json(self.snapshot_path, {})
        offset = 0
        try:
            if snap.get("run_id") == self.run_id and 0 <= int(snap["offset"]) <= self.path.stat().st_size:
                offset = int(snap["offset"])
                self.totals = {bytes.fromhex(k): KeyTotals(*map(int, v)) for k, v in snap["totals"].items()}
        except (OSError, KeyError, TypeError, ValueError, AttributeError):
            offset, self.totals = 0, {}  # no usable snapshot: replay the whole log
        records, self._good_length = read_records(self.path, offset=offset)
        for raw in records:
            try:
                r = receipts.open_receipt(raw, coordinator_key=self.identity.public_key)
            except Exception:
                continue  # not ours (another key wrote this run dir): it counts for nobody
            if r.run_id != self.run_id:
                continue
            t = self.totals.setdefault(r.volunteer, KeyTotals())
            t.batches, t.groups, t.tokens = t.batches + 1, t.groups + r.groups, t.tokens + r.tokens
            self._remember(r.batch_id, r.volunteer, raw)

    def _remember(self, batch_id: bytes, volunteer: bytes, sealed: bytes) -> None:
        self._recent[batch_id] = (volunteer, sealed)
        self._recent.move_to_end(batch_id)
        while len(self._recent) > LOOKUP_KEEP:
            self._recent.popitem(last=False)

    def issue(self, volunteer: bytes, batch_id: bytes, *, adapter_version: int, groups: int, completions: int,
              tokens: int) -> bytes:
        """A sealed receipt for an accepted batch, durable in the log before it is returned."""
        with self._lock:
            t = self.totals.get(volunteer) or KeyTotals()
            new = KeyTotals(t.batches + 1, t.groups + groups, t.tokens + tokens)
            receipt = messages.Receipt(run_id=self.run_id, volunteer=volunteer, batch_id=batch_id, seq=new.batches,
                                       adapter_version=adapter_version, groups=groups, completions=completions,
                                       tokens=tokens, accepted_at=self._clock(), total_batches=new.batches,
                                       total_groups=new.groups, total_tokens=new.tokens)
            sealed = receipts.seal_receipt(self.identity, receipt)
            if self.path is not None:
                self._good_length = append_record(self.path, sealed, good_length=self._good_length)
            self.totals[volunteer] = new
            self._remember(batch_id, volunteer, sealed)
            self._since_snapshot += 1
            if self.path is not None and self._since_snapshot >= SNAPSHOT_EVERY:
                self._snapshot_locked()
            return sealed

    def _snapshot_locked(self) -> None:
        write_json_atomic(self.snapshot_path, {"run_id": self.run_id, "offset": self._good_length, "totals": {
            k.hex(): [t.batches, t.groups, t.tokens] for k, t in self.totals.items()}})
        self._since_snapshot = 0

    def lookup(self, batch_id: bytes, volunteer: bytes) -> bytes:
        """The receipt already issued to `volunteer` for `batch_id` (b"" when unknown, long ago, or issued to
        another key)."""
        with self._lock:
            owner, sealed = self._recent.get(batch_id, (b"", b""))
            return sealed if owner == volunteer else b""

    def summary(self) -> dict[str, dict]:
        """Per volunteer fingerprint: batches, groups and tokens receipted in this run."""
        with self._lock:
            return {fingerprint(k): asdict(t) for k, t in self.totals.items()}
