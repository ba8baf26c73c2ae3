"""Ingest's commit order (journal -> all leases -> queue -> seen -> ack) and who pays for what, with real
keys, a real task board, a real journal and the tiny tokenizer (no network, no model).

An ack must mean "durable here", and nothing may be half-done: a failed journal write leaves no `seen`
id behind (so no DUPLICATE_BATCH ack for a batch that is nowhere), a lease that expired mid-batch leaves
the others outstanding, a copy of a volunteer's batch sent by someone else is charged to the sender, and
a completion our verifier cannot score drops its group without blaming anyone.
"""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl import tasks
from asyncrl.coordinator.ingest.ingest import Ingest
from asyncrl.coordinator.ingest.journal import IngestJournal
from asyncrl.coordinator.leasing.taskboard import TaskBoard
from asyncrl.coordinator.trust.access import AccessControl, AccessPolicy
from asyncrl.models import tinymodel
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity

COORD = Identity.from_seed(bytes(range(32)))
ALICE = Identity.from_seed(bytes(range(1, 33)))
SAMPLING = messages.SamplingParams(temperature=1.0, max_new_tokens=8)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class BrokenDisk(IngestJournal):
    """A journal whose next `fail` writes raise, as a full disk would."""

    fail = 0

    def put(self, batch) -> None:
        if self.fail:
            self.fail -= 1
            raise OSError(28, "No space left on device")
        super().put(batch)


@pytest.fixture(scope="module")
def tokenizer():
    return tinymodel.build_tokenizer()


def make(tokenizer, tmp_path, *, access=None, clock=None, queue_groups=256):
    clock = clock or Clock()
    board = TaskBoard(tasks.get_task("repeat", 0), lease_timeout_s=60, max_leases_per_client=8, clock=clock)
    journal = BrokenDisk(tmp_path / "journal")
    ingest = Ingest(identity_public_key=COORD.public_key, run_id="r", board=board, tokenizer=tokenizer, vocab_size=64,
                    current_version=lambda: 0, max_batch_bytes=1 << 20, window_s=300, access=access, sampling=SAMPLING,
                    journal=journal, queue_groups=queue_groups)
    return ingest, board, journal, clock


def sealed(ingest, tokenizer, leases, who=ALICE, letters=("aaaa", "abab"), reward=None) -> bytes:
    groups = []
    for lease in leases:
        ids = tokenizer(lease.prompt.text)["input_ids"]
        comps = []
        for text in letters:
            toks = tokenizer(text)["input_ids"]
            r = tasks.score(lease.prompt.reward, text, lease.prompt.answer) if reward is None else reward
            comps.append(messages.Completion(np.asarray(toks, "<i4").tobytes(), np.full(len(toks), -1.0, "<f4").tobytes(),
                                             r, "length"))
        groups.append(messages.RolloutGroup(lease.lease_id, lease.prompt.prompt_id, np.asarray(ids, "<i4").tobytes(),
                                            tuple(comps)))
    batch = messages.RolloutBatch(run_id="r", adapter_version=0, client_name="alice", sampling=SAMPLING,
                                  groups=tuple(groups), generated_at=0.0)
    return envelope.seal(who, "rollout_batch", messages.encode(batch), audience=COORD.public_key)


def test_a_failed_journal_write_leaves_nothing_behind(tokenizer, tmp_path):
    ingest, board, journal, _ = make(tokenizer, tmp_path)
    data = sealed(ingest, tokenizer, board.lease(ALICE.public_key, 2))
    journal.fail = 1
    ack = ingest.handle(data)
    assert not ack.accepted and ack.code == "INTERNAL"  # retryable: the client keeps its copy
    assert ack.batch_id not in ingest.seen and len(journal) == 0 and board.counts()["outstanding"] == 2
    retry = envelope.seal(ALICE, "rollout_batch", envelope.open_envelope(
        data, max_bytes=1 << 20, expected_kind="rollout_batch", expected_audience=None).payload, audience=COORD.public_key)
    again = ingest.handle(retry)  # never DUPLICATE_BATCH: that ack would delete a batch that is nowhere
    assert again.accepted and again.code is None
    assert journal.ids() == {again.batch_id} and again.batch_id in ingest.seen
    assert board.balanced(ingest.queued_groups)


