"""Work sized to the machine: the volunteer's request size from its measured rate (client/lease_sizing.py)
and the coordinator's half — the same budget, a cap, and TOO_SLOW (coordinator/leasing/leasing.py)."""

from __future__ import annotations

import math

import pytest

from asyncrl.client.lease_sizing import LeaseSizer
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity

from tests.coordinator.leasing.test_leasing import RUN, grant, make_desk, tokenizer  # noqa: F401 (fixture)


def sealed(volunteer: Identity, coordinator: Identity, req: messages.LeaseRequest) -> bytes:
    return envelope.seal(volunteer, "lease_request", messages.encode(req), audience=coordinator.public_key)


def grant_msg(lease_life_s=60.0, max_staleness=4, interval=0.0) -> messages.LeaseGrant:
    return messages.LeaseGrant(run_id="r", leases=(), current_version=0, lease_life_s=lease_life_s,
                               max_staleness=max_staleness, version_interval_s=interval)


def test_budget_is_the_lease_life_or_the_staleness_window_whichever_is_shorter():
    assert messages.lease_budget_s(60, 4, 0.0) == 60  # interval unknown yet
    assert messages.lease_budget_s(60, 4, 5.0) == 25  # (4 + 1) versions x 5 s
    assert messages.lease_budget_s(60, None, 5.0) == 60 and messages.lease_budget_s(60, -1, 5.0) == 60
    assert messages.lease_budget_s(0, None, 0.0) == math.inf


def test_a_slow_machine_asks_for_less_and_a_too_slow_one_for_nothing():
    sizer = LeaseSizer(8)
    assert sizer.want() == 1  # first lease: measure
    sizer.observe_grant(grant_msg(lease_life_s=20))
    sizer.measured(1, 3.0)  # 3 s per prompt
    assert sizer.want() == 3  # 0.5 x 20 s / 3 s
    sizer.measured(3, 3 * 7.0)  # it got slower: smoothed to 5 s
    assert sizer.seconds_per_prompt == pytest.approx(5.0) and sizer.want() == 2
    sizer.observe_grant(grant_msg(lease_life_s=20, max_staleness=0, interval=4.0))  # budget 4 s now
    assert sizer.want() == 0 and sizer.reported_rate() == pytest.approx(5.0)
    fast = LeaseSizer(8)
    fast.observe_grant(grant_msg(lease_life_s=60))
    fast.measured(1, 0.1)
    assert fast.want() == 8  # capped by --prompts-per-batch
    fixed = LeaseSizer(8, fixed=True)
    fixed.measured(1, 100.0)
    assert fixed.want() == 8 and fixed.reported_rate() == 0.0


def lease_request(want: int, rate: float) -> messages.LeaseRequest:
    return messages.LeaseRequest(run_id=RUN, max_prompts=want, adapter_version=7, client_name="slow",
                                 seconds_per_prompt=rate)


def test_the_coordinator_cuts_oversized_requests_and_refuses_hopeless_ones(tokenizer):
    desk, coordinator, board, ingest = make_desk(tokenizer, inflight=16, per_lease=8)
    desk.policy = desk.policy.__class__(**{**desk.policy.__dict__, "lease_life_s": 20.0, "max_staleness": 2})
    slow = Identity.generate()
    got = grant(desk, sealed(slow, coordinator, lease_request(8, 4.0)))  # 0.5 x 20 / 4 -> 2
    assert len(got.leases) == 2 and got.lease_life_s == 20.0 and got.max_staleness == 2
    clock = iter([0.0, 2.0, 4.0])
    desk.versions._clock = lambda: next(clock)
    for _ in range(3):  # a version every 2 s: budget = (2 + 1) x 2 s = 6 s
        desk.versions.published()
    assert desk.versions.interval_s() == 2.0
    with pytest.raises(ProtocolError) as err:
        desk.handle(sealed(slow, coordinator, lease_request(1, 7.0)), peer="p")
    assert err.value.code is RejectCode.TOO_SLOW and err.value.detail
    assert board.counts()["leased"] == 2  # nothing leased to it
    unmeasured = grant(desk, sealed(Identity.generate(), coordinator, lease_request(8, 0.0)))
    assert len(unmeasured.leases) == 8  # no rate reported: only the usual limits


def test_a_fast_engine_is_asked_enough_prompts_to_fill_its_batch_within_the_staleness_budget():
    sizer = LeaseSizer(4)
    sizer.engine_seqs = 256  # vLLM's max_num_seqs
    sizer.observe_grant(messages.LeaseGrant(run_id="r", leases=(), current_version=0, lease_life_s=600))
    sizer.measured(1, 0.5)
    assert sizer.want() == 4  # group size not known yet: --prompts-per-batch
    lease = messages.TaskLease(lease_id="l", prompt_id="p", prompt="x", answer="", reward="exact",
                               prompt_token_ids=b"\0\0\0\0", group_size=16, sampling=messages.SamplingParams(),
                               expires_at=0.0)
    sizer.observe_grant(messages.LeaseGrant(run_id="r", leases=(lease,), current_version=0, lease_life_s=600))
    assert sizer.want() == 16  # 256 sequences / 16 samples per prompt
    sizer.observe_grant(messages.LeaseGrant(run_id="r", leases=(lease,), current_version=0, lease_life_s=600,
                                            max_staleness=1, version_interval_s=1.0))
    assert sizer.want() == 2  # the staleness budget (2 versions x 1 s) x 0.5 / 0.5 s per prompt wins
