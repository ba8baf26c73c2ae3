"""Micro-batching is exact: a step split into many micro-batches has the full-batch gradient and statistics,
for every loss normalisation, with and without the KL term; and the full-batch step itself equals plain
autograd over full-vocabulary logits. Plus the bf16-base step on CPU, gradient checkpointing and CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from asyncrl.coordinator.learner.learner import Learner, TrainGroup, plan_micro_batches
from asyncrl.coordinator.learner.loss import LossConfig, group_advantages, grpo_loss
from asyncrl.models import tinymodel
from asyncrl.protocol.messages import LoraSpec

LORA = LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj", "up_proj"))


@pytest.fixture(scope="module")
def tiny_path():
    torch.set_num_threads(1)
    return str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))


def groups(step: int, n: int = 4) -> list[TrainGroup]:
    """Prompts of different lengths, completions of 1-9 tokens, rewards that differ within each group."""
    rng = random.Random(step)
    out = []
    for g in range(n):
        prompt = [rng.randint(1, 40) for _ in range(rng.randint(3, 9))]
        comps = [[rng.randint(1, 40) for _ in range(rng.randint(1, 9))] for _ in range(rng.randint(3, 5))]
        out.append(TrainGroup(prompt, comps, [[-rng.uniform(0.5, 4.0) for _ in c] for c in comps],
                              [rng.random() for _ in comps], version=0, temperature=rng.choice([1.0, 0.7])))
    return out


def learner(path, cfg: LossConfig, **kw) -> Learner:
    """A learner whose adapter is already non-zero (PEFT starts lora_B at 0: the policy would be the
    reference and the KL gradient 0), identical for every learner built here."""
    kw.setdefault("max_grad_norm", 1e9)  # compare raw gradients
    lr = Learner(path, LORA, lr=5e-2, loss=cfg, max_staleness=None, seed=0, **kw)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(lr.model.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return lr


def grads(lr: Learner) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in lr.model.named_parameters() if p.requires_grad}


def assert_close(a: dict, b: dict, rtol=1e-4, atol=1e-7):
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


def test_plan_sorts_by_length_and_respects_the_budget():
    lengths = [5, 30, 12, 12, 7, 40, 3]
    plan = plan_micro_batches(lengths, 36)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    flat = [lengths[i] for mb in plan for i in mb]
    assert flat == sorted(lengths, reverse=True)
    for mb in plan:
        assert len(mb) == 1 or len(mb) * lengths[mb[0]] <= 36  # padded tokens within the budget
    assert plan[0] == [5]  # a row over the budget goes alone


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batched_step_equals_the_full_batch_step(tiny_path, loss_type, beta):
    cfg = LossConfig(loss_type=loss_type, beta=beta, correction="tis-sequence" if beta else "clip",
                     max_completion_length=9)
    full, micro = learner(tiny_path, cfg), learner(tiny_path, cfg, micro_batch_tokens=24)
    a, b = full.step(groups(1)), micro.step(groups(1))
    assert a.metrics["micro_batches"] == 1 and b.metrics["micro_batches"] >= 5
    assert_close(grads(full), grads(micro))
    for key in ("loss", "clip_fraction", "ratio_mean", "ratio_max", "ratio_min", "is_weight_mean", "kl_mean",
                "entropy_mean", "grad_norm"):
        assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-7), key
    if beta:
        assert a.metrics["kl_mean"] > 0
    assert a.tokens == b.tokens


@pytest.mark.parametrize("cfg", [LossConfig(correction="decoupled", prox_lag=4, stale_weighting="decay",
                                            stale_half_life=4.0),
                                 LossConfig(loss_type="dapo", correction="aipo", aipo_cap=1.5)])
def test_staleness_corrections_are_micro_batch_exact(tiny_path, cfg):
    """Version gaps 0, 5, 16, 20 in one step: the decoupled correction's per-row trust region, the decay
    weights (normalised over the whole step) and the off-policy statistics survive micro-batching."""
    stale = groups(2)
    for g, v in zip(stale, (20, 15, 4, 0)):
        g.version = v
    full, micro = learner(tiny_path, cfg), learner(tiny_path, cfg, micro_batch_tokens=24)
    full.version = micro.version = 20
    a, b = full.step(stale), micro.step(stale)
    assert b.metrics["micro_batches"] >= 5
    assert_close(grads(full), grads(micro))
    for key in ("loss", "clip_fraction", "log_ratio_m2", "is_weight_m2", "ess", "masked_fraction"):
        assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-7), key
    assert set(a.metrics["masked_by_staleness"]) == {"0", "5-8", "9-16", "17-32"}
    assert b.metrics["masked_by_staleness"] == pytest.approx(a.metrics["masked_by_staleness"])
    assert 0.0 < a.metrics["ess"] < 1.0 and a.metrics["masked_fraction"] > 0.0


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_full_batch_step_equals_plain_autograd_over_full_logits(tiny_path, loss_type):
    """The chunked LM head and the global normaliser reproduce the textbook computation."""
    cfg = LossConfig(loss_type=loss_type, beta=0.1, max_completion_length=9)
    lr = learner(tiny_path, cfg, micro_batch_tokens=24)
    batch = lr._collate(groups(1))
    with torch.no_grad(), lr.model.disable_adapter():
        ref = naive(lr.model, batch, len(lr.tokenizer))
    adv = group_advantages(batch["rewards"], batch["group_ids"], cfg.scale_rewards)
    stats = grpo_loss(naive(lr.model, batch, len(lr.tokenizer)), batch["sampling_logps"], adv, batch["mask"], cfg, ref_logps=ref)
    stats.loss.backward()
    expected = grads(lr)
    lr.step(groups(1))
    assert_close(grads(lr), expected)
    assert lr.steps == 1


def naive(model, batch, limit=None):
    """Full-vocabulary fp32 log-softmax over every position (what the learner avoids), completion-aligned;
    over the tokenizer's `limit` ids (the engines never sample the padded rows: models/logprobs.py)."""
    logits = model(input_ids=batch["ids"], attention_mask=batch["attn"]).logits.float()[..., :limit]
    logp = torch.log_softmax(logits / batch["temps"].view(-1, 1, 1), dim=-1)
    out = torch.zeros_like(batch["mask"])
    for i in range(batch["ids"].shape[0]):
        p, n = int(batch["prompt_lens"][i]), int(batch["comp_lens"][i])
        out[i, :n] = logp[i, p - 1:p - 1 + n].gather(1, batch["ids"][i, p:p + n].unsqueeze(1)).squeeze(1)
    return out


