"""Every accepted batch's ack carries a signed receipt with running totals that outlive a restart."""

from __future__ import annotations

from asyncrl.coordinator.ingest.receipts import ReceiptDesk
from asyncrl.protocol import receipts
from asyncrl.protocol.identity import fingerprint

from tests.coordinator.ingest.test_ingest_trust import ALICE, COORD, MALLORY, make_ingest, sealed_batch, tokenizer  # noqa: F401 (fixture)


def test_acks_carry_receipts_with_running_totals(tokenizer, tmp_path):
    ingest = make_ingest(tokenizer)
    ingest.receipts = ReceiptDesk(COORD, "r", tmp_path / "receipts.bin")
    acks = [ingest.handle(sealed_batch(ingest, tokenizer)) for _ in range(3)]
    assert all(a.accepted and a.receipt for a in acks)
    opened = [receipts.open_receipt(a.receipt, coordinator_key=COORD.public_key, volunteer_key=ALICE.public_key)
              for a in acks]
    assert [r.seq for r in opened] == [1, 2, 3]
    assert [r.batch_id for r in opened] == [a.batch_id for a in acks]
    assert all(r.groups == 1 and r.completions == 2 and r.tokens > 0 for r in opened)
    assert opened[-1].total_tokens == sum(r.tokens for r in opened)
    summary = ingest.receipts.summary()[fingerprint(ALICE.public_key)]
    assert summary == {"batches": 3, "groups": 3, "tokens": opened[-1].total_tokens}

    # a lost ack's retry gets the very same receipt; a restarted desk continues the totals from its log
    sealed = sealed_batch(ingest, tokenizer)
    first = ingest.handle(sealed)
    again = ingest.handle(sealed)
    assert again.code == "DUPLICATE_BATCH" and again.receipt == first.receipt
    restarted = ReceiptDesk(COORD, "r", tmp_path / "receipts.bin")
    assert restarted.summary() == ingest.receipts.summary()
    assert restarted.lookup(first.batch_id, ALICE.public_key) == first.receipt


def test_rejected_batches_get_no_receipt(tokenizer, tmp_path):
    ingest = make_ingest(tokenizer)
    ingest.receipts = ReceiptDesk(COORD, "r", tmp_path / "receipts.bin")
    sealed = bytearray(sealed_batch(ingest, tokenizer))
    sealed[-1] ^= 1
    ack = ingest.handle(bytes(sealed))
    assert not ack.accepted and ack.code == "SIGNATURE_MISMATCH" and ack.receipt == b""
    assert ingest.receipts.summary() == {}


def test_a_restart_reads_the_totals_snapshot_and_replays_only_the_log_after_it(tokenizer, tmp_path, monkeypatch):
    from asyncrl.coordinator.ingest import receipts as desk_module

    monkeypatch.setattr(desk_module, "SNAPSHOT_EVERY", 2)
    desk = ReceiptDesk(COORD, "r", tmp_path / "receipts.bin")
    for i in range(5):
        desk.issue(ALICE.public_key, bytes([i]) * 32, adapter_version=0, groups=1, completions=2, tokens=10)
    snap = __import__("json").loads((tmp_path / "receipts.bin.totals.json").read_text())
    assert snap["totals"][ALICE.public_key.hex()] == [4, 4, 40]  # the 5th receipt is only in the log
    again = ReceiptDesk(COORD, "r", tmp_path / "receipts.bin")
    assert again.summary() == desk.summary() == {fingerprint(ALICE.public_key): {"batches": 5, "groups": 5,
                                                                                 "tokens": 50}}
    assert again.lookup(bytes([4]) * 32, ALICE.public_key) == desk.lookup(bytes([4]) * 32, ALICE.public_key) != b""  # replayed after the snapshot


def test_a_receipt_goes_only_to_its_owner(tokenizer, tmp_path):
    """mallory re-seals alice's accepted payload under her own key (same batch id: DUPLICATE_BATCH), or delivers
    a copy of alice's envelope from her own peer: "accepted", but no receipt of alice's; alice's own retry
    still gets it."""
    from asyncrl.protocol import envelope

    ingest = make_ingest(tokenizer)
    ingest.receipts = ReceiptDesk(COORD, "r", tmp_path / "receipts.bin")
    sealed = sealed_batch(ingest, tokenizer)
    first = ingest.handle(sealed, ALICE.peer_id)
    assert first.accepted and first.receipt
    payload = envelope.open_envelope(sealed, max_bytes=1 << 20, expected_kind="rollout_batch",
                                     expected_audience=COORD.public_key, window_s=None).payload
    resealed = envelope.seal(MALLORY, "rollout_batch", payload, audience=COORD.public_key)
    stolen = ingest.handle(resealed, MALLORY.peer_id)
    assert stolen.code == "DUPLICATE_BATCH" and stolen.batch_id == first.batch_id and stolen.receipt == b""
    copy = ingest.handle(sealed, MALLORY.peer_id)  # her envelope, from another peer
    assert copy.code == "DUPLICATE_BATCH" and copy.receipt == b""
    own = ingest.handle(sealed, ALICE.peer_id)
    assert own.code == "DUPLICATE_BATCH" and own.receipt == first.receipt

    # a copy of a new batch of hers that arrives from another peer first: accepted, receipted to her, not handed out
    sealed = sealed_batch(ingest, tokenizer)
    relayed = ingest.handle(sealed, MALLORY.peer_id)
    assert relayed.accepted and relayed.code is None and relayed.receipt == b""
    assert ingest.handle(sealed, ALICE.peer_id).receipt != b""
