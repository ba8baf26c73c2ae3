"""TaskBoard books: leases expire and are re-leased, counters balance, state survives a round trip."""

from __future__ import annotations

import json

from asyncrl.coordinator.leasing.taskboard import LeaseRejected, TaskBoard
from asyncrl.tasks.sources import open_source

ALICE, BOB = b"a" * 32, b"b" * 32


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def board(clock, timeout=10.0):
    return TaskBoard(open_source("repeat", seed=3), lease_timeout_s=timeout, max_leases_per_client=8, clock=clock)


def test_expired_leases_are_released_to_someone_else_and_the_books_balance():
    clock = FakeClock()
    b = board(clock)
    alice = b.lease(ALICE, 4)
    clock.t += 11  # alice vanished
    bob = b.lease(BOB, 6)
    assert [l.prompt.prompt_id for l in bob[:4]] == [l.prompt.prompt_id for l in alice]
    for lease in bob[:3]:
        b.complete(lease.lease_id, BOB)
    try:
        b.complete(alice[0].lease_id, ALICE)
        raise AssertionError("an expired lease was accepted")
    except LeaseRejected:
        pass
    b.mark_trained(2)
    b.mark_dropped(1)
    c = b.counts()
    assert (c["leased"], c["expired"], c["released"], c["completed"], c["outstanding"]) == (10, 4, 4, 3, 3)
    assert b.balanced(queued_groups=0)
    assert not b.balanced(queued_groups=1)


def test_state_round_trip_continues_the_prompt_stream_and_refreshes_leases():
    clock = FakeClock()
    b = board(clock)
    held = b.lease(ALICE, 3)
    clock.t += 11
    b.lease(BOB, 1)  # takes one requeued prompt; two still wait
    state = json.loads(json.dumps(b.state()))  # JSON-able
    counts = b.counts()
    after = [l.prompt for l in b.lease(BOB, 4)]

    clock.t += 1000  # the coordinator was down for a long time
    restored = board(clock)
    restored.restore(state)
    assert restored.counts() == counts
    again = [l.prompt for l in restored.lease(BOB, 4)]
    assert again == after  # same requeued prompts, then the source continues where it was
    bob_first = state["outstanding"][0]["lease_id"]
    restored.complete(bob_first, BOB)  # a checkpointed lease is still honoured after a long outage
    assert held[0].lease_id not in {d["lease_id"] for d in state["outstanding"]}


def test_settle_replayed_accounts_wherever_the_prompt_is():
    clock = FakeClock()
    b = board(clock)
    outstanding = b.lease(ALICE, 2)
    state = b.state()
    later = b.lease(ALICE, 1)[0]  # granted after the "checkpoint"

    restored = board(clock)
    restored.restore(state)
    restored.settle_replayed(outstanding[0].prompt.prompt_id)  # was outstanding in the checkpoint
    restored.settle_replayed(later.prompt.prompt_id)  # the checkpoint never saw this lease
    got = restored.lease(BOB, 2)
    assert later.prompt.prompt_id not in {l.prompt.prompt_id for l in got}  # never handed out twice
    restored.mark_trained(2)
    assert restored.balanced(queued_groups=0)
    c = restored.counts()
    assert (c["completed"], c["outstanding"]) == (2, 3)


def test_a_refused_batchs_leases_end_at_once_and_only_for_their_holder():
    clock = FakeClock()
    b = board(clock)
    held = b.lease(ALICE, 2)
    assert b.abandon([l.lease_id for l in held], BOB) == 0  # not bob's to end
    assert b.abandon([held[0].lease_id, "no-such-lease"], ALICE) == 1
    assert b.lease(BOB, 1)[0].prompt == held[0].prompt  # re-leased without waiting for the timeout
    c = b.counts()
    assert (c["expired"], c["released"], c["outstanding"]) == (1, 1, 2)
    assert b.balanced(queued_groups=0)


def test_expiry_is_exact_with_thousands_of_leases_and_settled_ones_leave_no_trace():
    clock = FakeClock()
    b = TaskBoard(open_source("repeat", seed=3), lease_timeout_s=10, max_leases_per_client=10**6, clock=clock)
    early = b.lease(ALICE, 2000)
    clock.t += 5
    late = b.lease(BOB, 2000)
    for lease in early[:500]:
        b.complete(lease.lease_id, ALICE)  # settled: its heap entry must not expire it again
    b.abandon([l.lease_id for l in early[500:700]], ALICE)
    clock.t += 6  # the rest of `early` expired, `late` not yet
    assert b.expire() == 1300
    assert b.held_by_client() == {BOB: 2000}
    clock.t += 5
    assert b.expire() == 2000 and b.held_by_client() == {}
    c = b.counts()
    assert (c["leased"], c["completed"], c["expired"], c["outstanding"]) == (4000, 500, 3500, 0)
    assert len(b._expiry) <= 64  # rebuilt once settled entries pile up: memory stays bounded


def test_completing_a_whole_batch_frees_the_volunteers_share_and_reopening_takes_it_back():
    b = board(FakeClock())
    first = b.lease(ALICE, 8)  # max_leases_per_client = 8: her share is full
    assert b.lease(ALICE, 1) == []
    done = b.complete_all([l.lease_id for l in first[:4]], ALICE)
    assert b.held_by_client() == {ALICE: 4}
    b.reopen(done)  # the batch could not be queued: the same leases are hers again
    assert b.held_by_client() == {ALICE: 8} and b.lease(ALICE, 1) == []
    b.complete_all([l.lease_id for l in first], ALICE)
    assert b.held_by_client() == {}
    assert len(b.lease(ALICE, 8)) == 8  # a volunteer that delivered everything may lease a full share again
