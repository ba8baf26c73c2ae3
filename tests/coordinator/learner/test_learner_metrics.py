"""Learner, in-process with the tiny model: log-probabilities, staleness handling and step metrics."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.coordinator.learner.learner import Learner, TrainGroup
from asyncrl.coordinator.learner.loss import LossConfig
from asyncrl.models import tinymodel
from asyncrl.protocol.messages import LoraSpec

LORA = LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"))


@pytest.fixture(scope="module")
def tiny_path():
    return str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))


def _groups(learner: Learner, version: int, n: int = 2, temperature: float = 1.0) -> list[TrainGroup]:
    tok = learner.tokenizer
    out = []
    for i in range(n):
        prompt = tok(f"rep:{'abcd'[i % 4]}=" + "x" * i)["input_ids"]  # prompt lengths differ
        comps = [tok("a" * (1 + j))["input_ids"] for j in range(3)]
        out.append(TrainGroup(prompt_ids=prompt, completions=comps,
                              sampling_logprobs=[[-1.5] * len(c) for c in comps],
                              rewards=[0.0, 0.5, 1.0], version=version, temperature=temperature))
    return out


def test_completion_logprobs_match_a_naive_full_softmax(tiny_path):
    learner = Learner(tiny_path, LORA, lr=1e-3, loss=LossConfig(), max_staleness=None)
    groups = _groups(learner, 0, n=3, temperature=0.7)
    batch = learner._collate(groups)
    with torch.no_grad():
        fast = learner._completion_logprobs(batch)
        logits = learner.model(input_ids=batch["ids"], attention_mask=batch["attn"]).logits / 0.7
        logits = logits[..., :len(learner.tokenizer)]  # the tokenizer's ids: the padded rows are never sampled
        logp = torch.log_softmax(logits, dim=-1)
    for i in range(batch["ids"].shape[0]):
        p, n = int(batch["prompt_lens"][i]), int(batch["comp_lens"][i])
        for j in range(n):
            expected = logp[i, p + j - 1, batch["ids"][i, p + j]]
            assert fast[i, j].item() == pytest.approx(expected.item(), abs=1e-5)
        assert (fast[i, n:] == 0).all()


def test_step_drops_stale_groups_and_reports_metrics(tiny_path):
    learner = Learner(tiny_path, LORA, lr=1e-2, loss=LossConfig(correction="tis-token"), max_staleness=2)
    learner.version = 5
    result = learner.step(_groups(learner, 5, 2) + _groups(learner, 3, 1) + _groups(learner, 1, 2))
    assert result.groups_used == 3 and result.groups_dropped_stale == 2
    m = result.metrics
    assert m["staleness_hist"] == {"0": 2, "2": 1}
    assert m["groups_dropped_stale"] == 2 and m["staleness_max"] == 2
    for key in ("loss", "ratio_mean", "ratio_max", "ratio_min", "clip_fraction", "clip_low_fraction",
                "clip_high_fraction", "is_weight_mean", "is_truncated_fraction", "kl_mean", "log_ratio_m2",
                "is_weight_m2", "ess", "masked_fraction"):
        assert key in m and m[key] == m[key], key  # present and not NaN
    assert set(m["masked_by_staleness"]) == {"0", "2"}  # one entry per version gap trained on
    assert 0.0 < m["ess"] <= 1.0
    assert m["ratio_min"] <= m["ratio_mean"] <= m["ratio_max"]
    assert m["grad_norm"] > 0 and m["tokens_per_s"] > 0 and m["micro_batches"] == 1 and m["lr"] == 1e-2
    assert 0.0 < m["entropy_mean"] <= math.log(learner.vocab_size)  # nats, at most uniform over the vocabulary
    assert result.tokens == sum(len(g.prompt_ids) * 3 + sum(map(len, g.completions))
                                for g in _groups(learner, 5, 2) + _groups(learner, 3, 1))
    assert learner.step(_groups(learner, 0, 2)) is None  # everything stale: no step


def test_unlimited_staleness_uses_everything(tiny_path):
    learner = Learner(tiny_path, LORA, lr=1e-2, loss=LossConfig(correction="tis-token"), max_staleness=None)
    learner.version = 40
    result = learner.step(_groups(learner, 0, 2) + _groups(learner, 39, 1))
    assert result.groups_used == 3 and result.groups_dropped_stale == 0
    assert result.metrics["staleness_hist"] == {"1": 1, "40": 2}


def test_kl_reference_is_the_base_model(tiny_path):
    learner = Learner(tiny_path, LORA, lr=5e-2, loss=LossConfig(beta=0.1), max_staleness=None)
    first = learner.step(_groups(learner, 0))
    # PEFT initialises lora_B to zero: before the first update the adapted policy *is* the base model
    assert first.metrics["kl_mean"] == pytest.approx(0.0, abs=1e-7)
    second = learner.step(_groups(learner, 0))
    assert second.metrics["kl_mean"] > 0.0


def _lora_moved(learner: Learner, groups) -> float:
    before = learner.lora_parameters()
    learner.step(groups)
    after = learner.lora_parameters()
    return max(float((after[k] - before[k]).abs().max()) for k in before)


def _truncation_groups(learner: Learner, truncated: list[bool], rewards: list[float]) -> list[TrainGroup]:
    tok = learner.tokenizer
    comps = [tok("a" * n)["input_ids"] for n in (4, 6, 8)]
    return [TrainGroup(prompt_ids=tok("rep:a=")["input_ids"], completions=comps,
                       sampling_logprobs=[[-1.5] * len(c) for c in comps], rewards=rewards, version=0,
                       truncated=truncated)]


def test_mask_truncated_takes_truncated_completions_out_of_the_loss(tiny_path):
    # rewards [0, 1, 0.5]: the third completion has advantage 0, the two truncated ones carry all the signal
    groups = lambda lr: _truncation_groups(lr, [True, True, False], [0.0, 1.0, 0.5])
    masked = Learner(tiny_path, LORA, lr=1e-2, loss=LossConfig(mask_truncated=True), max_staleness=None)
    assert _lora_moved(masked, groups(masked)) == 0.0
    plain = Learner(tiny_path, LORA, lr=1e-2, loss=LossConfig(), max_staleness=None)
    assert _lora_moved(plain, groups(plain)) > 1e-4
    result = plain.step(groups(plain))
    assert result.metrics["truncated_fraction"] == pytest.approx(2 / 3)


def test_soft_overlong_penalty_shapes_the_advantage(tiny_path):
    # equal task rewards: no GRPO signal at all, unless the length penalty tells the completions apart
    equal = lambda lr: _truncation_groups(lr, [False] * 3, [1.0, 1.0, 1.0])
    off = Learner(tiny_path, LORA, lr=1e-2, loss=LossConfig(max_completion_length=8), max_staleness=None)
    assert _lora_moved(off, equal(off)) == 0.0
    on = Learner(tiny_path, LORA, lr=1e-2, loss=LossConfig(max_completion_length=8, overlong_buffer=4),
                 max_staleness=None)
    assert _lora_moved(on, equal(on)) > 1e-4
    result = on.step(equal(on))
    # lengths 4, 6, 8 against L_max 8, L_cache 4: penalties 0, -0.5, -1
    assert result.metrics["overlong_penalty_mean"] == pytest.approx(-0.5)
    assert result.reward_mean == pytest.approx(1.0)  # reported reward stays the task's


def test_next_version_moves_the_staleness_yardstick(tiny_path):
    learner = Learner(tiny_path, LORA, lr=1e-2, loss=LossConfig(), max_staleness=1)
    assert learner.version == 0 and not learner.is_stale(0)
    assert learner.next_version() == 1 and not learner.is_stale(0)
    assert learner.next_version() == 2 and learner.is_stale(0) and not learner.is_stale(1)
    result = learner.step(_groups(learner, 0, 1) + _groups(learner, 2, 1))
    assert result.groups_used == 1 and result.groups_dropped_stale == 1
