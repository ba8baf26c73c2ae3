"""Audit policy (coordinator/audit_policy.py): quarantine before strikes, tolerance per engine dtype, and the
start-up calibration on the real tiny model against a real bf16 engine."""

from __future__ import annotations

import pytest
import torch

from asyncrl import tasks
from asyncrl.client.engine import TransformersEngine
from asyncrl.coordinator.audit import Auditor
from asyncrl.coordinator.audit_policy import AuditPolicy
from asyncrl.coordinator.config import LORA_TARGETS
from asyncrl.coordinator.learner import Learner, TrainGroup
from asyncrl.coordinator.loss import LossConfig
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
