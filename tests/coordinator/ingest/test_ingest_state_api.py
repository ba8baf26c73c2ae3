"""Ingest's state API, what other modules use instead of its lock and fields: `snapshot` -> `restore_books`
(a checkpoint and --resume), `requeue` (the journal replay), `unqueue_groups` (the --sync round),
`load_seen` and `trust_view` (trust_state.py). Real keys and envelopes; no tokenizer, board or network: every
batch here is refused or deduplicated before its payload would need them.
"""

from __future__ import annotations

import threading

from asyncrl.coordinator.ingest.ingest import AcceptedBatch, Ingest
from asyncrl.coordinator.learner.learner import TrainGroup
from asyncrl.protocol import envelope
from asyncrl.protocol.identity import Identity

COORD = Identity.from_seed(bytes(range(32)))
ALICE = Identity.from_seed(bytes(range(1, 33)))
BOB = Identity.from_seed(bytes(range(2, 34)))
CAROL = Identity.from_seed(bytes(range(3, 35)))


def make(seen_path=None) -> Ingest:
    return Ingest(identity_public_key=COORD.public_key, run_id="r", board=None, tokenizer=None, vocab_size=64,
                  current_version=lambda: 0, max_batch_bytes=1 << 20, window_s=300, seen_path=seen_path)


def envelope_of(payload: bytes, who=ALICE) -> bytes:
    """A validly signed rollout-batch envelope (its payload need not decode)."""
    return envelope.seal(who, "rollout_batch", payload, audience=COORD.public_key)


def batch_id_of(data: bytes) -> bytes:
    return envelope.open_envelope(data, max_bytes=1 << 20, expected_kind="rollout_batch",
                                  expected_audience=COORD.public_key, window_s=300).payload_id


def accepted(data: bytes, n_groups: int) -> AcceptedBatch:
    groups = [TrainGroup([1, 2], [[3, 4]], [[-1.0, -1.0]], [1.0], 0) for _ in range(n_groups)]
    return AcceptedBatch(batch_id_of(data), "alice", groups, 1.0, 0, 0.0, signer=ALICE.fingerprint)


def test_snapshot_then_restore_books_carries_clients_nonces_and_seen_ids(tmp_path):
    seen_log = tmp_path / "seen_ids.log"
    before = make(seen_log)
    garbage = envelope_of(b"not a rollout batch")
    assert before.handle(garbage).code == "MALFORMED"  # signed: its nonce is spent and alice is booked
    before.note_client(BOB.public_key, "bob")
    on_disk, in_ckpt = envelope_of(b"accepted before the crash"), envelope_of(b"in the checkpoint's journal")
    before.requeue(accepted(on_disk, 1))
    before.save_seen()
    snap = before.snapshot()
    assert [(c["name"], c["rejected"]) for c in snap.clients] == [(ALICE.fingerprint, {"MALFORMED": 1}), ("bob", {})]

    after = make(seen_log)
    after.note_client(CAROL.public_key, "carol")  # replaced, not merged: the checkpoint's books are the truth
    after.restore_books(snap.replay_bytes(), snap.clients, {batch_id_of(in_ckpt)})
    assert after.snapshot().clients == snap.clients
    assert after.handle(garbage).code == "NONCE_REUSED"  # nonces stay single-use across the restore
    assert after.handle(on_disk).code == "DUPLICATE_BATCH"  # from the seen-ids file
    assert after.handle(in_ckpt).code == "DUPLICATE_BATCH"  # from the checkpoint
    assert after.handle(envelope_of(b"new")).code == "MALFORMED"  # anything else is still checked


def test_a_snapshot_is_a_copy_later_rejects_do_not_change():
    ingest = make()
    assert ingest.handle(envelope_of(b"x")).code == "MALFORMED"
    snap = ingest.snapshot()
    assert ingest.handle(envelope_of(b"y")).code == "MALFORMED"
    assert snap.clients[0]["rejected"] == {"MALFORMED": 1} and ingest.snapshot().clients[0]["rejected"] == {"MALFORMED": 2}


def test_requeue_puts_the_batch_on_the_queue_and_books_it_seen_and_queued():
    ingest = make()
    data = envelope_of(b"journalled")
    item = accepted(data, 2)
    ingest.requeue(item)
    assert ingest.queued() == 2 and ingest.handle(data).code == "DUPLICATE_BATCH"
    assert ingest.take(2, max_wait_s=60, min_groups=2, stop=threading.Event()) == [item]
    assert ingest.queued() == 0


def test_unqueue_groups_takes_groups_off_the_books_only():
    ingest = make()
    ingest.requeue(accepted(envelope_of(b"a"), 2))
    ingest.requeue(accepted(envelope_of(b"b"), 1))
    ingest.unqueue_groups(2)  # the --sync round took the first off the queue itself
    assert ingest.queued() == 1 and ingest.queue.qsize() == 2


def test_load_seen_merges_the_ids_another_process_saved(tmp_path):
    first, data = make(tmp_path / "seen_ids.log"), envelope_of(b"accepted")
    first.requeue(accepted(data, 1))
    assert first.save_seen() == 1
    restarted = make(tmp_path / "seen_ids.log")
    assert restarted.load_seen() == 1 and restarted.load_seen() == 0  # a second load adds nothing
    assert restarted.handle(data).code == "DUPLICATE_BATCH"


def test_trust_view_lists_the_most_recently_seen_clients_and_the_books():
    ingest = make()
    for who, name in ((ALICE, "alice"), (BOB, "bob"), (CAROL, "carol")):
        ingest.note_client(who.public_key, name)
    assert ingest.handle(envelope_of(b"x", who=ALICE)).code == "MALFORMED"  # alice is now the most recent
    ingest.requeue(accepted(envelope_of(b"seen"), 1))
    view = ingest.trust_view(2)
    assert list(view.clients) == [CAROL.fingerprint, ALICE.fingerprint]
    assert view.clients[ALICE.fingerprint] == {"name": "alice", "accepted": 0, "rejected": {"MALFORMED": 1}, "resent": 0}
    assert [v["code"] for v in view.verdicts] == ["MALFORMED"]
    assert view.books == {"clients_tracked": 3, "clients_forgotten": 0, "seen_ids": 1, "seen_forgotten": 0,
                          "unscorable_groups": 0}
