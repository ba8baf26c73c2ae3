"""top-p, top-k, min-p and repetition penalty (models/sampling.py): the processing itself on hand-computed
distributions, the transformers engine's reported log-probs equal to the learner's (the same processed,
renormalised distribution, through the learner's own collate path and chunked head), the chunked head's
gradient equal to autograd's through the processed logits, and the defaults untouched."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.client.engine import TransformersEngine, processed_logprobs
from asyncrl.coordinator.learner.learner import TrainGroup, collate_rows, rows_of
from asyncrl.models import tinymodel
from asyncrl.models.logprobs import CompletionScorer, head_logprobs
from asyncrl.models.sampling import SamplingKnobs, TokenSampling, process
from asyncrl.protocol.messages import LoraSpec, SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]  # a distribution whose top-p / min-p / top-k cuts are easy to compute by hand


def _kept(knobs: SamplingKnobs, probs=PROBS) -> list[float]:
    logits = torch.tensor([probs]).log()
    out, _ = process(logits, TokenSampling.uniform(1, knobs, "cpu"))
    return torch.softmax(out, -1)[0].tolist()


@pytest.mark.parametrize("knobs, expected", [
    # ascending cumulative sums 0.05, 0.20, 0.50, 1.0; top-p drops those <= 1 - p
    (SamplingKnobs(top_p=0.75), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
    (SamplingKnobs(top_p=0.85), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    (SamplingKnobs(top_p=0.1), [1.0, 0.0, 0.0, 0.0]),  # the most likely token always stays
    (SamplingKnobs(top_k=2), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
    (SamplingKnobs(min_p=0.35), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),  # below 0.35 x 0.5 = 0.175
    (SamplingKnobs(min_p=0.25), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    # vLLM's order: min_p first (drops 0.05), then top-p on the renormalised rest: 0.15 / 0.95 = 0.158 <= 0.2
    # (top-p first would keep three: 0.05 + 0.15 > 0.17)
    (SamplingKnobs(min_p=0.2, top_p=0.83), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
])
def test_processing_keeps_the_hand_computed_set_renormalised(knobs, expected):
    assert _kept(knobs) == pytest.approx(expected, abs=1e-6)


def test_repetition_penalty_scales_seen_logits_as_vllm_does():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    seen = torch.tensor([[True, True, False, True]])
    ts = TokenSampling.uniform(1, SamplingKnobs(repetition_penalty=2.0), "cpu", seen_ids=seen)
    out, scale = process(logits, ts)
    assert out.tolist() == [[1.0, -2.0, 0.5, 0.0]]  # positive / penalty, negative x penalty, unseen untouched
    assert scale.tolist() == [[0.5, 2.0, 1.0, 2.0]]


def test_the_seen_set_is_prompt_and_completion_before_each_position():
    context = torch.tensor([[5, 1, 2, 9], [3, 3, 0, 0]])
    ts = TokenSampling.uniform(3, SamplingKnobs(repetition_penalty=1.5), "cpu",
                               context=context, row=torch.tensor([0, 0, 1]), seen=torch.tensor([1, 3, 2]))
    seen = ts.seen_mask(10)
    assert [torch.nonzero(r).flatten().tolist() for r in seen] == [[5], [1, 2, 5], [3]]


LORA = LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"))
KNOBS = {
    "top_p": SamplingParams(temperature=0.9, top_p=0.7, max_new_tokens=16),
    "top_k": SamplingParams(temperature=1.1, top_k=5, max_new_tokens=16),
    "min_p": SamplingParams(temperature=1.0, min_p=0.2, max_new_tokens=16),
    "repetition_penalty": SamplingParams(temperature=0.8, repetition_penalty=1.6, max_new_tokens=16),
    "all": SamplingParams(temperature=0.7, top_p=0.9, top_k=12, min_p=0.05, repetition_penalty=1.3,
                          max_new_tokens=16),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tinymodel.write_tiny_model(tmp_path_factory.mktemp("knobs") / "tiny", instruct=True)
    eng = TransformersEngine(str(path), LORA, seed=5)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # a non-zero adapter, so the LoRA path is part of what is compared
        for name, p in eng.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return eng


def _learner_logps(engine, prompts, samples, sampling, *, knobs=True):
    groups = [TrainGroup(p, [s.token_ids for s in g], [s.logprobs for s in g], [0.0] * len(g), version=0,
                         temperature=sampling.temperature,
                         **({"top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": sampling.min_p,
                             "repetition_penalty": sampling.repetition_penalty} if knobs else {}))
              for p, g in zip(prompts, samples)]
    batch = collate_rows(rows_of(groups), engine.tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        return CompletionScorer(engine.model, vocab_limit=len(engine.tokenizer))(batch, entropy=False).logps


@pytest.mark.parametrize("name", sorted(KNOBS))
def test_engine_logprobs_are_the_learners_under_each_knob(engine, name):
    sampling = KNOBS[name]
    prompts = [engine.tokenizer.encode(p) for p in ("abc", "12+34=", "aaaa")]
    samples = engine.generate(prompts, 6, sampling)
    ours = _learner_logps(engine, prompts, samples, sampling)
    plain = _learner_logps(engine, prompts, samples, sampling, knobs=False)  # temperature only
    claimed = [s for g in samples for s in g]
    worst, differs = 0.0, 0
    for i, s in enumerate(claimed):
        n = len(s.token_ids)
        assert all(math.isfinite(x) for x in s.logprobs)
        worst = max(worst, float((ours[i, :n] - torch.tensor(s.logprobs)).abs().max()))
        differs += int((plain[i, :n] - torch.tensor(s.logprobs)).abs().max() > 1e-3)
    print(f"{name}: max |engine - learner| = {worst:.1e}; {differs}/{len(claimed)} completions off "
          "temperature-only log-probs by > 1e-3")
    assert worst < 1e-4, worst
    assert differs > 0  # the knob changed the distribution: a temperature-only learner would not match


def test_defaults_leave_the_batch_and_the_engine_path_as_before(engine):
    sampling = SamplingParams(temperature=0.8, max_new_tokens=8)
    assert not SamplingKnobs.of(sampling).active
    prompts = [engine.tokenizer.encode("abc")]
    samples = engine.generate(prompts, 4, sampling)
    groups = [TrainGroup(prompts[0], [s.token_ids for s in samples[0]], [s.logprobs for s in samples[0]],
                         [0.0] * 4, version=0, temperature=0.8)]
    batch = collate_rows(rows_of(groups), engine.tokenizer.pad_token_id, "cpu")
    assert "top_p" not in batch  # the scorer's temperature-only path, unchanged
    logits = torch.randn(3, engine.vocab_size)
    expected = torch.log_softmax(logits / 0.8, -1)
    expected[:, len(engine.tokenizer):] = float("-inf")
    masked = logits / 0.8
    masked[:, len(engine.tokenizer):] = float("-inf")
    assert torch.equal(processed_logprobs(logits.clone(), sampling, vocab_limit=len(engine.tokenizer)),
                       torch.log_softmax(masked, -1))


class NotALinear(torch.nn.Module):
    """The same head behind a module that is not an nn.Linear: head_logprobs takes its autograd path."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x)


