"""Audit policy (coordinator/trust/audit_policy.py): quarantine before strikes, tolerance per engine dtype, the
emulated calibration on the real tiny model against a real bf16 engine, and the tolerance each engine class
learns from its own batches (an honest engine noisier than the emulation is never struck; lies still are)."""

from __future__ import annotations

import json

import pytest
import torch

from asyncrl import tasks
from asyncrl.client.engine import TransformersEngine
from asyncrl.coordinator.config import LORA_TARGETS
from asyncrl.coordinator.learner.learner import Learner, TrainGroup
from asyncrl.coordinator.learner.loss import LossConfig
from asyncrl.coordinator.trust.audit import Auditor
from asyncrl.coordinator.trust.audit_policy import AuditPolicy, engine_class
from asyncrl.models import tinymodel
from asyncrl.models.lora import export_lora, tensors_from_bytes
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.messages import LoraSpec, SamplingParams
from asyncrl.tasks.sources import encode_prompt

KEY = b"k" * 32


def test_a_miss_quarantines_and_only_repeated_misses_strike():
    p = AuditPolicy(0.01, quarantine_passes=3, quarantine_strikes=3, gross_factor=10.0)
    assert p.judge(KEY, 0.005).ok and not p.in_quarantine(KEY)
    first = p.judge(KEY, 0.02)
    assert not first.ok and not first.strike and p.in_quarantine(KEY)  # rejected, audited from now on, no strike
    assert p.judge(KEY, 0.001).ok and p.judge(KEY, 0.001).ok
    assert not p.judge(KEY, 0.03).strike  # second miss inside the quarantine (it starts over)
    assert p.judge(KEY, 0.03).strike      # third: struck
    for _ in range(3):
        assert p.judge(KEY, 0.0).ok
    assert not p.in_quarantine(KEY)  # three clean audits in a row: released, the count starts afresh
    assert not p.judge(KEY, 0.02).strike
    assert p.judge(b"g" * 32, 0.5).strike  # a gross miss (fabricated numbers) strikes at once


def test_tolerance_per_engine_dtype():
    p = AuditPolicy(0.01, margin=3.0)
    assert p.tolerance("fp32") == p.tolerance("") == 0.01
    assert p.set_calibrated("bf16", [0.002, 0.004, 0.008]) == pytest.approx(0.024)
    assert p.set_calibrated("fp16", [1e-4]) == 0.01  # never below the base
    assert p.tolerance("bf16") == pytest.approx(0.024) and p.tolerance("") == 0.01  # unsaid: the strictest
    assert p.judge(KEY, 0.015, "bf16").ok and not p.judge(KEY, 0.015, "fp32").ok


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    path = str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))
    lora = LoraSpec(r=8, alpha=16.0, dropout=0.0, target_modules=LORA_TARGETS)
    learner = Learner(path, lora, lr=5e-3, loss=LossConfig(), max_staleness=4)
    with torch.no_grad():  # a policy that has moved (a fresh LoRA is the identity)
        for p in learner.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.02)
    return path, lora, learner


def groups_from(engine, learner, version, n, seed, sampling):
    source = tasks.get_task("repeat", seed)
    prompts = [list(encode_prompt(learner.tokenizer, next(source).text)) for _ in range(n)]
    return [TrainGroup(p, [s.token_ids for s in g], [list(s.logprobs) for s in g], [0.0] * len(g), version)
            for p, g in zip(prompts, engine.generate(prompts, 8, sampling))]


def test_calibrated_tolerance_admits_honest_bf16_engines_and_still_catches_lies(model):
    path, lora, learner = model
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    auditor = Auditor(learner, tolerance=0.002, keep_versions=2)  # a base so tight bf16 noise exceeds it
    specs, blobs = export_lora(learner.model, "bf16")
    source = tasks.get_task("repeat", 99)
    prompts = [list(encode_prompt(learner.tokenizer, next(source).text)) for _ in range(8)]
    status = auditor.calibrate(tensors_from_bytes(specs, blobs), prompts, temperature=1.0, max_new_tokens=8)
    bf16_tol = status["tolerances"]["bf16"]
    assert bf16_tol > 0.002 and status["calibration"]["bf16"]["n"] == 64
    assert status["tolerances"]["fp32"] == 0.002

    auditor.remember_published(0, specs, blobs, learner.steps)
    bf16 = TransformersEngine(path, lora, seed=5, dtype=torch.bfloat16)
    bf16.load_adapter(0, specs, blobs)
    honest_stats = []
    for i in range(12):  # an honest bf16 volunteer over many batches: never a miss, so never struck
        g = groups_from(bf16, learner, 0, 2, seed=i, sampling=sampling)
        assert auditor.check(b"bea", bytes([i]), 0, g, valid_streak=0, current_version=1, engine_dtype="bf16") == "passed"
        honest_stats.append(auditor.stats["max_passing_mismatch"])
    assert max(honest_stats) > 0.002  # the base tolerance alone would have rejected some of them
    assert not auditor.policy.in_quarantine(b"bea")
    liar = [TrainGroup(g.prompt_ids, g.completions, [[-0.05] * len(c) for c in g.completions], g.rewards, 0)
            for g in groups_from(bf16, learner, 0, 2, seed=50, sampling=sampling)]
    with pytest.raises(ProtocolError) as exc:  # claiming bf16 buys a liar no more than the bf16 tolerance
        auditor.check(b"mallory", b"m", 0, liar, valid_streak=0, current_version=1, engine_dtype="bf16")
    assert exc.value.code is RejectCode.LOGPROB_MISMATCH and exc.value.strike  # gross: struck at once


