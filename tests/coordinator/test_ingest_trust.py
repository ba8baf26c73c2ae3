"""Ingest's trust order with real keys, a real task board and the tiny tokenizer (no network, no model).

What matters here is *order*: a rate-limited batch can be retried with the very same bytes (the nonce
is not spent), a lost ack's retry is a DUPLICATE_BATCH ack, nobody is charged for a reject before the
signature verified, and the replay state survives a restart.
"""

from __future__ import annotations

import pytest

from asyncrl import tasks
from asyncrl.coordinator.access import AccessControl, AccessPolicy
from asyncrl.coordinator.ingest import Ingest
from asyncrl.coordinator.taskboard import TaskBoard
from asyncrl.models import tinymodel
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity

from . import rollouts

COORD = Identity.from_seed(bytes(range(32)))
ALICE = Identity.from_seed(bytes(range(1, 33)))
MALLORY = Identity.from_seed(bytes(range(2, 34)))
SAMPLING = messages.SamplingParams(temperature=1.0, max_new_tokens=8)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture(scope="module")
def tokenizer():
    return tinymodel.build_tokenizer()


def make_ingest(tokenizer, access=None):
    board = TaskBoard(tasks.get_task("repeat", 0), lease_timeout_s=60, max_leases_per_client=8)
    return Ingest(identity_public_key=COORD.public_key, run_id="r", board=board, tokenizer=tokenizer, vocab_size=64,
                  current_version=lambda: 0, max_batch_bytes=1 << 20, window_s=300, access=access, sampling=SAMPLING)


def sealed_batch(ingest, tokenizer, who=ALICE) -> bytes:
    return rollouts.sealed_batch(ingest.board, tokenizer, who, audience=COORD.public_key, sampling=SAMPLING)


def test_rate_limited_batch_is_retried_with_the_same_bytes(tokenizer):
    clock = FakeClock()
    access = AccessControl(AccessPolicy(identity_rate_per_s=1.0, identity_burst=1), clock=clock, wall=clock)
    ingest = make_ingest(tokenizer, access)
    sealed = sealed_batch(ingest, tokenizer)
    access.admit_identity(ALICE.public_key)  # alice spent her only token
    assert ingest.handle(sealed).code == "RATE_LIMITED"
    clock.t += 1.0
    ack = ingest.handle(sealed)
    assert ack.accepted and ack.code is None
    assert access.valid_streak(ALICE.public_key) == 1


def test_lost_ack_retry_and_reseal_are_duplicates(tokenizer):
    ingest = make_ingest(tokenizer)
    sealed = sealed_batch(ingest, tokenizer)
    assert ingest.handle(sealed).accepted
    again = ingest.handle(sealed)  # same bytes, same nonce: the ack was lost
    assert again.accepted and again.code == "DUPLICATE_BATCH"
    opened = envelope.open_envelope(sealed, max_bytes=1 << 20, expected_kind="rollout_batch", expected_audience=None)
    resealed = envelope.seal(ALICE, "rollout_batch", opened.payload, audience=COORD.public_key)
    assert ingest.handle(resealed).code == "DUPLICATE_BATCH"
    assert ingest.queue.qsize() == 1


def test_nobody_is_charged_before_the_signature_verified(tokenizer):
    access = AccessControl(AccessPolicy(peer_max_strikes=2))
    ingest = make_ingest(tokenizer, access)
    sealed = sealed_batch(ingest, tokenizer)
    forged = sealed[:100] + bytes([sealed[100] ^ 1]) + sealed[101:]  # alice's header, broken body
    assert ingest.handle(forged, peer="mallory-peer").code == "SIGNATURE_MISMATCH"
    assert ingest.clients == {} and access.strikes(ALICE.public_key) == 0
    assert ingest.handle(b"ARL1" + bytes(10), peer="mallory-peer").code == "MALFORMED"
    assert "mallory-peer" in access.banned_peers
    assert ingest.handle(sealed).accepted  # alice is untouched


def test_lies_strike_the_signer(tokenizer):
    access = AccessControl(AccessPolicy(max_strikes=1))
    ingest = make_ingest(tokenizer, access)
    sealed = sealed_batch(ingest, tokenizer, MALLORY)
    opened = envelope.open_envelope(sealed, max_bytes=1 << 20, expected_kind="rollout_batch", expected_audience=None)
    batch = messages.decode(opened.payload, messages.RolloutBatch, max_bytes=1 << 20)
    hot = messages.RolloutBatch(run_id="r", adapter_version=0, client_name="m", sampling=messages.SamplingParams(
        temperature=0.1, max_new_tokens=8), groups=batch.groups, generated_at=0.0)
    ack = ingest.handle(envelope.seal(MALLORY, "rollout_batch", messages.encode(hot), audience=COORD.public_key))
    assert ack.code == "MALFORMED" and access.is_banned(MALLORY.public_key)
    assert ingest.handle(sealed).code == "NOT_ALLOWED"


def test_replay_state_survives_a_restart(tokenizer):
    ingest = make_ingest(tokenizer)
    sealed = sealed_batch(ingest, tokenizer)
    refused = envelope.seal(ALICE, "rollout_batch", b"\x80", audience=COORD.public_key)
    assert ingest.handle(sealed).accepted and ingest.handle(refused).code == "MALFORMED"
    restarted = make_ingest(tokenizer)
    restarted.load_state(ingest.state_bytes())
    assert restarted.handle(sealed).code == "DUPLICATE_BATCH"
    assert restarted.handle(refused).code == "NONCE_REUSED"
    with pytest.raises(Exception):
        restarted.load_state(b"not msgpack")
