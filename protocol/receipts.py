"""Contribution receipts: the coordinator's signed proof that it accepted a volunteer's batch. Pure.

Every accepted batch's Ack carries a sealed `Receipt` (messages.py): envelope kind "receipt", signed by
the coordinator's key — the key inside the join address's peer id — with the volunteer's key as
audience. So anyone who has the join address can check a volunteer's receipts offline: no coordinator,
no network, no trust in the volunteer who shows them.

    seal_receipt(identity, receipt)              coordinator side (coordinator/ingest/receipts.py issues them)
    open_receipt(sealed, coordinator_key=...)    verify one; only ProtocolError escapes
    verify_receipts(sealed_list, coordinator_key=...)   a whole ledger -> LedgerTotals (or the first error)
    export_document / parse_export               the portable file `asyncrl-client receipts --export` writes

What a valid ledger proves: each receipt was signed by that coordinator for that volunteer key, no
batch is counted twice, and the totals are the sums of the receipts themselves (a receipt's running
totals are the coordinator's view and are reported, not trusted). What it does not prove: that the
batch later trained — a deferred generation audit can still reject it (docs/volunteer.md).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

from . import envelope, limits, messages
from .errors import ProtocolError, RejectCode
from .identity import PUBLIC_KEY_BYTES, Identity, fingerprint

RECEIPT_KIND = "receipt"
EXPORT_FORMAT = "asyncrl-receipts"
EXPORT_VERSION = 1
MAX_EXPORT_RECEIPTS = 10_000_000


def seal_receipt(identity: Identity, receipt: messages.Receipt) -> bytes:
    """Sign `receipt` with the coordinator key, addressed to the volunteer it names."""
    return envelope.seal(identity, RECEIPT_KIND, messages.encode(receipt), audience=receipt.volunteer,
                         now=receipt.accepted_at)


def validate_receipt(r: messages.Receipt) -> None:
    if len(r.volunteer) != PUBLIC_KEY_BYTES or len(r.batch_id) != messages.SHA256_BYTES:
        raise ProtocolError(RejectCode.MALFORMED, "receipt volunteer key / batch id has the wrong length")
    for name in ("seq", "groups", "completions", "tokens", "total_batches", "total_groups", "total_tokens"):
        messages._int_range(getattr(r, name), f"receipt.{name}", 1 if name in ("seq", "total_batches") else 0)
    messages._int_range(r.adapter_version, "receipt.adapter_version", 0)
    messages._finite(r.accepted_at, "receipt.accepted_at")
    if r.total_batches < r.seq or r.total_groups < r.groups or r.total_tokens < r.tokens:
        raise ProtocolError(RejectCode.MALFORMED, "receipt running totals smaller than the receipt itself")


def open_receipt(sealed: bytes, *, coordinator_key: bytes, volunteer_key: bytes | None = None) -> messages.Receipt:
    """Verify one sealed receipt against the coordinator's key (NOT_ALLOWED when another key signed it,
    SIGNATURE_MISMATCH when its bytes were altered). Only ProtocolError escapes."""
    opened = envelope.open_envelope(sealed, max_bytes=limits.MAX_RECEIPT_BYTES, expected_kind=RECEIPT_KIND,
                                    expected_audience=None, expected_signer=coordinator_key, window_s=None)
    receipt = messages.decode(opened.payload, messages.Receipt, max_bytes=limits.MAX_RECEIPT_BYTES)
    validate_receipt(receipt)
    if opened.audience != receipt.volunteer:
        raise ProtocolError(RejectCode.WRONG_AUDIENCE, "receipt sealed for another key than the one it names")
    if volunteer_key is not None and receipt.volunteer != volunteer_key:
        raise ProtocolError(RejectCode.WRONG_AUDIENCE, "receipt for another volunteer")
    return receipt


@dataclass
class Totals:
    batches: int = 0
    groups: int = 0
    completions: int = 0
    tokens: int = 0
    first_at: float = 0.0
    last_at: float = 0.0
    claimed_batches: int = 0  # the newest receipt's running totals (the coordinator's own count)
    claimed_tokens: int = 0

    def add(self, r: messages.Receipt) -> None:
        self.batches += 1
        self.groups += r.groups
        self.completions += r.completions
        self.tokens += r.tokens
        self.first_at = r.accepted_at if not self.first_at else min(self.first_at, r.accepted_at)
        if r.accepted_at >= self.last_at:
            self.last_at = r.accepted_at
            self.claimed_batches, self.claimed_tokens = r.total_batches, r.total_tokens


@dataclass
class LedgerTotals:
    """Verified sums per (run id, volunteer fingerprint)."""

    coordinator: str  # the coordinator key's fingerprint
    by_run: dict[tuple[str, str], Totals] = field(default_factory=dict)
    receipts: int = 0

    def as_dict(self) -> dict:
        return {"coordinator": self.coordinator, "receipts": self.receipts,
                "runs": [{"run_id": run, "volunteer": vol, "batches": t.batches, "groups": t.groups,
                          "completions": t.completions, "tokens": t.tokens, "first_at": t.first_at,
                          "last_at": t.last_at, "coordinator_running_total_batches": t.claimed_batches,
                          "coordinator_running_total_tokens": t.claimed_tokens}
                         for (run, vol), t in sorted(self.by_run.items())]}


class LedgerError(ProtocolError):
    """A ledger failed verification: `.index` is the offending receipt (0-based)."""

    def __init__(self, code: RejectCode, detail: str, index: int):
        super().__init__(code, f"receipt #{index}: {detail}")
        self.index = index

    def __reduce__(self):
        return (type(self), (self.code, self.detail, self.index))


def verify_receipts(sealed: list[bytes], *, coordinator_key: bytes,
                    volunteer_key: bytes | None = None) -> LedgerTotals:
    """Every receipt must verify, and no batch id may appear twice; raises LedgerError at the first one
    that fails."""
    totals = LedgerTotals(coordinator=fingerprint(coordinator_key))
    seen: set[tuple[str, bytes]] = set()
    for i, raw in enumerate(sealed):
        try:
            r = open_receipt(raw, coordinator_key=coordinator_key, volunteer_key=volunteer_key)
        except ProtocolError as exc:
            raise LedgerError(exc.code, exc.detail, i) from None
        if (r.run_id, r.batch_id) in seen:
            raise LedgerError(RejectCode.DUPLICATE_BATCH, f"batch {r.batch_id.hex()[:16]} counted twice", i)
        seen.add((r.run_id, r.batch_id))
        totals.by_run.setdefault((r.run_id, fingerprint(r.volunteer)), Totals()).add(r)
        totals.receipts += 1
    return totals


def export_document(sealed: list[bytes], *, coordinator_peer_id: str = "") -> dict:
    """The portable JSON form: receipts as base64 strings (the exact signed bytes)."""
    return {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "coordinator": coordinator_peer_id,
            "receipts": [base64.b64encode(r).decode() for r in sealed]}


def parse_export(doc) -> list[bytes]:
    """Sealed receipts from an `export_document` (MALFORMED for anything else)."""
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        raise ProtocolError(RejectCode.MALFORMED, f"not an {EXPORT_FORMAT} file")
    if doc.get("version") != EXPORT_VERSION:
        raise ProtocolError(RejectCode.UNSUPPORTED_VERSION, f"receipts file version {doc.get('version')!r}, "
                            f"this reader knows {EXPORT_VERSION}")
    items = doc.get("receipts")
    if not isinstance(items, list) or len(items) > MAX_EXPORT_RECEIPTS:
        raise ProtocolError(RejectCode.MALFORMED, "receipts must be a list")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, str) or len(item) > 2 * limits.MAX_RECEIPT_BYTES:
            raise ProtocolError(RejectCode.MALFORMED, f"receipt #{i} is not a base64 string")
        try:
            out.append(base64.b64decode(item, validate=True))
        except ValueError:
            raise ProtocolError(RejectCode.MALFORMED, f"receipt #{i} is not valid base64") from None
    return out