def test_chunked_head_gradient_is_autograds_through_the_processed_logits():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 12, bias=True)
    hidden = torch.randn(7, 8, requires_grad=True)
    context = torch.randint(0, 10, (2, 9))
    rows, seen = torch.tensor([0, 0, 0, 1, 1, 1, 1]), torch.tensor([2, 3, 4, 2, 3, 4, 5])
    targets = context[rows, seen]  # each position predicts the next id of its row
    ts = TokenSampling(torch.full((7,), 0.85), torch.full((7,), 6, dtype=torch.long), torch.full((7,), 0.02),
                       torch.full((7,), 1.4), context=context, row=rows, seen=seen)
    inv_temp = torch.full((7,), 1 / 0.9)
    lp, ent = head_logprobs(head, hidden, targets, inv_temp, chunk=24, vocab_limit=10, sampling=ts)  # 3 per chunk
    ref_lp, ref_ent = head_logprobs(NotALinear(head), hidden, targets, inv_temp, chunk=24, vocab_limit=10, sampling=ts)
    assert torch.isfinite(lp).all() and torch.allclose(lp, ref_lp, atol=1e-6)
    assert torch.allclose(ent, ref_ent, atol=1e-5)
    g_ours = torch.autograd.grad(lp.sum(), [hidden, head.weight, head.bias])
    g_ref = torch.autograd.grad(ref_lp.sum(), [hidden, head.weight, head.bias])
    for a, b in zip(g_ours, g_ref):
        assert torch.allclose(a, b, atol=1e-5)
    plain, _ = head_logprobs(head, hidden, targets, inv_temp, chunk=24, vocab_limit=10)
    assert not torch.allclose(lp, plain, atol=1e-3)  # the processing did change the log-probs
