"""The generation audit on a real pretrained model (SmolLM2-135M-Instruct, issue 44): honest batches from each
engine this machine runs pass, a fabricated one and a wrong-version one are rejected.

A pretrained model's logits are peaked and large (20-30), so an engine's dtype noise is far larger than with the
tiny random model the other audit tests use: a bf16 engine's rounded logits put it ~0.03 nats/token from the
audit's fp32 recomputation (fp32 engines: ~1e-5). Everything here is the coordinator's own: the config it
resolves for `--model smollm2-135m-instruct`, its learner (`make_learner`), `Auditor.from_config` (tolerance
learned per engine kind x dtype, coordinator/trust/audit_policy.py) and the `AuditWorker` that ingest hands a batch
claiming an older version to. The volunteers are the client's own engines loaded with the *published* (bf16)
adapter tensors; each batch names its engine kind and dtype as `client/rollout.py` does.

Versions: v0 is the zero adapter (PEFT's start), v1..v3 seeded non-zero adapters (the zero adapter is the base
model and hides the LoRA path's noise). The learner holds v3, so batches claiming v1 or v2 take the shadow-model
path, where every strike is decided. The only change to the coordinator's settings: its engine classes learn
from `LEARN_FROM` batches instead of 32 (same rule: clamp(margin x 0.95 quantile, audit_tolerance, the dtype's
ceiling)). Kept small (1 prompt x 2 completions x 8 tokens per batch): bf16 is emulated on CPUs without bf16
instructions and is slow.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.client.engine import TransformersEngine
from asyncrl.client.rollout import engine_dtype, engine_kind
from asyncrl.coordinator.config_file import resolve_config
from asyncrl.coordinator.ingest.ingest import AcceptedBatch
from asyncrl.coordinator.learner.ddp import make_learner
from asyncrl.coordinator.learner.learner import TrainGroup
from asyncrl.coordinator.trust.audit import Auditor
from asyncrl.coordinator.trust.audit_worker import AuditWorker
from asyncrl.models.lora import export_lora
from asyncrl.protocol import messages
from asyncrl.protocol.errors import RejectCode

QUESTIONS = ("What is 17 + 25? Answer with a number.", "Name the largest planet in the solar system.",
             "Write a haiku about the sea.", "What is the capital of Italy?")
LEARN_FROM = len(QUESTIONS) - 1  # the first batches are the class's learning period, the last is judged after it
GROUP, NEW_TOKENS = 2, 8
ADAPTER_SCALE = 0.02  # lora_B entries: about what some dozens of AdamW steps at lr 3e-4 move them (from zero)
CURRENT = 3  # the learner's version: batches claiming v1 or v2 are audited on the shadow model
IDLE_GUARD_S = 600.0  # only a hang guard for the audit thread: the test fails if it is ever reached


class Books:
    """What ingest does with the audit worker's verdicts: delivered batches go to the learner's queue,
    dropped ones are booked with their code and whether the signer was struck."""

    def __init__(self):
        self.delivered: list[bytes] = []
        self.dropped: dict[bytes, tuple[RejectCode, bool]] = {}

    def deliver(self, item) -> None:
        self.delivered.append(item.batch_id)

    def drop(self, item, code, strike) -> None:
        self.dropped[item.batch_id] = (code, strike)


def seed_adapter(model, seed: int) -> None:
    """Overwrite the LoRA weights with seeded random ones (B non-zero: an adapter that changes the policy)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * ADAPTER_SCALE)
            elif "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


@dataclasses.dataclass
class RealCoordinator:
    cfg: object  # CoordinatorConfig as the coordinator resolves it for `--model smollm2-135m-instruct`
    lora: messages.LoraSpec
    learner: object
    published: dict[int, tuple]  # version -> (specs, blobs) in the published dtype
    prompts: list[list[int]]     # chat-templated QUESTIONS
    sampling: messages.SamplingParams


def build_coordinator(model_path: str, run_dir) -> RealCoordinator:
    """The coordinator's config, learner and published versions v0 (zero), v1..v3 (seeded); learner at v3."""
    torch.set_num_threads(1)
    cfg = resolve_config({"model": "smollm2-135m-instruct", "run_dir": str(run_dir)})
    lora = messages.LoraSpec(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                             target_modules=tuple(cfg.lora_targets))
    learner = make_learner(model_path, lora, **cfg.learner_kwargs())
    published = {}
    for version, seed in ((0, None), (1, 1), (2, 2), (3, 3)):
        if seed is not None:
            seed_adapter(learner.model, seed)
        learner.version = version
        published[version] = export_lora(learner.model, cfg.publish_dtype)
    tok = learner.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for q in QUESTIONS]
    return RealCoordinator(cfg, lora, learner, published, prompts,
                           messages.SamplingParams(temperature=cfg.temperature, max_new_tokens=NEW_TOKENS))


@pytest.fixture(scope="module")
def coordinator(smollm2, tmp_path_factory) -> RealCoordinator:
    return build_coordinator(smollm2.path, tmp_path_factory.mktemp("real-audit"))