def test_bf16_base_step_on_cpu(tiny_path):
    cfg = LossConfig(beta=0.05)
    bf16, fp32 = learner(tiny_path, cfg, dtype="bf16"), learner(tiny_path, cfg, dtype="fp32")
    frozen = {p.dtype for p in bf16.model.parameters() if not p.requires_grad}
    trained = {p.dtype for p in bf16.model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trained == {torch.float32}  # bf16 base, fp32 master weights
    before = bf16.lora_parameters()
    for step in range(2):
        r16, r32 = bf16.step(groups(step)), fp32.step(groups(step))
    assert all(v.dtype == torch.float32 for st in bf16.optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim())  # AdamW moments in fp32
    assert r16.loss == r16.loss and r16.metrics["grad_norm"] > 0
    moved = sum(float((bf16.lora_parameters()[k] - before[k]).abs().sum()) for k in before)
    assert moved > 0
    g16, g32 = grads(bf16), grads(fp32)
    num = sum(float((g16[k] * g32[k]).sum()) for k in g16)
    den = (sum(float(g16[k].pow(2).sum()) for k in g16) * sum(float(g32[k].pow(2).sum()) for k in g32)) ** 0.5
    assert num / den > 0.99  # the same direction as the fp32 step, within bf16 rounding


def test_gradient_checkpointing_gives_the_same_gradient(tiny_path):
    cfg = LossConfig(loss_type="dapo")
    plain, ckpt = learner(tiny_path, cfg), learner(tiny_path, cfg, gradient_checkpointing=True)
    plain.step(groups(1))
    ckpt.step(groups(1))
    assert_close(grads(plain), grads(ckpt), rtol=1e-5, atol=1e-8)


@pytest.mark.gpu
def test_cuda_bf16_step(tiny_path):
    if not torch.cuda.is_available():
        pytest.skip("GPU test: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                    "run on a CUDA machine: pytest -m gpu tests/coordinator/learner/test_microbatch.py")
    cfg = LossConfig(beta=0.05)
    gpu = learner(tiny_path, cfg, device="cuda", dtype="auto", micro_batch_tokens=24, gradient_checkpointing=True)
    assert str(gpu.device).startswith("cuda") and gpu.dtype in (torch.bfloat16, torch.float16)
    assert all(p.is_cuda for p in gpu.model.parameters())
    cpu = learner(tiny_path, cfg, dtype="fp32")
    for step in range(2):
        rg, rc = gpu.step(groups(step)), cpu.step(groups(step))
    assert rg.metrics["grad_norm"] > 0 and rg.loss == pytest.approx(rc.loss, abs=5e-2)
