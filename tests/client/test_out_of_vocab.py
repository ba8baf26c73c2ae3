"""Ids at or beyond the tokenizer's length (the model's padded embedding rows; the tiny model: 61 tokens,
64 rows) are never sampled and never trained: the transformers engine masks them even when the model
favours them, its processed log-probs are the learner's (models/logprobs.py `vocab_limit`), and ingest
refuses a batch holding one with OUT_OF_VOCAB (an engine that emits one: nothing queued, nothing trained).
vLLM's mask (allowed_token_ids) is checked in tests/client/test_engine_vllm.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.client.engine import TransformersEngine
from asyncrl.models import tinymodel
from asyncrl.models.logprobs import CompletionScorer
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.messages import LoraSpec, SamplingParams
from tests.coordinator.ingest.test_ingest_commit import ALICE, COORD, SAMPLING, make


class FavoursPaddedRows(torch.nn.Module):
    """The engine's model with +30 on the logits of every id the tokenizer lacks: a policy that learned to
    pad with ids that decode to "" (what a length reward pays for)."""

    def __init__(self, model, limit: int):
        super().__init__()
        self.inner, self.limit = model, limit

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits[..., self.limit:] += 30.0
        return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tinymodel.write_tiny_model(tmp_path_factory.mktemp("oov") / "tiny", instruct=True)
    eng = TransformersEngine(str(path), LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj")), seed=3)
    return eng


def test_the_engine_never_samples_an_id_the_tokenizer_lacks_and_its_logprobs_are_the_learners(engine):
    limit = len(engine.tokenizer)
    assert engine.model.config.vocab_size > limit  # the tiny model is padded like Qwen
    real = engine.model
    prompt = engine.tokenizer("abc")["input_ids"]
    engine.model = FavoursPaddedRows(real, limit)
    try:
        samples = engine.generate([prompt], 8, SamplingParams(temperature=0.7, max_new_tokens=12))[0]
    finally:
        engine.model = real
    assert max(t for s in samples for t in s.token_ids) < limit
    width = max(len(prompt) + len(s.token_ids) for s in samples)
    ids_t = torch.full((len(samples), width), engine.tokenizer.pad_token_id)
    attn = torch.zeros_like(ids_t)
    tmax = max(len(s.token_ids) for s in samples)
    mask = torch.zeros((len(samples), tmax))
    for i, s in enumerate(samples):
        row = prompt + s.token_ids
        ids_t[i, :len(row)] = torch.tensor(row)
        attn[i, :len(row)] = 1
        mask[i, :len(s.token_ids)] = 1
    batch = {"ids": ids_t, "attn": attn, "prompt_lens": torch.tensor([len(prompt)] * len(samples)),
             "comp_lens": torch.tensor([len(s.token_ids) for s in samples]), "temps": torch.full((len(samples),), 0.7),
             "mask": mask}
    with torch.no_grad():
        limited = CompletionScorer(real, vocab_limit=limit)(batch, entropy=False).logps
        whole = CompletionScorer(real)(batch, entropy=False).logps
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        assert torch.allclose(limited[i, :n], torch.tensor(s.logprobs), atol=1e-4)
        assert not torch.allclose(whole[i, :n], torch.tensor(s.logprobs), atol=1e-4)  # the padded rows had mass


def test_the_limited_head_and_its_gradient_are_a_softmax_over_the_first_ids():
    from asyncrl.models.logprobs import head_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 10, bias=True)
    hidden = torch.randn(5, 8, requires_grad=True)
    targets = torch.tensor([0, 3, 6, 6, 1])
    inv_temp = torch.full((5,), 1 / 0.8)
    lp, ent = head_logprobs(head, hidden, targets, inv_temp, chunk=2, vocab_limit=7)
    ref_logits = (head(hidden) * inv_temp[:, None])[:, :7]
    ref = torch.log_softmax(ref_logits, -1).gather(1, targets[:, None]).squeeze(1)
    assert torch.allclose(lp, ref, atol=1e-5)
    ref_ent = -(torch.softmax(ref_logits, -1) * torch.log_softmax(ref_logits, -1)).sum(-1)
    assert torch.allclose(ent, ref_ent.detach(), atol=1e-5)
    g_ours = torch.autograd.grad(lp.sum(), [hidden, head.weight, head.bias])
    g_ref = torch.autograd.grad(ref.sum(), [hidden, head.weight, head.bias])
    for a, b in zip(g_ours, g_ref):
        assert torch.allclose(a, b, atol=1e-5)
    assert float(g_ours[1][7:].abs().sum()) == 0.0  # rows past the limit get no gradient


def test_ingest_refuses_a_batch_holding_an_id_the_tokenizer_lacks(tmp_path):
    tokenizer = tinymodel.build_tokenizer()
    ingest, board, journal, _ = make(tokenizer, tmp_path)
    lease = board.lease(ALICE.public_key, 1)[0]
    prompt = tokenizer(lease.prompt.text)["input_ids"]
    good = tokenizer("abab")["input_ids"]
    bad = good[:-1] + [len(tokenizer) + 1]  # what an engine without the mask emits: decodes to ""
    comps = tuple(messages.Completion(np.asarray(t, "<i4").tobytes(), np.full(len(t), -1.0, "<f4").tobytes(),
                                      0.0, "length") for t in (good, bad))
    batch = messages.RolloutBatch(run_id="r", adapter_version=0, client_name="alice", sampling=SAMPLING,
                                  groups=(messages.RolloutGroup(lease.lease_id, lease.prompt.prompt_id,
                                                                np.asarray(prompt, "<i4").tobytes(), comps),),
                                  generated_at=0.0)
    ack = ingest.handle(envelope.seal(ALICE, "rollout_batch", messages.encode(batch), audience=COORD.public_key))
    assert not ack.accepted and ack.code == "OUT_OF_VOCAB"
    assert ingest.queued() == 0 and len(journal) == 0  # nothing reaches the learner
