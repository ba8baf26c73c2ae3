"""Ingest derives each completion's finish reason from its tokens and the pinned stop set (never trusts the
string), and hands the learner which completions were truncated."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl import tasks
from asyncrl.coordinator.ingest.ingest import Ingest
from asyncrl.coordinator.leasing.taskboard import TaskBoard
from asyncrl.models import tinymodel
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity

COORD = Identity.from_seed(bytes(range(32)))
ALICE = Identity.from_seed(bytes(range(1, 33)))
SAMPLING = messages.SamplingParams(temperature=1.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def tokenizer():
    return tinymodel.build_tokenizer(instruct=True)  # stop set {<|endoftext|>, <|im_end|>}, as Qwen2.5-Instruct


def make_ingest(tokenizer, **overrides) -> Ingest:
    board = TaskBoard(tasks.get_task("repeat", 0), lease_timeout_s=60, max_leases_per_client=8)
    stops = (tokenizer.pad_token_id, tokenizer.eos_token_id)
    fields = dict(identity_public_key=COORD.public_key, run_id="r", board=board, tokenizer=tokenizer, vocab_size=64,
                  current_version=lambda: 0, max_batch_bytes=1 << 20, window_s=300, sampling=SAMPLING,
                  stop_token_ids=tuple(sorted(stops)))
    return Ingest(**{**fields, **overrides})


@pytest.fixture
def ingest(tokenizer):
    return make_ingest(tokenizer)


def seal(ingest, tokenizer, completions: list[tuple[list[int], str]], **batch_fields) -> bytes:
    lease = ingest.board.lease(ALICE.public_key, 1)[0]
    ids = tokenizer(lease.prompt.text)["input_ids"]
    comps = []
    for toks, finish in completions:
        text = tokenizer.decode(toks, skip_special_tokens=True)
        comps.append(messages.Completion(np.asarray(toks, "<i4").tobytes(), np.full(len(toks), -1.0, "<f4").tobytes(),
                                         tasks.score(lease.prompt.reward, text, lease.prompt.answer), finish))
    group = messages.RolloutGroup(lease.lease_id, lease.prompt.prompt_id, np.asarray(ids, "<i4").tobytes(), tuple(comps))
    fields = dict(run_id="r", adapter_version=0, client_name="alice", sampling=SAMPLING, groups=(group,),
                  generated_at=0.0)
    batch = messages.RolloutBatch(**{**fields, **batch_fields})
    return envelope.seal(ALICE, "rollout_batch", messages.encode(batch), audience=COORD.public_key)


def test_both_stop_tokens_and_length_are_accepted_and_truncation_reaches_the_learner(ingest, tokenizer):
    a = tokenizer.convert_tokens_to_ids("a")
    im_end, eot = tokenizer.eos_token_id, tokenizer.pad_token_id
    ack = ingest.handle(seal(ingest, tokenizer, [([a, a, im_end], "stop"), ([a, eot], "stop"), ([a] * 8, "length")]))
    assert ack.accepted, ack
    group = ingest.queue.get_nowait().groups[0]
    assert group.truncated == [False, False, True]


@pytest.mark.parametrize("tokens, claimed", [
    (["a"] * 8, "stop"),                 # the string lies about how it ended
    (["a", "<|im_end|>"], "length"),
    (["a", "<|im_end|>", "a"], "stop"),  # went on after a stop token
    (["a", "a"], "length"),              # ended early without a stop token
])
def test_finish_reasons_the_tokens_contradict_are_malformed(ingest, tokenizer, tokens, claimed):
    toks = tokenizer.convert_tokens_to_ids(tokens)
    ack = ingest.handle(seal(ingest, tokenizer, [(toks, claimed)]))
    assert not ack.accepted and ack.code == "MALFORMED"


@pytest.mark.parametrize("change", [{"sampling": messages.SamplingParams(temperature=0.1, max_new_tokens=8)},
                                    {"adapter_version": 7}])
def test_a_batch_refused_before_scoring_ends_its_leases_at_once(ingest, tokenizer, change):
    """Sampling not as leased (MALFORMED) or an unpublished version (FUTURE_VERSION): the refused batch is never
    re-sent, so its prompts go back to the queue now rather than after lease_timeout_s."""
    a, im_end = tokenizer.convert_tokens_to_ids("a"), tokenizer.eos_token_id
    sealed = seal(ingest, tokenizer, [([a, im_end], "stop")], **change)
    assert ingest.board.counts()["outstanding"] == 1
    ack = ingest.handle(sealed)
    assert not ack.accepted and ack.code == ("MALFORMED" if "sampling" in change else "FUTURE_VERSION")
    counts = ingest.board.counts()
    assert counts["outstanding"] == 0 and counts["expired"] == 1 and counts["requeued_waiting"] == 1


def test_batches_an_earlier_lineage_spooled_are_refused_and_never_strike_their_volunteer(tokenizer):
    """A coordinator restarted without --resume under the same key numbers its versions from 0 again, so an
    honest volunteer's batches generated with the old lineage's v6 claim a version this one never published
    (CI 2026-12-02: three of them struck and banned an honest volunteer). Each is refused, nothing is
    trained, the key is not struck, and its next batch at a version this lineage did publish is accepted."""
    from asyncrl.coordinator.trust.access import AccessControl, AccessPolicy

    access = AccessControl(AccessPolicy(max_strikes=3))
    fresh = make_ingest(tokenizer, is_published=lambda v: v == 0, access=access)
    a, im_end = tokenizer.convert_tokens_to_ids("a"), tokenizer.eos_token_id
    for _ in range(2 * access.policy.max_strikes):
        ack = fresh.handle(seal(fresh, tokenizer, [([a, im_end], "stop")], adapter_version=6))
        assert not ack.accepted and ack.code == "FUTURE_VERSION", ack
    assert fresh.queue.empty()
    assert access.strikes(ALICE.public_key) == 0 and not access.is_banned(ALICE.public_key)
    assert access.valid_streak(ALICE.public_key) == 0  # a suspicion: audited on every batch for a while
    ack = fresh.handle(seal(fresh, tokenizer, [([a, im_end], "stop")], adapter_version=0))
    assert ack.accepted, ack
