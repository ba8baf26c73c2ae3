"""Poison prompts (coordinator/taskboard.py): a record that volunteers report unscorable (`LeaseRequest.unscorable`,
or ingest's own check failing) is retired once `prompt_max_failures` distinct keys reported it with no group of
it scored since — never re-leased forever, never in a later epoch, never by one key alone or by a silent expiry,
never beyond the retirement cap — and the books still balance."""

from __future__ import annotations

from asyncrl.coordinator import taskboard
from asyncrl.coordinator.taskboard import TaskBoard
from asyncrl.tasks import Prompt

KEYS = [bytes([i]) * 32 for i in range(1, 12)]


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def epochs(records: int):
    """A dataset of `records` records walked epoch after epoch, as tasks/sources.py does: new ids, same content."""
    n = 0
    while True:
        yield Prompt(prompt_id=f"d-{n}", text=f"q{n % records}", answer="1", reward="math")
        n += 1


def board(clock, failures=3, records=1000):
    return TaskBoard(epochs(records), lease_timeout_s=10.0, max_leases_per_client=8, lease_max_s=10.0,
                     prompt_max_failures=failures, clock=clock)


def report(b, key) -> str:
    """`key` takes the next prompt and reports it unscorable; the prompt's text."""
    (lease,) = b.lease(key, 1)
    assert b.report_unscorable([lease.lease_id], key) == 1
    return lease.prompt.text


def test_a_prompt_reported_by_three_distinct_keys_is_retired_and_never_leased_again():
    clock = FakeClock()
    b = board(clock)
    assert [report(b, k) for k in KEYS[:3]] == ["q0", "q0", "q0"]  # handed on at once twice, then retired
    (nxt,) = b.lease(KEYS[3], 1)
    assert nxt.prompt.text == "q1"
    c = b.counts()
    assert (c["retired"], c["returned"], c["released"], c["expired"]) == (1, 3, 2, 0)
    assert b.retired_prompt_ids() == ["d-0"]
    assert b.balanced(queued_groups=0)


def test_one_key_or_silent_expiries_never_retire_a_prompt():
    clock = FakeClock()
    b = board(clock)
    assert [report(b, KEYS[0]) for _ in range(5)] == ["q0"] * 5  # the same key, again and again
    for k in KEYS[1:6]:  # volunteers that vanish with it (crashed): not evidence against the prompt
        (lease,) = b.lease(k, 1)
        assert lease.prompt.text == "q0"
        clock.t += 11
        assert b.expire() == 1
    assert b.counts()["retired"] == 0 and b.balanced(queued_groups=0)


def test_a_scored_group_clears_the_reports_and_ingests_own_failures_count():
    clock = FakeClock()
    b = board(clock, failures=2)
    assert report(b, KEYS[0]) == "q0"
    (lease,) = b.lease(KEYS[1], 1)
    b.complete(lease.lease_id, KEYS[1])  # someone scored it after all: not poison
    assert b.counts()["retired"] == 0 and b._failures == {}
    assert report(b, KEYS[2]) == "q1"
    (lease,) = b.lease(KEYS[3], 1)  # q1 again; its batch reaches ingest, whose own check fails too
    assert lease.prompt.text == "q1"
    b.complete_all([lease.lease_id], KEYS[3], unscored={lease.lease_id})
    b.mark_dropped(1)  # as ingest does with a group it could not score
    b.note_unscorable([lease.prompt], KEYS[3])
    assert b.counts()["retired"] == 0  # settled: that group was completed (and dropped), nothing to take back
    assert b.retired_prompt_ids() == ["d-1"]  # but the record is retired: its later epochs are skipped
    assert b.balanced(queued_groups=1)


def test_a_retired_record_is_skipped_in_later_epochs_and_a_dataset_of_poison_grants_nothing():
    clock = FakeClock()
    b = board(clock, failures=2, records=3)
    assert [report(b, k) for k in KEYS[:2]] == ["q0", "q0"]  # record q0 retired
    granted = [l.prompt.text for l in b.lease(KEYS[2], 6)]
    assert granted == ["q1", "q2", "q1", "q2", "q1", "q2"]  # q0 never again, in any epoch
    assert b.counts()["skipped_retired"] == 2

    only_poison = board(clock, failures=2, records=1)
    report(only_poison, KEYS[0])
    report(only_poison, KEYS[1])
    assert only_poison.lease(KEYS[2], 4) == []  # bounded skipping, no spin
    assert only_poison.balanced(queued_groups=0)


def test_keys_that_call_everything_unscorable_retire_at_most_the_cap(monkeypatch):
    monkeypatch.setattr(taskboard, "RETIRE_FLOOR", 2)
    clock = FakeClock()
    b = board(clock, failures=2)
    for _ in range(6):  # two Sybil keys report every prompt they get
        report(b, KEYS[0])
        report(b, KEYS[1])
    c = b.counts()
    assert c["retired"] == 2 and c["retire_capped"] >= 1, c  # RETIRE_FRACTION x 12 grants < the floor of 2
    assert b.balanced(queued_groups=0)


def test_reports_survive_a_checkpoint_and_zero_never_retires():
    clock = FakeClock()
    b = board(clock)
    report(b, KEYS[0])
    report(b, KEYS[1])
    restored = board(clock)
    restored.restore(b.state())
    assert report(restored, KEYS[2]) == "q0"
    assert restored.counts()["retired"] == 1 and restored.balanced(queued_groups=0)
    (nxt,) = restored.lease(KEYS[3], 1)
    assert nxt.prompt.text == "q1"

    never = board(clock, failures=0)
    assert [report(never, k) for k in KEYS[:5]] == ["q0"] * 5
    assert never.counts()["retired"] == 0 and never.balanced(queued_groups=0)


def test_a_lease_whose_batch_is_being_verified_does_not_expire_under_our_checks():
    """Ingest holds a batch's leases while it scores them (coordinator/ingest.py): a verifier queue longer
    than the lease timeout must not turn a batch that arrived in time into UNKNOWN_LEASE."""
    clock = FakeClock()
    b = board(clock)
    (a, c) = b.lease(KEYS[0], 2)
    assert b.hold([a.lease_id, c.lease_id, "nope"], KEYS[0]) == [a.lease_id, c.lease_id]
    assert b.hold([a.lease_id], KEYS[1]) == []  # someone else's lease is not held for them
    clock.t += 60  # our checks took a minute
    assert b.expire() == 0
    assert [l.lease_id for l in b.complete_all([a.lease_id], KEYS[0])] == [a.lease_id]
    b.unhold([a.lease_id, c.lease_id])  # the other one's batch was refused: it expires at the next pass
    assert b.expire() == 1 and b.counts()["requeued_waiting"] == 1
    assert b.balanced(queued_groups=1)
