"""Contribution receipts verify offline against the coordinator key, and only then (protocol/receipts.py)."""

from __future__ import annotations

import hashlib

import pytest

from asyncrl.protocol import messages, receipts
from asyncrl.protocol.atomic import append_record, read_records
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity, fingerprint

COORD = Identity.from_seed(bytes(range(32)))
MALLORY = Identity.from_seed(bytes(range(2, 34)))
ALICE = Identity.from_seed(bytes(range(1, 33)))
BOB = Identity.from_seed(bytes(range(3, 35)))


def receipt(n: int, who=ALICE, tokens: int = 10, run: str = "r") -> messages.Receipt:
    return messages.Receipt(run_id=run, volunteer=who.public_key, batch_id=hashlib.sha256(bytes([n])).digest(),
                            seq=n, adapter_version=n, groups=2, completions=8, tokens=tokens, accepted_at=1000.0 + n,
                            total_batches=n, total_groups=2 * n, total_tokens=tokens * n)


def ledger(n: int, signer=COORD) -> list[bytes]:
    return [receipts.seal_receipt(signer, receipt(i)) for i in range(1, n + 1)]


def test_a_ledger_verifies_and_sums_its_receipts():
    totals = receipts.verify_receipts(ledger(3), coordinator_key=COORD.public_key, volunteer_key=ALICE.public_key)
    t = totals.by_run[("r", fingerprint(ALICE.public_key))]
    assert (t.batches, t.groups, t.completions, t.tokens) == (3, 6, 24, 30)
    assert (t.claimed_batches, t.claimed_tokens) == (3, 30)  # the newest receipt's running totals
    assert totals.receipts == 3


def test_a_tampered_receipt_fails_with_its_index():
    sealed = ledger(3)
    body = bytearray(sealed[1])
    body[-3] ^= 0x01  # a flipped bit in the signed body (e.g. more tokens)
    sealed[1] = bytes(body)
    with pytest.raises(receipts.LedgerError) as err:
        receipts.verify_receipts(sealed, coordinator_key=COORD.public_key)
    assert err.value.code is RejectCode.SIGNATURE_MISMATCH and err.value.index == 1


def test_a_receipt_signed_by_another_key_fails():
    sealed = ledger(2) + [receipts.seal_receipt(MALLORY, receipt(3))]
    with pytest.raises(receipts.LedgerError) as err:
        receipts.verify_receipts(sealed, coordinator_key=COORD.public_key)
    assert err.value.code is RejectCode.NOT_ALLOWED and err.value.index == 2


def test_a_header_key_swapped_for_the_coordinators_fails_the_signature():
    forged = receipts.seal_receipt(MALLORY, receipt(1))
    forged = forged[:4] + COORD.public_key + forged[36:]  # claims to be the coordinator's
    with pytest.raises(ProtocolError) as err:
        receipts.open_receipt(forged, coordinator_key=COORD.public_key)
    assert err.value.code is RejectCode.SIGNATURE_MISMATCH


def test_a_batch_counted_twice_fails():
    sealed = ledger(2)
    with pytest.raises(receipts.LedgerError) as err:
        receipts.verify_receipts(sealed + [sealed[0]], coordinator_key=COORD.public_key)
    assert err.value.code is RejectCode.DUPLICATE_BATCH and err.value.index == 2


def test_another_volunteers_receipt_fails_when_the_volunteer_is_named():
    sealed = ledger(1) + [receipts.seal_receipt(COORD, receipt(2, who=BOB))]
    with pytest.raises(receipts.LedgerError) as err:
        receipts.verify_receipts(sealed, coordinator_key=COORD.public_key, volunteer_key=ALICE.public_key)
    assert err.value.code is RejectCode.WRONG_AUDIENCE and err.value.index == 1


def test_a_receipt_sealed_for_someone_else_than_it_names_fails():
    from asyncrl.protocol import envelope

    sealed = envelope.seal(COORD, receipts.RECEIPT_KIND, messages.encode(receipt(1)), audience=BOB.public_key)
    with pytest.raises(ProtocolError) as err:
        receipts.open_receipt(sealed, coordinator_key=COORD.public_key)
    assert err.value.code is RejectCode.WRONG_AUDIENCE


def test_inconsistent_running_totals_are_malformed():
    bad = messages.Receipt(**{**{f: getattr(receipt(3), f) for f in receipt(3).__struct_fields__}, "total_batches": 2})
    with pytest.raises(ProtocolError) as err:
        receipts.open_receipt(receipts.seal_receipt(COORD, bad), coordinator_key=COORD.public_key)
    assert err.value.code is RejectCode.MALFORMED


def test_export_round_trip_and_bad_files():
    sealed = ledger(2)
    doc = receipts.export_document(sealed, coordinator_peer_id=COORD.peer_id)
    assert receipts.parse_export(doc) == sealed
    for bad, code in (({"format": "other"}, RejectCode.MALFORMED),
                      ({**doc, "version": 9}, RejectCode.UNSUPPORTED_VERSION),
                      ({**doc, "receipts": "x"}, RejectCode.MALFORMED),
                      ({**doc, "receipts": ["not base64!"]}, RejectCode.MALFORMED),
                      ([], RejectCode.MALFORMED)):
        with pytest.raises(ProtocolError) as err:
            receipts.parse_export(bad)
        assert err.value.code is code


def test_record_log_survives_a_torn_append(tmp_path):
    path = tmp_path / "log"
    good = 0
    for r in (b"one", b"two"):
        good = append_record(path, r, good_length=good)
    with open(path, "ab") as f:  # a crash halfway through the third append
        f.write((100).to_bytes(4, "big") + b"par")
    records, length = read_records(path)
    assert records == [b"one", b"two"] and length == good
    append_record(path, b"three", good_length=length)  # cuts the torn tail first
    assert read_records(path)[0] == [b"one", b"two", b"three"]
