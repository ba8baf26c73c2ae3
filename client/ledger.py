"""ReceiptLedger: this volunteer's signed contribution receipts, append-only in its data directory.

The volunteer (client/delivery.py) checks each Ack's receipt against the coordinator key of the join address
(and our own key, and the batch id) and appends it to `<data-dir>/receipts.ledger` — `u32 length |
sealed receipt` records, fsynced (protocol/atomic.py `append_record`) — before deleting the batch from
the outbox. The ledger is only ever appended to; a torn last record from a crash is cut off.

    asyncrl-client status                          # verified totals per coordinator and run
    asyncrl-client receipts --export mine.json     # the portable form (protocol/receipts.py)
    asyncrl-client verify mine.json --address /ip4/.../p2p/12D3KooW...   # anyone, offline

`summarise` verifies the ledger offline, grouping receipts by the key that signed them (status.json
names the coordinator this volunteer joined): a receipt that does not verify is counted apart by its
reject code, never added to the totals.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from asyncrl.protocol import envelope, receipts
from asyncrl.protocol.atomic import append_record, read_records
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import PUBLIC_KEY_BYTES, fingerprint, peer_id_from_public_key

LEDGER_NAME = "receipts.ledger"


class ReceiptLedger:
    def __init__(self, data_dir: Path):
        self.path = Path(data_dir) / LEDGER_NAME
        records, self._good = read_records(self.path)
        self._held = {hashlib.sha256(r).digest() for r in records}  # 32 bytes per receipt, not the receipts

    def append(self, sealed: bytes) -> bool:
        """Append a receipt unless the ledger holds it already (a batch re-sent after a crash between
        this append and the outbox delete gets the same receipt again). True if appended."""
        digest = hashlib.sha256(sealed).digest()
        if digest in self._held:
            return False
        self._good = append_record(self.path, sealed, good_length=self._good)
        self._held.add(digest)
        return True

    def all(self) -> list[bytes]:
        """Every whole receipt on disk, oldest first."""
        return read_records(self.path)[0]

    def __len__(self) -> int:
        return len(self._held)


def signer_of(sealed: bytes) -> bytes:
    """The key in an envelope's header (unverified: verification says whether it signed)."""
    start = len(envelope.MAGIC)
    return bytes(sealed[start:start + PUBLIC_KEY_BYTES]) if len(sealed) > envelope.HEADER_BYTES else b""


def summarise(sealed: list[bytes], *, volunteer_key: bytes) -> list[dict]:
    """Totals per signing coordinator and run, from the receipts that verify (each on its own: one bad
    receipt is counted apart by its reject code, it does not hide the good ones)."""
    groups: dict[bytes, list[bytes]] = {}
    for raw in sealed:
        groups.setdefault(signer_of(raw), []).append(raw)
    out = []
    for key, items in groups.items():
        runs: dict[str, receipts.Totals] = {}
        seen: set[tuple[str, bytes]] = set()
        invalid: dict[str, int] = {}
        for raw in items:
            try:
                r = receipts.open_receipt(raw, coordinator_key=key, volunteer_key=volunteer_key)
                if (r.run_id, r.batch_id) in seen:
                    raise ProtocolError(RejectCode.DUPLICATE_BATCH, "counted twice")
            except ProtocolError as exc:
                invalid[exc.code.value] = invalid.get(exc.code.value, 0) + 1
                continue
            seen.add((r.run_id, r.batch_id))
            runs.setdefault(r.run_id, receipts.Totals()).add(r)
        out.append({"coordinator_peer_id": peer_id_from_public_key(key) if len(key) == PUBLIC_KEY_BYTES else None,
                    "coordinator": fingerprint(key) if len(key) == PUBLIC_KEY_BYTES else None,
                    "verified_receipts": sum(t.batches for t in runs.values()), "invalid": invalid,
                    "runs": {run: {"batches": t.batches, "groups": t.groups, "tokens": t.tokens,
                                   "last_at": t.last_at} for run, t in sorted(runs.items())}})
    return out