def test_a_lease_expiring_mid_batch_settles_none_of_them(tokenizer, tmp_path):
    ingest, board, journal, clock = make(tokenizer, tmp_path)
    first = board.lease(ALICE.public_key, 1)
    clock.t += 30
    second = board.lease(ALICE.public_key, 1)  # expires 30 s after the first
    data = sealed(ingest, tokenizer, first + second)
    clock.t += 31  # the first lease is gone, the second is not
    ack = ingest.handle(data)
    assert ack.code == "UNKNOWN_LEASE"
    c = board.counts()
    assert c["completed"] == 0 and len(journal) == 0 and ack.batch_id not in ingest.seen
    assert c["expired"] == 2 and c["requeued_waiting"] == 2  # both prompts go to someone else: none vanished
    assert board.balanced(ingest.queued_groups)


def test_a_full_queue_after_the_leases_settled_reopens_them(tokenizer, tmp_path):
    ingest, board, journal, _ = make(tokenizer, tmp_path, queue_groups=1)
    occupier = sealed(ingest, tokenizer, board.lease(ALICE.public_key, 1))
    data = sealed(ingest, tokenizer, board.lease(ALICE.public_key, 1))
    assert ingest.handle(occupier).accepted
    import queue as queue_mod

    real_put = ingest.queue.put_nowait

    def full(item):  # the reservation makes this unreachable; prove the undo path anyway
        raise queue_mod.Full

    ingest.queue.get_nowait()  # room again for the reservation check...
    with ingest.lock:
        ingest.queued_groups -= 1
    ingest.queue.put_nowait = full  # ...but the put itself fails
    ack = ingest.handle(data)
    assert ack.code == "RATE_LIMITED" and ack.batch_id not in ingest.seen
    assert board.counts()["outstanding"] == 1 and journal.ids() == {ingest.accepted_log[0].batch_id}
    ingest.queue.put_nowait = real_put
    payload = envelope.open_envelope(data, max_bytes=1 << 20, expected_kind="rollout_batch",
                                     expected_audience=None).payload
    assert ingest.handle(envelope.seal(ALICE, "rollout_batch", payload, audience=COORD.public_key)).accepted
    # the client's retry (re-sealed at upload): its lease was still its own


def test_a_copy_sent_by_another_peer_is_charged_to_that_peer(tokenizer, tmp_path):
    clock = Clock()
    access = AccessControl(AccessPolicy(identity_rate_per_s=0.001, identity_burst=3, peer_rate_per_s=0.001,
                                        peer_burst=2), clock=clock, wall=clock)
    ingest, board, journal, _ = make(tokenizer, tmp_path, access=access, clock=clock)
    alice_peer = ALICE.peer_id
    first = sealed(ingest, tokenizer, board.lease(ALICE.public_key, 1))
    # Before alice has sent anything herself, copies from mallory's peer cost mallory's bucket, not hers.
    codes = [ingest.handle(first, peer="mallory-peer").code for _ in range(4)]
    assert codes[0] is None and codes[1:] == ["DUPLICATE_BATCH", "RATE_LIMITED", "RATE_LIMITED"]
    assert ingest.clients.get(ALICE.fingerprint).rejected == {}  # nothing booked against alice
    own = sealed(ingest, tokenizer, board.lease(ALICE.public_key, 1))
    assert ingest.handle(own, peer=alice_peer).accepted  # her bucket is untouched
    # Once alice has delivered from her own peer, copies of her batches from anyone else are refused.
    third = sealed(ingest, tokenizer, board.lease(ALICE.public_key, 1))
    assert [ingest.handle(third, peer=p).code for p in ("mallory-peer-2", "mallory-peer-3")] == ["NOT_ALLOWED"] * 2
    ack = ingest.handle(third, peer=alice_peer)
    assert ack.accepted  # the nonce was not spent by the copies
    assert ingest.clients.get(ALICE.fingerprint).rejected == {} and access.strikes(ALICE.public_key) == 0
    assert access.counters["foreign_refused"] == 2
    # The refusals are booked on the peers that sent the copies, not as verdicts on alice's batch.
    peers = access.status()["peers"]
    assert all(peers[p]["foreign_refused"] == 1 for p in ("mallory-peer-2", "mallory-peer-3"))
    assert [v["code"] for v in ingest.verdicts if v["batch_id"] == ack.batch_id.hex()] == ["ACCEPTED"]


