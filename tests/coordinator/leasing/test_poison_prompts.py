"""Poison prompts (leasing/taskboard.py): a record that volunteers report unscorable (`LeaseRequest.unscorable`,
or ingest's own check failing) is retired once `prompt_max_failures` distinct keys reported it with no group of
it scored since — never re-leased forever, never in a later epoch, never by one key alone or by a silent expiry,
never beyond the retirement cap — and the books still balance."""

from __future__ import annotations

from asyncrl.coordinator.leasing import taskboard
from asyncrl.coordinator.leasing.taskboard import TaskBoard
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


def board(clock, failures=3, records=1000, standing=None, source=None):
    return TaskBoard(source or epochs(records), lease_timeout_s=10.0, max_leases_per_client=8, lease_max_s=10.0,
                     prompt_max_failures=failures, clock=clock, standing=standing, records=records)


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
    # The same key reports every record it gets; it is never handed one it reported again.
    assert [report(b, KEYS[0]) for _ in range(5)] == ["q0", "q1", "q2", "q3", "q4"]
    for i, k in enumerate(KEYS[1:6]):  # volunteers that vanish with them (crashed): not evidence against them
        (lease,) = b.lease(k, 1)
        assert lease.prompt.text == f"q{i}"
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
    """Ingest holds a batch's leases while it scores them (coordinator/ingest/ingest.py): a verifier queue longer
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


SYBILS = [bytes([100 + i]) * 32 for i in range(30)]


def test_sybil_keys_reporting_every_record_retire_nothing_and_proven_keys_at_most_the_share():
    """30 fresh keys report every record of a 4-record task: none is retired (fresh keys together weigh at most
    one proven key's report), every lease is still granted; proven keys' reports retire at most RETIRE_SHARE."""
    clock = FakeClock()
    proven = set(KEYS[:4])
    b = board(clock, records=4, standing=lambda key: key in proven)
    for _ in range(4):
        for k in SYBILS:
            report(b, k)
    c = b.counts()
    assert c["retired"] == 0 and c["retired_records"] == 0, c
    assert sorted({l.prompt.text for l in b.lease(KEYS[0], 8)}) == ["q0", "q1", "q2", "q3"]  # the whole task
    # Two proven keys + the Sybils' weight (1) reach 3 on the records they report: one record of 4 is retired.
    b2 = board(clock, records=4, standing=lambda key: key in proven)
    texts = [report(b2, k) for k in SYBILS[:3] + KEYS[:2]]
    assert texts == ["q0"] * 5 and b2.counts()["retired_records"] == 1
    for k in SYBILS[:3] + KEYS[:3]:  # ...and q1 the same way: past the share of a 4-record task
        report(b2, k)
    c = b2.counts()
    assert c["retired_records"] == 1 and c["retire_capped"] >= 1, c
    assert {l.prompt.text for l in b2.lease(KEYS[3], 8)} == {"q1", "q2", "q3"}
    assert b2.balanced(queued_groups=0)


def test_resume_brings_back_a_record_set_retired_without_standing_evidence():
    """A checkpoint whose retired set covers the whole task (written before evidence was weighed: every record
    retired by Sybil reports) resumes with every record leased again; a retirement whose proven reporters were
    banned since comes back once the access books are loaded (`recheck_retired`)."""
    clock = FakeClock()
    b = board(clock, records=4)
    for k in KEYS[:3]:
        report(b, k)  # q0 retired by three keys that were proven then
    state = b.state()
    legacy = dict(state, retired_content=state["retired_content"] + ["a" * 32, "b" * 32, "c" * 32])
    del legacy["retired_evidence"]  # as an older coordinator wrote it
    restored = board(clock, records=4)
    restored.restore(legacy)
    assert restored.counts()["retired_records"] == 0 and restored.counts()["unretired"] == 4
    assert {l.prompt.text for l in restored.lease(KEYS[5], 8)} == {"q0", "q1", "q2", "q3"}

    banned = set()
    again = board(clock, records=4, standing=lambda key: key not in banned)
    again.restore(state)
    assert again.counts()["retired_records"] == 1  # its evidence is whole
    banned.update(KEYS[:2])  # the access books come back: two of its three reporters are banned
    assert again.recheck_retired() == 1
    assert again.counts()["retired_records"] == 0
    assert "q0" in {l.prompt.text for l in again.lease(KEYS[5], 4)}


class CountingSource:
    def __init__(self, inner):
        self.inner, self.drawn = inner, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.drawn += 1
        return next(self.inner)


def test_a_lease_call_skips_a_bounded_number_of_retired_records_in_all():
    clock = FakeClock()
    source = CountingSource(epochs(1))
    b = board(clock, failures=2, records=1, source=source)
    report(b, KEYS[0])
    report(b, KEYS[1])  # the task's only record retired
    drawn = source.drawn
    assert b.lease(KEYS[2], 8) == []
    assert source.drawn - drawn == taskboard.SOURCE_SKIP_BOUND  # for the whole call, not per prompt asked


def test_a_reported_record_waits_for_another_key_and_its_report_retires_it():
    """A reporter asking again (a pipelined volunteer asks at once) gets other work; the record goes to the next
    key, whose report is the second distinct one: retired, not bounced between one key and the requeue."""
    clock = FakeClock()
    b = board(clock, failures=2)
    assert report(b, KEYS[0]) == "q0"
    again = b.lease(KEYS[0], 3)  # the reporter, first in line again: q0 is not among its prompts
    assert [lease.prompt.text for lease in again] == ["q1", "q2", "q3"]
    assert report(b, KEYS[1]) == "q0"  # handed to the next key: the second distinct report retires it
    c = b.counts()
    assert (c["retired"], c["released"]) == (1, 1)
    assert [lease.prompt.text for lease in b.lease(KEYS[1], 2)] == ["q4", "q5"]
    assert b.balanced(queued_groups=0)
