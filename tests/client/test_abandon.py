"""One bad lease costs that lease, never the volunteer: a prompt too long for this engine's context is not
tried, an engine error on one prompt abandons only its lease, and only an engine that fails every lease of
several works in a row stops the volunteer (EngineFailed, a clear exit)."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.client.engine_api import Sample
from asyncrl.client.rollout import ENGINE_FAILURE_STREAK, EngineFailed
from asyncrl.client.worker import Volunteer, VolunteerConfig
from asyncrl.protocol import messages
from asyncrl.protocol.identity import Identity

SAMPLING = messages.SamplingParams(temperature=1.0, max_new_tokens=16)
POISON = 7  # a token id this engine raises on, as vLLM raises on a prompt it cannot take


class PickyEngine:
    """Generates `max_new_tokens` zeros per sample; raises on any batch holding a POISON prompt."""

    def __init__(self, context_limit: int | None, broken: bool = False):
        self.context_limit = context_limit
        self.broken = broken
        self.calls: list[int] = []  # prompts per generate call

    def generate(self, prompts, group_size, sampling):
        self.calls.append(len(prompts))
        if self.broken or any(POISON in p for p in prompts):
            raise ValueError("prompt cannot be served")
        return [[Sample([0] * sampling.max_new_tokens, [-1.0] * sampling.max_new_tokens, "length")
                 for _ in range(group_size)] for _ in prompts]


def lease(i: int, tokens: list[int]) -> messages.TaskLease:
    return messages.TaskLease(lease_id=f"l{i}", prompt_id=f"p{i}", prompt="x", answer="", reward="exact",
                              prompt_token_ids=np.asarray(tokens, dtype="<i4").tobytes(), group_size=2,
                              sampling=SAMPLING, expires_at=0.0)


@pytest.fixture
def volunteer(tmp_path):
    coordinator = Identity.from_seed(bytes(range(32)))
    return Volunteer(VolunteerConfig(address=f"/ip4/127.0.0.1/tcp/4001/p2p/{coordinator.peer_id}",
                                     data_dir=tmp_path, name="v", display="quiet"))


def test_a_prompt_too_long_for_this_engine_is_skipped_and_the_rest_served(volunteer):
    volunteer.engine = PickyEngine(context_limit=40)
    leases = [lease(0, [1] * 10), lease(1, [1] * 30), lease(2, [2] * 24)]  # 30 + 16 > 40; 24 + 16 fits
    done = volunteer._generate(leases, 2, SAMPLING)
    assert [l.lease_id for l, _ in done] == ["l0", "l2"]
    assert volunteer.engine.calls == [2]  # the long prompt never reached the engine
    assert (volunteer.status.leases_too_long, volunteer.status.leases_abandoned) == (1, 1)


def test_an_engine_error_costs_only_the_lease_that_caused_it(volunteer):
    volunteer.engine = PickyEngine(context_limit=None)
    done = volunteer._generate([lease(0, [1, 2]), lease(1, [POISON]), lease(2, [3])], 2, SAMPLING)
    assert [l.lease_id for l, _ in done] == ["l0", "l2"] and all(len(g) == 2 for _, g in done)
    assert (volunteer.status.engine_errors, volunteer.status.leases_abandoned) == (1, 1)
    # a work made only of a poison prompt is abandoned too, and the volunteer goes on
    assert volunteer._generate([lease(3, [POISON])], 2, SAMPLING) == []
    assert volunteer._generate([lease(4, [1])], 2, SAMPLING) != []
    assert volunteer.status.engine_errors == 2


def test_an_engine_that_fails_every_lease_stops_the_volunteer_clearly(volunteer):
    volunteer.engine = PickyEngine(context_limit=None, broken=True)
    for _ in range(ENGINE_FAILURE_STREAK - 1):
        assert volunteer._generate([lease(0, [1]), lease(1, [2])], 2, SAMPLING) == []
    volunteer.engine.broken = False  # one good work resets the streak
    assert volunteer._generate([lease(0, [1])], 2, SAMPLING) != []
    volunteer.engine.broken = True
    for _ in range(ENGINE_FAILURE_STREAK - 1):
        assert volunteer._generate([lease(0, [1]), lease(1, [2])], 2, SAMPLING) == []
    with pytest.raises(EngineFailed):
        volunteer._generate([lease(0, [1]), lease(1, [2])], 2, SAMPLING)


class LateSync:
    """An adapter follower whose first version arrives only at the `n`-th poll."""

    def __init__(self, n: int):
        self.n, self.polls = n, 0

    def poll(self):
        self.polls += 1
        return "v0" if self.polls >= self.n else None


def test_join_waits_for_the_first_adapter_however_long_it_takes_and_says_so(volunteer):
    said = []
    volunteer.out = said.append
    volunteer.cfg.poll_s = 0.001
    volunteer.sync = LateSync(400)
    assert volunteer.wait_for_adapter(report_every_s=0.0) == "v0"  # no give-up: it came at the 400th look
    assert volunteer.sync.polls == 400 and len(said) >= 1  # and it said it was still waiting
    volunteer.sync = LateSync(10**9)
    volunteer.stop.set()
    assert volunteer.wait_for_adapter() is None  # stopped (Ctrl-C) before anything was published
