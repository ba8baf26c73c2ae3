"""Poison prompts (coordinator/taskboard.py): a prompt whose leases keep ending without a group is retired
once leases of it held by `prompt_max_failures` distinct keys expired or were abandoned — never re-leased
forever, never retired by one key alone, and the books still balance."""

from __future__ import annotations

from asyncrl.coordinator.taskboard import TaskBoard
from asyncrl.tasks import Prompt

KEYS = [bytes([i]) * 32 for i in range(1, 6)]


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def prompts():
    i = 0
    while True:
        yield Prompt(prompt_id=f"p{i}", text="rep:a=", answer="a", reward="repeat")
        i += 1


def board(clock, failures=3):
    return TaskBoard(prompts(), lease_timeout_s=10.0, max_leases_per_client=8, lease_max_s=10.0,
                     prompt_max_failures=failures, clock=clock)


def fail(b, clock, key):
    """`key` takes the next prompt and lets it expire; the prompt id it held."""
    (lease,) = b.lease(key, 1)
    clock.t += 11
    b.expire()
    return lease.prompt.prompt_id


def test_a_prompt_abandoned_by_three_distinct_keys_is_retired_and_never_leased_again():
    clock = FakeClock()
    b = board(clock)
    assert [fail(b, clock, k) for k in KEYS[:3]] == ["p0", "p0", "p0"]  # re-leased twice, then retired
    (nxt,) = b.lease(KEYS[3], 1)
    assert nxt.prompt.prompt_id == "p1"
    c = b.counts()
    assert (c["retired"], c["expired"], c["released"]) == (1, 3, 2)
    assert list(b.retired_ids) == ["p0"]
    assert b.balanced(queued_groups=0)


def test_one_key_cannot_retire_a_prompt_alone_and_an_abandoned_batch_counts_as_its_signers_failure():
    clock = FakeClock()
    b = board(clock)
    assert [fail(b, clock, KEYS[0]) for _ in range(5)] == ["p0"] * 5  # the same key, again and again
    assert b.counts()["retired"] == 0
    (lease,) = b.lease(KEYS[1], 1)
    assert b.abandon([lease.lease_id], KEYS[1]) == 1  # its batch was refused: a failure of that key
    assert fail(b, clock, KEYS[2]) == "p0"
    assert b.counts()["retired"] == 1 and b.balanced(queued_groups=0)


def test_a_completed_group_clears_the_prompts_failures():
    clock = FakeClock()
    b = board(clock, failures=2)
    assert fail(b, clock, KEYS[0]) == "p0"
    (lease,) = b.lease(KEYS[1], 1)
    b.complete(lease.lease_id, KEYS[1])
    assert b.counts()["retired"] == 0 and b._failures == {}
    assert b.balanced(queued_groups=1)


def test_failures_survive_a_checkpoint_and_zero_never_retires():
    clock = FakeClock()
    b = board(clock)
    fail(b, clock, KEYS[0])
    fail(b, clock, KEYS[1])
    restored = board(clock)
    restored.restore(b.state())
    assert fail(restored, clock, KEYS[2]) == "p0"
    assert restored.counts()["retired"] == 1 and restored.balanced(queued_groups=0)

    never = board(clock, failures=0)
    assert [fail(never, clock, k) for k in KEYS] == ["p0"] * 5
    assert never.counts()["retired"] == 0 and never.balanced(queued_groups=0)
