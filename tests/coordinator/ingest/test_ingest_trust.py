"""Ingest's trust order with real keys, a real task board and the tiny tokenizer (no network, no model).

What matters here is *order*: a rate-limited batch can be retried with the very same bytes (the nonce
is not spent), a lost ack's retry is a DUPLICATE_BATCH ack, nobody is charged for a reject before the
signature verified, and the replay state survives a restart.
"""

from __future__ import annotations

import pytest

from asyncrl import tasks
from asyncrl.coordinator.ingest.ingest import Ingest
from asyncrl.coordinator.leasing.taskboard import TaskBoard
from asyncrl.coordinator.trust.access import AccessControl, AccessPolicy
from asyncrl.models import tinymodel
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity

from tests.coordinator import rollouts

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


def make_ingest(tokenizer, access=None, seen_path=None, journal=None):
    board = TaskBoard(tasks.get_task("repeat", 0), lease_timeout_s=60, max_leases_per_client=8)
    return Ingest(identity_public_key=COORD.public_key, run_id="r", board=board, tokenizer=tokenizer, vocab_size=64,
                  current_version=lambda: 0, max_batch_bytes=1 << 20, window_s=300, access=access, sampling=SAMPLING,
                  seen_path=seen_path, journal=journal)


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
    (book,) = ingest.clients.values()  # alice's book: two resends, not two rejections
    assert book.accepted == 1 and book.resent == 2 and book.rejected == {}


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


def test_replay_state_survives_a_restart(tokenizer, tmp_path):
    ingest = make_ingest(tokenizer, seen_path=tmp_path / "seen_ids.log")
    sealed = sealed_batch(ingest, tokenizer)
    refused = envelope.seal(ALICE, "rollout_batch", b"\x80", audience=COORD.public_key)
    assert ingest.handle(sealed).accepted and ingest.handle(refused).code == "MALFORMED"
    assert ingest.save_seen() == 1 and ingest.save_seen() == 0  # incremental: only the new ids are written
    restarted = make_ingest(tokenizer, seen_path=tmp_path / "seen_ids.log")
    restarted.load_state(ingest.state_bytes())
    assert restarted.seen.load() == 1
    assert restarted.handle(sealed).code == "DUPLICATE_BATCH"
    assert restarted.handle(refused).code == "NONCE_REUSED"
    with pytest.raises(Exception):
        restarted.load_state(b"not msgpack")


def test_exact_rewards_are_rescored_without_decoding_only_where_they_cannot_be_right(tokenizer):
    """An `exact` task: the right answer (reward 1) is decoded and accepted; a made-up 1.0 on a completion too
    long to be the answer is refused (REWARD_MISMATCH) by the printable-character bound alone."""
    import numpy as np

    from asyncrl.tasks import Prompt

    def prompts():
        i = 0
        while True:
            i += 1
            yield Prompt(prompt_id=f"q{i}", text="say ab", answer="ab", reward="exact")

    board = TaskBoard(prompts(), lease_timeout_s=60, max_leases_per_client=8)
    ingest = Ingest(identity_public_key=COORD.public_key, run_id="r", board=board, tokenizer=tokenizer, vocab_size=64,
                    current_version=lambda: 0, max_batch_bytes=1 << 20, window_s=300, sampling=SAMPLING)
    assert ingest.bounds is not None

    def batch(completions: list[tuple[str, float]]) -> bytes:
        lease = board.lease(ALICE.public_key, 1)[0]
        comps = tuple(messages.Completion(np.asarray(tokenizer(t, add_special_tokens=False)["input_ids"], "<i4").tobytes(),
                                          np.full(len(tokenizer(t, add_special_tokens=False)["input_ids"]), -1.0,
                                                  "<f4").tobytes(), r, "length") for t, r in completions)
        group = messages.RolloutGroup(lease.lease_id, lease.prompt.prompt_id,
                                      np.asarray(tokenizer(lease.prompt.text)["input_ids"], "<i4").tobytes(), comps)
        b = messages.RolloutBatch(run_id="r", adapter_version=0, client_name="alice", sampling=SAMPLING, groups=(group,),
                                  generated_at=0.0)
        return envelope.seal(ALICE, "rollout_batch", messages.encode(b), audience=COORD.public_key)

    ack = ingest.handle(batch([(" ab", 1.0), ("abab", 0.0), ("b", 0.0)]))
    assert ack.accepted and ack.code is None
    ack = ingest.handle(batch([("abababab", 1.0), ("ab", 1.0)]))  # the first cannot be "ab": 8 printable chars
    assert not ack.accepted and ack.code == "REWARD_MISMATCH"
