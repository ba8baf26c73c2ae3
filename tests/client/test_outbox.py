"""Outbox: atomic spool, survives restarts, bounded."""

import pytest

from asyncrl.client.outbox import Outbox, OutboxFull


def test_put_pending_remove_roundtrip(tmp_path):
    box = Outbox(tmp_path / "o")
    box.put(b"\x01" * 32, b"first")
    box.put(b"\x02" * 32, b"second")
    assert len(box) == 2
    assert {bid for bid, _ in box.pending()} == {b"\x01" * 32, b"\x02" * 32}
    box.remove(b"\x01" * 32)
    assert [data for _, data in box.pending()] == [b"second"]


def test_survives_restart_and_drops_half_written_files(tmp_path):
    box = Outbox(tmp_path / "o")
    box.put(b"\x03" * 32, b"kept")
    (tmp_path / "o" / ("04" * 32 + ".tmp")).write_bytes(b"half a batch")  # a crash mid-write
    again = Outbox(tmp_path / "o")
    assert [data for _, data in again.pending()] == [b"kept"]
    assert not list((tmp_path / "o").glob("*.tmp"))


def test_disk_cap_refuses_instead_of_growing(tmp_path):
    box = Outbox(tmp_path / "o", max_bytes=100)
    box.put(b"\x05" * 32, b"x" * 60)
    with pytest.raises(OutboxFull):
        box.put(b"\x06" * 32, b"y" * 60)
    assert len(box) == 1