# ---- tolerance learned per engine class (kind x dtype) ------------------------------------------------------------
def test_a_new_engine_class_learns_its_tolerance_and_cannot_strike_meanwhile():
    p = AuditPolicy(0.01, margin=3.0, learn_batches=4, learn_tolerance=0.05, learn_tolerance_half=0.1,
                    quarantine_strikes=2)
    assert engine_class("vllm", "bf16") == "vllm/bf16" and engine_class("sglang", "fp16") == "other/fp16"
    assert engine_class("", "bf16") == "unknown/bf16" and engine_class("vllm", "") == ""
    # the conservative ceiling of its dtype: half-precision engines round their logits, so theirs is higher
    assert p.learning("bf16", "vllm") and p.tolerance("bf16", "vllm") == 0.1
    assert p.tolerance("fp16", "other") == 0.1 and p.tolerance("fp32", "vllm") == 0.05
    assert p.tolerance("", "vllm") == 0.01 and not p.learning("", "vllm")  # no dtype said: the strictest, no learning
    for stat in (0.9, 0.9, 0.9):  # even gross misses while learning: rejected, quarantined, never struck
        j = p.judge(KEY, stat, "bf16", "vllm")
        assert not j.ok and not j.strike and p.in_quarantine(KEY)
    assert p.judge(KEY, 0.012, "bf16", "vllm", trained=False).ok  # an untrained adapter's batch: judged, not a sample
    assert p.engines_status()["vllm/bf16"]["samples"] == 3 and p.engines_status()["vllm/bf16"]["untrained"] == 1
    assert p.judge(KEY, 0.004, "bf16", "vllm").ok  # 4th sample: learned from the quantile, capped at the ceiling
    assert not p.learning("bf16", "vllm") and p.tolerance("bf16", "vllm") == 0.1
    assert p.learning("fp32", "vllm") and p.learning("bf16", "transformers")  # every class learns on its own

    q = AuditPolicy(0.01, margin=3.0, learn_batches=4, learn_tolerance=0.05)
    for stat in (0.004, 0.006, 0.008, 0.011):  # honest, some over the base
        assert q.judge(KEY, stat, "fp32", "transformers").ok
    assert q.tolerance("fp32", "transformers") == pytest.approx(3 * 0.011)  # 0.95 quantile of 4 = the largest
    assert q.tolerance("fp32", "transformers") > q.base  # learned from the engine, not floored
    assert not q.judge(KEY, 0.04, "fp32", "transformers").ok
    assert q.judge(KEY, 0.9, "fp32", "transformers").strike  # learned: a gross miss strikes again

    r = AuditPolicy(0.01, learn_batches=4, learn_tolerance=0.05)  # a resumed coordinator
    assert r.load_state(json.loads(json.dumps(q.state()))) == 1
    assert r.tolerance("fp32", "transformers") == q.tolerance("fp32", "transformers") and not r.learning("fp32", "transformers")
    assert r.load_state({"engines": {"x/y": {"tolerance": "nan?"}, "bad": 3}}) == 0  # torn entries are skipped
    s = AuditPolicy(0.01, learn_batches=4, learn_tolerance=0.05, learn_tolerance_half=0.1)
    assert s.load_state({"engines": {"vllm/bf16": {"tolerance": 9.0, "samples": [1.0] * 4},
                                     "vllm/fp32": {"tolerance": 9.0, "samples": [1.0] * 4}}}) == 2
    assert (s.tolerance("bf16", "vllm"), s.tolerance("fp32", "vllm")) == (0.1, 0.05)  # never above its ceiling


class KernelNoiseEngine:
    """An honest engine whose kernels differ from the learner's: it samples with a real TransformersEngine and
    reports each token's logprob off by a little seeded noise, as another attention/reduction order would
    (docs/SECURITY.md: vLLM's GPU kernels vs HF's). The tokens are honest; so are the numbers, within its noise."""

    name = "vllm"

    def __init__(self, engine, sigma: float, seed: int = 0):
        self.engine, self.sigma = engine, sigma
        self.gen = torch.Generator().manual_seed(seed)

    def generate(self, prompts, group_size, sampling):
        out = self.engine.generate(prompts, group_size, sampling)
        for group in out:
            for s in group:
                s.logprobs = [min(0.0, lp + float(torch.randn(1, generator=self.gen)) * self.sigma) for lp in s.logprobs]
        return out