def audited(auditor, batches: dict[bytes, tuple[int, list[TrainGroup]]], kind: str, dtype: str) -> Books:
    """Each batch through the audit as ingest routes it (`Auditor.route`) and the AuditWorker runs it, in order."""
    books = Books()
    worker = AuditWorker(auditor, capacity=len(batches) + 1, current_version=lambda: CURRENT, deliver=books.deliver,
                         drop=books.drop)
    try:
        for batch_id, (version, groups) in batches.items():
            route = auditor.route(b"volunteer", batch_id, version, groups, valid_streak=0, current_version=CURRENT,
                                  engine_dtype=dtype, engine_kind=kind)
            assert route == "queued"  # an older version than the learner's: the shadow model's pass
            worker.submit(AcceptedBatch(batch_id, "volunteer", groups, 0.0, version, 0.0, signer_key=b"volunteer",
                                        engine_dtype=dtype, engine_kind=kind))
        assert worker.wait_idle(IDLE_GUARD_S)
    finally:
        worker.close()
    return books


def generate(engine, prompts, sampling, version: int) -> list[TrainGroup]:
    out = []
    for prompt, samples in zip(prompts, engine.generate(prompts, GROUP, sampling)):
        out.append(TrainGroup(list(prompt), [s.token_ids for s in samples], [list(s.logprobs) for s in samples],
                              [0.0] * len(samples), version, sampling.temperature))
    return out


def fabricated(groups) -> list[TrainGroup]:
    """The honest tokens with edited log-probs: confident (-0.05 a token) wherever the engine was not."""
    return [dataclasses.replace(g, sampling_logprobs=[[-0.05] * len(c) for c in g.completions]) for g in groups]


def claiming(groups, version: int) -> list[TrainGroup]:
    """The same batch claiming another adapter version than the one it was sampled with."""
    return [dataclasses.replace(g, version=version) for g in groups]


class JudgedStats:
    """The policy's verdicts in order, with each batch's statistic and the tolerance it was judged at."""

    def __init__(self, policy):
        self.seen: list[tuple[float, float, bool, bool]] = []  # stat, tolerance, ok, strike
        judge = policy.judge

        def recording(key, stat, *args, **kwargs):
            j = judge(key, stat, *args, **kwargs)
            self.seen.append((stat, j.tolerance, j.ok, j.strike))
            return j
        policy.judge = recording


def check_engine_class(coordinator: RealCoordinator, honest_groups: list[TrainGroup], kind: str, dtype: str,
                       *, fabricated_struck_at_once: bool = True) -> JudgedStats:
    """The must-show for one engine class (its batches sampled with v1, one batch per prompt): with the
    coordinator's policy, the honest batches all pass — the first ones while the class learns (at its dtype's
    ceiling), the last at the tolerance it learned — and the last batch with fabricated log-probs, or claiming
    v2, is rejected (LOGPROB_MISMATCH; fabricated numbers strike at once)."""
    cfg, learner = coordinator.cfg, coordinator.learner
    assert len(honest_groups) == LEARN_FROM + 1
    honest = [[g] for g in honest_groups]
    batches = {f"honest-{i}".encode(): (1, groups) for i, groups in enumerate(honest)}
    batches[b"fabricated"] = (1, fabricated(honest[-1]))
    batches[b"wrong-version"] = (2, claiming(honest[-1], 2))  # sampled with v1, claims v2
    auditor = Auditor.from_config(dataclasses.replace(cfg, audit_learn_batches=LEARN_FROM), learner)
    for version, (specs, blobs) in coordinator.published.items():
        auditor.remember_published(version, specs, blobs, learner.steps)
    policy = auditor.policy
    ceiling = policy.tolerance(dtype, kind)  # what a class that is still learning is judged by
    judged = JudgedStats(policy)

    books = audited(auditor, batches, kind, dtype)

    assert not policy.learning(dtype, kind)
    assert cfg.audit_tolerance <= policy.tolerance(dtype, kind) <= ceiling
    # every honest batch passed: the learning period's at the ceiling, the last one at the learned tolerance
    assert books.delivered == [k for k in batches if k.startswith(b"honest")], (books.dropped, policy.engines_status())
    # the liars' batches, judged at the learned tolerance, are rejected; fabricated numbers are a gross miss:
    # struck at once
    assert {k: code for k, (code, _) in books.dropped.items()} == {
        b"fabricated": RejectCode.LOGPROB_MISMATCH, b"wrong-version": RejectCode.LOGPROB_MISMATCH}
    assert auditor.stats["failed"] == 2, judged.seen
    assert books.dropped[b"fabricated"][1] == fabricated_struck_at_once, judged.seen
    return judged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_honest_real_weights_batches_pass_and_forged_ones_are_caught(coordinator, smollm2, dtype):
    """transformers+peft engines, as `asyncrl-client join --engine transformers` runs them."""
    engine = TransformersEngine(smollm2.path, coordinator.lora, dtype=dtype, seed=3)
    engine.load_adapter(1, *coordinator.published[1])
    honest = generate(engine, coordinator.prompts, coordinator.sampling, version=1)
    check_engine_class(coordinator, honest, engine_kind(engine), engine_dtype(engine))
