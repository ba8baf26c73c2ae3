"""Outbox: payloads (not sealed envelopes) spooled atomically, survive restarts, bounded; quarantine sets a
batch aside without deleting it; older clients' sealed spool files are converted."""

import hashlib
import json

import pytest

from asyncrl.client.outbox import Outbox, OutboxFull
from asyncrl.protocol import envelope
from asyncrl.protocol.identity import Identity


def test_put_pending_read_remove_roundtrip(tmp_path):
    box = Outbox(tmp_path / "o")
    first, second = box.put(b"first"), box.put(b"second")
    assert first == hashlib.sha256(b"first").digest()  # the batch id is the payload hash
    assert len(box) == 2 and set(box.pending()) == {first, second}
    box.remove(first)
    assert [box.read(b) for b in box.pending()] == [b"second"]


def test_requeue_moves_a_batch_behind_the_others(tmp_path):
    box = Outbox(tmp_path / "o")
    ids = [box.put(f"b{i}".encode()) for i in range(3)]
    import os

    for i, b in enumerate(ids):  # distinct, ordered times regardless of the file system's clock resolution
        os.utime(box.path / f"{b.hex()}.payload", ns=(i * 10**9, i * 10**9))
    box.requeue(ids[0])
    assert box.pending() == [ids[1], ids[2], ids[0]]


def test_survives_restart_and_drops_half_written_files(tmp_path):
    box = Outbox(tmp_path / "o")
    kept = box.put(b"kept")
    (tmp_path / "o" / (".x.payload.1.2.tmp")).write_bytes(b"half a batch")  # a crash mid-write
    again = Outbox(tmp_path / "o")
    assert [again.read(b) for b in again.pending()] == [b"kept"] and again.pending() == [kept]
    assert not list((tmp_path / "o").glob("*.tmp"))


def test_disk_cap_refuses_instead_of_growing(tmp_path):
    box = Outbox(tmp_path / "o", max_bytes=100)
    box.put(b"x" * 60)
    with pytest.raises(OutboxFull):
        box.put(b"y" * 60)
    assert len(box) == 1


def test_quarantine_keeps_the_batch_and_why_out_of_the_line(tmp_path):
    box = Outbox(tmp_path / "o", max_bytes=100)
    big = box.put(b"z" * 90)
    box.quarantine(big, "PAYLOAD_TOO_LARGE", "cap 64")
    assert box.pending() == [] and box.size_bytes() == 0  # no longer blocks the line nor the cap
    assert (box.quarantine_path / f"{big.hex()}.payload").read_bytes() == b"z" * 90  # never deleted unread
    note = box.quarantined()[0]
    assert note["code"] == "PAYLOAD_TOO_LARGE" and note["batch_id"] == big.hex() and note["bytes"] == 90
    box.put(b"w" * 60)  # room again
    assert Outbox(tmp_path / "o").quarantined() == [note]  # and after a restart


def test_sealed_spool_files_of_older_clients_become_payloads(tmp_path):
    me, coordinator = Identity.generate(), Identity.generate()
    d = tmp_path / "o"
    d.mkdir()
    sealed = envelope.seal(me, "rollout_batch", b"an old payload", audience=coordinator.public_key, now=1.0)
    batch_id = hashlib.sha256(b"an old payload").digest()
    (d / f"{batch_id.hex()}.batch").write_bytes(sealed)
    (d / f"{'ab' * 32}.batch").write_bytes(b"not an envelope")
    box = Outbox(d)
    assert box.migrated == 1 and box.pending() == [batch_id] and box.read(batch_id) == b"an old payload"
    assert [n["code"] for n in box.quarantined()] == ["MALFORMED"]  # unreadable: set aside, not deleted
    assert (box.quarantine_path / f"{'ab' * 32}.batch").exists()
    assert json.loads((box.quarantine_path / f"{'ab' * 32}.json").read_text())["batch_id"] == "ab" * 32
