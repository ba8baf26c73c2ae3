"""SyncRound (the --sync baseline): one grant per live volunteer per version; a step only when every
live volunteer delivered. Real TaskBoard and Ingest queue; accepted batches are placed on the queue
the way Ingest.handle does after verification (the verification itself is Ingest's business)."""

from __future__ import annotations

import pytest

from asyncrl import tasks
from asyncrl.coordinator.ingest.ingest import AcceptedBatch, Ingest
from asyncrl.coordinator.learner.learner import TrainGroup
from asyncrl.coordinator.leasing.sync_round import SyncRound
from asyncrl.coordinator.leasing.taskboard import TaskBoard
from asyncrl.protocol.identity import fingerprint

ALICE, BOB, CAROL = b"a" * 32, b"b" * 32, b"c" * 32
POLL = 0.005


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StopAfter:
    """A stop event that reads "set" after `n` checks: a take() that would block gives up deterministically
    (and a take() that should return but does not fails the test instead of hanging it)."""

    def __init__(self, n: int):
        self.n = n

    def is_set(self) -> bool:
        self.n -= 1
        return self.n < 0


@pytest.fixture
def swarm():
    clock = FakeClock()
    board = TaskBoard(tasks.get_task("repeat", 0), lease_timeout_s=30.0, max_leases_per_client=8, clock=clock)
    ingest = Ingest(identity_public_key=b"k" * 32, run_id="t", board=board, tokenizer=None, vocab_size=64,
                    current_version=lambda: 0, max_batch_bytes=1 << 20, window_s=300.0)
    return clock, board, ingest, SyncRound(ingest, board, live_s=60.0, clock=clock)


def deliver(ingest: Ingest, board: TaskBoard, signer: bytes, leases, version: int) -> None:
    """What Ingest.handle does for a verified batch: complete the leases, queue the groups, log it."""
    groups = []
    for lease in leases:
        board.complete(lease.lease_id, signer)
        groups.append(TrainGroup([1, 2], [[3], [4]], [[-1.0], [-1.0]], [0.0, 1.0], version))
    item = AcceptedBatch(b"id", "name", groups, 0.5, version, 0.0, signer=fingerprint(signer))
    ingest.queue.put_nowait(item)
    with ingest.lock:
        ingest.queued_groups += len(groups)
        ingest.log_accepted(item)


def signers(items) -> set[str]:
    return {x.signer for x in items}


def test_step_waits_for_every_live_volunteer(swarm):
    clock, board, ingest, rnd = swarm
    a, b = rnd.lease(ALICE, 0, 0, 4), rnd.lease(BOB, 0, 0, 4)
    assert len(a) == 4 and len(b) == 4
    deliver(ingest, board, ALICE, a, 0)
    assert rnd.take(0, StopAfter(20), poll_s=POLL) == []  # bob is live and owes his batch: no step
    assert ingest.queued_groups == 4  # alice's groups wait for the round (still counted as queued)
    deliver(ingest, board, BOB, b, 0)
    got = rnd.take(0, StopAfter(1000), poll_s=POLL)
    assert signers(got) == {fingerprint(ALICE), fingerprint(BOB)}
    assert sum(len(x.groups) for x in got) == 8 and ingest.queued_groups == 0


def test_a_volunteer_that_stopped_asking_stops_gating_the_round(swarm):
    clock, board, ingest, rnd = swarm
    a, b = rnd.lease(ALICE, 0, 0, 2), rnd.lease(BOB, 0, 0, 2)
    rnd.lease(CAROL, 0, 0, 2)
    deliver(ingest, board, ALICE, a, 0)
    deliver(ingest, board, BOB, b, 0)
    assert rnd.take(0, StopAfter(20), poll_s=POLL) == []  # carol is live and owes a batch
    assert rnd.live() == {fingerprint(x) for x in (ALICE, BOB, CAROL)}
    clock.now += 61.0  # carol went silent for longer than live_s; alice and bob still ask
    assert rnd.lease(ALICE, 0, 0, 2) == [] and rnd.lease(BOB, 0, 0, 2) == []  # they delivered already
    got = rnd.take(0, StopAfter(1000), poll_s=POLL)
    assert signers(got) == {fingerprint(ALICE), fingerprint(BOB)}


def test_one_grant_per_round_and_only_at_the_current_version(swarm):
    clock, board, ingest, rnd = swarm
    first = rnd.lease(ALICE, 0, 0, 4)
    assert len(first) == 4
    assert rnd.lease(ALICE, 0, 0, 4) == []  # its leases are outstanding
    deliver(ingest, board, ALICE, first, 0)
    assert rnd.lease(ALICE, 0, 0, 4) == []  # delivered: done for this round
    got = rnd.take(0, StopAfter(1000), poll_s=POLL)
    assert len(got) == 1 and got[0].version == 0
    # the learner stepped and published v1: a volunteer still on v0 waits until it has loaded v1
    assert rnd.lease(ALICE, 0, 1, 4) == []
    assert len(rnd.lease(ALICE, 1, 1, 4)) == 4
    assert rnd.rounds == 2


def test_a_lost_batch_is_granted_again(swarm):
    clock, board, ingest, rnd = swarm
    assert len(rnd.lease(ALICE, 0, 0, 2)) == 2 and rnd.lease(ALICE, 0, 0, 2) == []
    clock.now += 31.0  # lease_timeout_s passed: its leases expired (the batch was lost or rejected)
    assert len(rnd.lease(ALICE, 0, 0, 2)) == 2


def test_late_batches_from_an_earlier_version_are_dropped_and_counted(swarm):
    clock, board, ingest, rnd = swarm
    late = rnd.lease(BOB, 0, 0, 2)
    a = rnd.lease(ALICE, 1, 1, 2)  # the round for v1 began; bob's v0 batch arrives late
    deliver(ingest, board, BOB, late, 0)
    deliver(ingest, board, ALICE, a, 1)
    clock.now += 61.0
    rnd.lease(ALICE, 1, 1, 2)  # alice is still around, bob is not
    got = rnd.take(1, StopAfter(1000), poll_s=POLL)
    assert signers(got) == {fingerprint(ALICE)}
    assert rnd.dropped_groups == 2 and board.counts()["dropped"] == 2
    assert ingest.queued_groups == 0
