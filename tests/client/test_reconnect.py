"""A coordinator coming up (client/pacing.py ReconnectBackoff, swarm/transport.py NotServed).

A (re)started coordinator's p2p node listens before its handlers are registered: it loads the model after
its DHT forks. Meanwhile p2pd refuses a volunteer's streams ("protocols not supported"). The volunteer must
read that as "starting" and come back within seconds, not as "unreachable", whose back-off grows to 30 s
and cost every volunteer up to that much after each restart.
"""

from __future__ import annotations

import random

import pytest

from asyncrl.client.pacing import (JITTER, MAX_BACKOFF_S, STARTING_GRACE_S, STARTING_MAX_S, ReconnectBackoff)
from asyncrl.swarm.transport import NotServed, SwarmNode, TransportError

LEASE = "run.lease"


async def granted(request: bytes, peer: str) -> bytes:
    return b"granted:" + request


@pytest.fixture
def coordinator_and_volunteer():
    coordinator = SwarmNode()
    try:
        volunteer = SwarmNode(initial_peers=coordinator.visible_maddrs())
        try:
            yield coordinator, volunteer
        finally:
            volunteer.shutdown()
    finally:
        coordinator.shutdown()


def test_a_stream_not_served_yet_is_retried_soon_until_the_handler_is_up(coordinator_and_volunteer):
    coordinator, volunteer = coordinator_and_volunteer
    retry = ReconnectBackoff(rng=random.Random(0))
    refusals, waits, answer = [], [], None
    for _ in range(8):
        try:
            answer = volunteer.call(coordinator.peer_id, LEASE, b"lease?", max_response_bytes=64)
            break
        except TransportError as exc:
            refusals.append(exc)
            waits.append((retry.after_failure(exc), retry.last_class))
            if len(refusals) == 3:  # the coordinator's model is loaded: its handlers come up
                coordinator.serve(LEASE, granted, max_request_bytes=64)
    assert answer == b"granted:lease?"
    assert len(refusals) == 3
    assert all(isinstance(e, NotServed) for e in refusals), [str(e) for e in refusals]
    assert "protocols not supported" in str(refusals[0])  # p2pd's words, kept for the operator
    assert [cls for _, cls in waits] == ["starting"] * 3
    assert all(w <= STARTING_MAX_S * (1 + JITTER) for w, _ in waits), waits


def test_the_starting_class_stays_short_and_the_unreachable_one_grows():
    not_served, down = NotServed("lease: protocols not supported"), TransportError("lease: failed to dial")
    starting = ReconnectBackoff(rng=random.Random(1))
    waits = [starting.after_failure(not_served) for _ in range(20)]
    assert max(waits) <= STARTING_MAX_S * (1 + JITTER)
    assert waits[0] < waits[-1]  # it doubles up to its cap
    unreachable = ReconnectBackoff(rng=random.Random(1))
    waits = [unreachable.after_failure(down) for _ in range(20)]
    assert waits[-1] >= MAX_BACKOFF_S * (1 - JITTER)
    assert unreachable.last_class == "unreachable"
    # a coordinator that answers again (not served yet) starts the unreachable back-off over
    assert unreachable.after_failure(not_served) <= STARTING_MAX_S * (1 + JITTER)
    assert unreachable.after_failure(down) <= 1 + JITTER


def test_jitter_spreads_volunteers_that_failed_together():
    failed_together = [ReconnectBackoff(rng=random.Random(seed)) for seed in range(100)]
    for _ in range(5):
        waits = [r.after_failure(NotServed("x")) for r in failed_together]
    assert len({round(w, 2) for w in waits}) > 50
    assert STARTING_MAX_S * (1 - JITTER) <= min(waits) and max(waits) <= STARTING_MAX_S * (1 + JITTER)


def test_a_peer_that_never_serves_the_stream_falls_back_to_the_unreachable_back_off():
    other_run = ReconnectBackoff(rng=random.Random(2))  # e.g. a coordinator now running another run id
    waited = 0.0
    while other_run.last_class != "unreachable":
        waited += other_run.after_failure(NotServed("x"))
    assert STARTING_GRACE_S <= waited <= STARTING_GRACE_S + STARTING_MAX_S * (1 + JITTER) + (1 + JITTER)
    other_run.reset()  # an answer: the short class again
    other_run.after_failure(NotServed("x"))
    assert other_run.last_class == "starting"