def test_learned_tolerance_admits_an_honest_engine_noisier_than_the_emulation_and_still_catches_lies(model):
    """The start-up emulation (autocast on the learner) cannot see an engine's kernels: here its tolerance is
    under what an honest engine measures, so that engine would be quarantined and struck. Learning from the
    engine's own batches admits it, and fabricated or wrong-version batches are still caught afterwards."""
    path, lora, learner = model
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    specs, blobs = export_lora(learner.model, "bf16")
    tensors = tensors_from_bytes(specs, blobs)
    source = tasks.get_task("repeat", 99)
    prompts = [list(encode_prompt(learner.tokenizer, next(source).text)) for _ in range(8)]
    emulated = Auditor(learner, tolerance=0.01, keep_versions=2).calibrate(tensors, prompts, temperature=1.0,
                                                                          max_new_tokens=8)["tolerances"]
    policy = AuditPolicy(0.01, margin=3.0, learn_batches=8, learn_tolerance=0.05)
    auditor = Auditor(learner, keep_versions=3, policy=policy, floor=0.05)
    auditor.remember(1, tensors, learner.steps)
    zero = {k: (torch.zeros_like(v) if "lora_B" in k else v) for k, v in tensors.items()}
    auditor.remember(0, zero, learner.steps)  # the fresh adapter: audited, never learned from
    engine = TransformersEngine(path, lora, seed=5)
    engine.load_adapter(1, specs, blobs)
    vllm_like = KernelNoiseEngine(engine, sigma=0.015, seed=3)

    assert auditor._trained == {1: True, 0: False}
    g = groups_from(vllm_like, learner, 0, 2, seed=99, sampling=sampling)  # claimed on the zero adapter
    try:
        auditor.check(b"vic", b"zero", 0, g, valid_streak=50, current_version=2, engine_dtype="fp32", engine_kind="vllm")
    except ProtocolError as exc:  # v1's tokens under v0: whatever the verdict, no strike while learning
        assert exc.code is RejectCode.LOGPROB_MISMATCH and not exc.strike
    assert auditor.engines_status()["vllm/fp32"]["samples"] == 0

    stats = []
    for i in range(14):  # learning (8 batches on the trained adapter), then judged by what it learned
        if i == 8:
            assert auditor.engines_status()["vllm/fp32"]["state"] == "learned"
            auditor.floor = 1.0  # a streak of 50 is audited at the floor: audit every batch from here on
        g = groups_from(vllm_like, learner, 1, 2, seed=i, sampling=sampling)
        stats.append(auditor._shadow_mismatch(g, 1))
        # while learning, every batch of the class is audited, whatever the key's track record (streak 50)
        assert auditor.check(b"vic", bytes([i]), 1, g, valid_streak=50, current_version=2, engine_dtype="fp32",
                             engine_kind="vllm") == "passed"
    engines = auditor.engines_status()
    assert engines["vllm/fp32"]["samples"] == 8 and engines["vllm/fp32"]["untrained"] == 1
    learned = policy.tolerance("fp32", "vllm")
    assert max(stats) > max(emulated.values()), (stats, emulated)  # the emulated tolerances would reject it
    assert 0.01 < learned <= 0.05 and not policy.in_quarantine(b"vic") and policy.stats["strikes"] == 0

    liar = [TrainGroup(g.prompt_ids, g.completions, [[-0.05] * len(c) for c in g.completions], g.rewards, 1)
            for g in groups_from(engine, learner, 1, 2, seed=50, sampling=sampling)]
    with pytest.raises(ProtocolError) as exc:  # fabricated logprobs, same engine class: caught and struck
        auditor.check(b"mallory", b"m", 1, liar, valid_streak=50, current_version=2, engine_dtype="fp32",
                      engine_kind="vllm")
    assert exc.value.code is RejectCode.LOGPROB_MISMATCH and exc.value.strike
    moved = {k: (v + 0.3 * torch.randn(v.shape, generator=torch.Generator().manual_seed(7)).to(v.dtype)
                 if "lora_" in k else v) for k, v in tensors.items()}
    auditor.remember(2, moved, learner.steps)
    wrong = [TrainGroup(g.prompt_ids, g.completions, g.sampling_logprobs, g.rewards, 2)
             for g in groups_from(engine, learner, 1, 2, seed=51, sampling=sampling)]  # made with v1, claimed v2
    with pytest.raises(ProtocolError) as exc:
        auditor.check(b"mallory2", b"w", 2, wrong, valid_streak=50, current_version=3, engine_dtype="fp32",
                      engine_kind="vllm")
    assert exc.value.code is RejectCode.LOGPROB_MISMATCH