def test_an_unscorable_completion_drops_its_group_without_blame(tokenizer, tmp_path, monkeypatch):
    access = AccessControl(AccessPolicy(max_strikes=1))
    ingest, board, journal, _ = make(tokenizer, tmp_path, access=access)

    def flaky(completion, answer):
        if completion == "zzzz":
            raise tasks.Unscorable("verifier timed out")
        return 1.0

    monkeypatch.setitem(tasks.REWARDS, "repeat", tasks.simple_reward(flaky))
    leases = board.lease(ALICE.public_key, 2)
    good = sealed(ingest, tokenizer, leases[:1], letters=("aaaa",), reward=1.0)
    groups = messages.decode(envelope.open_envelope(good, max_bytes=1 << 20, expected_kind="rollout_batch",
                                                    expected_audience=None).payload, messages.RolloutBatch,
                             max_bytes=1 << 20).groups
    bad = sealed(ingest, tokenizer, leases[1:], letters=("zzzz",), reward=1.0)
    bad_groups = messages.decode(envelope.open_envelope(bad, max_bytes=1 << 20, expected_kind="rollout_batch",
                                                        expected_audience=None).payload, messages.RolloutBatch,
                                 max_bytes=1 << 20).groups
    both = messages.RolloutBatch(run_id="r", adapter_version=0, client_name="alice", sampling=SAMPLING,
                                 groups=groups + bad_groups, generated_at=0.0)
    ack = ingest.handle(envelope.seal(ALICE, "rollout_batch", messages.encode(both), audience=COORD.public_key))
    assert ack.accepted and ack.code is None  # accepted: one group trained, the other dropped
    assert ingest.queued_groups == 1 and ingest.unscorable_groups == 1
    c = board.counts()
    assert c["completed"] == 2 and c["dropped"] == 1 and board.balanced(ingest.queued_groups)
    assert access.strikes(ALICE.public_key) == 0 and not access.is_banned(ALICE.public_key)
    assert [v["code"] for v in ingest.verdicts] == ["UNSCORABLE", "ACCEPTED"]


def test_a_copy_being_verified_is_asked_to_wait(tokenizer, tmp_path):
    ingest, board, journal, _ = make(tokenizer, tmp_path)
    data = sealed(ingest, tokenizer, board.lease(ALICE.public_key, 1))
    opened = envelope.open_envelope(data, max_bytes=1 << 20, expected_kind="rollout_batch", expected_audience=None)
    ingest._inflight.add(opened.payload_id)  # another handler thread is verifying the same batch right now
    assert ingest.handle(data).code == "RATE_LIMITED"
    ingest._inflight.clear()
    assert ingest.handle(envelope.seal(ALICE, "rollout_batch", opened.payload, audience=COORD.public_key)).accepted


def test_the_books_are_one_read_that_later_batches_do_not_change(tokenizer, tmp_path):
    ingest, board, _, _ = make(tokenizer, tmp_path)
    assert ingest.handle(sealed(ingest, tokenizer, board.lease(ALICE.public_key, 2))).accepted
    books = ingest.books()
    assert books.accepted_total == 1 and books.queued_groups == 2 and ingest.clients_known() == 1
    assert [(c["fingerprint"], c["accepted"]) for c in books.clients] == [(ALICE.fingerprint, 1)]
    assert ingest.handle(sealed(ingest, tokenizer, board.lease(ALICE.public_key, 1))).accepted
    assert books.accepted_total == 1 and books.clients[0]["accepted"] == 1  # a copy, not a view of the books
    now = ingest.books()
    assert now.accepted_total == 2 and now.queued_groups == 3 and now.clients[0]["accepted"] == 2
    assert ingest.accepted_count() == 2 and [r.seq for r in ingest.accepted_since(1)] == [1]  # the next one is #2
