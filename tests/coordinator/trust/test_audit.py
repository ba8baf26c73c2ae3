"""Generation audit on the real tiny model: honest batches pass on both paths, forged ones fail, and a
batch failing on the learner's own forward pass is dropped before its gradient is applied."""

from __future__ import annotations

import pytest
import torch

from asyncrl import tasks
from asyncrl.client.engine import TransformersEngine
from asyncrl.coordinator.config import LORA_TARGETS
from asyncrl.coordinator.learner.learner import Learner, TrainGroup, sampling_knobs
from asyncrl.coordinator.learner.loss import LossConfig
from asyncrl.coordinator.trust.audit import Auditor, mismatch, per_completion, shadow_model
from asyncrl.models import tinymodel
from asyncrl.models.lora import export_lora
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.messages import LoraSpec, SamplingParams

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6)


class Verdicts:
    """Collects the auditor's verdict callbacks (what ingest would record)."""

    def __init__(self):
        self.seen: list[tuple[bytes, RejectCode | None, str]] = []

    def __call__(self, batch_id, signer, code, stage, strike=True):
        self.seen.append((batch_id, code, stage))


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    path = str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))
    lora = LoraSpec(r=8, alpha=16.0, dropout=0.0, target_modules=LORA_TARGETS)
    learner = Learner(path, lora, lr=5e-3, loss=LossConfig(), max_staleness=4)
    verdicts = Verdicts()
    auditor = Auditor(learner, tolerance=0.01, floor=0.05, keep_versions=5, on_verdict=verdicts)
    learner.audit_hook = auditor.train_hook
    engine = TransformersEngine(path, lora, seed=1)

    def publish():
        specs, blobs = export_lora(learner.model, "bf16")
        auditor.remember_published(learner.version, specs, blobs, learner.steps)
        engine.load_adapter(learner.version, specs, blobs)

    publish()
    return learner, auditor, engine, verdicts, publish


def honest_groups(learner, engine, n=2, seed=0, sampling=SAMPLING):
    source = tasks.get_task("repeat", seed)
    prompts = [next(source) for _ in range(n)]
    ids = [learner.tokenizer(p.text)["input_ids"] for p in prompts]
    out = []
    for p, pid, samples in zip(prompts, ids, engine.generate(ids, 8, sampling)):
        rewards = [tasks.score("repeat", learner.tokenizer.decode(s.token_ids), p.answer) for s in samples]
        out.append(TrainGroup(pid, [s.token_ids for s in samples], [list(s.logprobs) for s in samples], rewards,
                              engine.version, sampling.temperature, **sampling_knobs(sampling)))
    return out


def move_policy(learner, engine, seed):
    """One optimizer step that surely changes the adapter (rewards alternate, so advantages are non-zero)."""
    groups = honest_groups(learner, engine, n=4, seed=seed)
    for g in groups:
        g.rewards = [float(j % 2) for j in range(len(g.rewards))]
    assert learner.step(groups) is not None


def forged(groups):
    return [TrainGroup(g.prompt_ids, g.completions, [[-0.01] * len(c) for c in g.completions], g.rewards, g.version)
            for g in groups]


def test_shadow_model_shares_the_frozen_base(setup):
    learner = setup[0]
    shadow = shadow_model(learner.model)
    mine = dict(learner.model.named_parameters())
    for name, p in shadow.named_parameters():
        assert (p.data_ptr() == mine[name].data_ptr()) == (not mine[name].requires_grad), name
        assert not p.requires_grad


def test_probability_follows_the_track_record(setup):
    auditor = setup[1]
    assert auditor.probability(0) == 1.0 and auditor.probability(1) == 1.0
    assert auditor.probability(4) == 0.25 and auditor.probability(1000) == auditor.floor


def test_mismatch_is_the_worst_completions_trimmed_mean():
    rec = torch.tensor([[-1.0, -1.0, 0.0, 0.0], [-2.0, -2.0, -2.0, -2.0]])
    claimed = torch.tensor([[-1.0, -1.0, 0.0, 0.0], [-2.0, -2.6, -2.3, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert mismatch(rec, claimed, mask) == pytest.approx(0.1)  # 0.6 (its largest of 4) left out: 0.3 / 3


def test_one_touchy_token_does_not_decide_but_a_lie_on_most_tokens_does():
    """The heavy tail of an honest engine in another dtype: right on almost every token, 0.1-0.4 nats off on
    the odd one (measured: bf16 engine vs fp32 audit on a trained policy). A wrong-version or made-up
    completion is off on most of its tokens."""
    n = 16
    rec = torch.full((3, n), -1.0)
    mask = torch.ones(3, n)
    honest = rec.clone()
    honest[0] += 0.002
    honest[0, 5] += 0.36  # one touchy token
    lied = rec + 0.02     # a small lie on every token
    claimed = torch.stack([honest[0], rec[1], lied[2]])
    per = per_completion(rec, claimed, mask)
    assert per[0] == pytest.approx(0.002, abs=1e-6) and per[1] == 0.0
    assert per[2] == pytest.approx(0.02, abs=1e-6)
    assert mismatch(rec[:2], claimed[:2], mask[:2]) < 0.01 < mismatch(rec, claimed, mask)
    # the plain mean would have let the touchy token decide: 0.024 > 0.01
    assert float(((claimed[0] - rec[0]).abs()).mean()) > 0.01


def test_short_completions_are_judged_together():
    rec = torch.zeros(6, 8)
    mask = torch.zeros(6, 8)
    mask[:, 0] = 1.0                      # six 1-token completions
    claimed = torch.zeros(6, 8)
    claimed[0, 0] = 0.3                   # one touchy honest token: no verdict alone
    assert per_completion(rec[:1], claimed[:1], mask[:1]).tolist() == [0.0]  # a lone one: no evidence
    assert per_completion(rec[:3], claimed[:3] + 0.5 * mask[:3], mask[:3]).tolist() == [0.0] * 3  # 3 tokens: none
    assert mismatch(rec, claimed, mask) == 0.0   # pooled with five exact ones, it is the trimmed one
    lied = torch.full((6, 8), 0.05) * mask  # every short completion made up: caught together
    assert mismatch(rec, lied, mask) == pytest.approx(0.05)
    long_row = torch.zeros(1, 8)
    assert per_completion(torch.cat([rec, long_row]), torch.cat([lied, long_row + 0.05]),
                          torch.cat([mask, torch.ones(1, 8)]))[-1] == pytest.approx(0.05)


def test_ingest_time_audit_of_an_older_version(setup):
    learner, auditor, engine, verdicts, publish = setup
    old = honest_groups(learner, engine, seed=1)
    move_policy(learner, engine, seed=2)
    learner.version += 1
    publish()
    assert auditor.check(b"s", b"honest", 0, old, valid_streak=0, current_version=1) == "passed"
    with pytest.raises(ProtocolError) as e:
        auditor.check(b"s", b"forged", 0, forged(old), valid_streak=0, current_version=1)
    assert e.value.code is RejectCode.LOGPROB_MISMATCH
    with pytest.raises(ProtocolError) as e:  # generated with v0, claimed v1
        auditor.check(b"s", b"wrong", 1, [TrainGroup(g.prompt_ids, g.completions, g.sampling_logprobs, g.rewards, 1)
                                          for g in old], valid_streak=0, current_version=2)
    assert e.value.code is RejectCode.LOGPROB_MISMATCH
    with pytest.raises(ProtocolError) as e:  # older than the versions kept: refused as stale
        auditor.check(b"s", b"gone", 99, old, valid_streak=0, current_version=200)
    assert e.value.code is RejectCode.STALE_VERSION
    lost = auditor.stats["unavailable"]  # inside the kept window but not held (our loss): accepted, counted
    assert auditor.check(b"s", b"lost", 99, old, valid_streak=0, current_version=100) == "unavailable"
    assert auditor.stats["unavailable"] == lost + 1


def test_failing_batch_is_dropped_before_its_gradient(setup):
    learner, auditor, engine, verdicts, publish = setup
    v = learner.version
    honest = honest_groups(learner, engine, seed=3)
    liar = forged(honest_groups(learner, engine, seed=4))
    assert auditor.check(b"alice", b"h", v, honest, valid_streak=0, current_version=v) == "deferred"
    assert auditor.check(b"mallory", b"m", v, liar, valid_streak=0, current_version=v) == "deferred"
    verdicts.seen.clear()
    reused, confirms = auditor.stats["reused_learner_pass"], auditor.stats["shadow_confirms"]
    result = learner.step(honest + liar)
    assert result is not None and result.groups_used == len(honest)
    assert sorted(verdicts.seen) == [(b"h", None, "train"), (b"m", RejectCode.LOGPROB_MISMATCH, "train")]
    assert auditor.stats["reused_learner_pass"] == reused + 2  # both judged on the learner's own pass ...
    assert auditor.stats["shadow_confirms"] == confirms + 1  # ... and only the failing one re-checked
    # only liars in a step: nothing is trained at all
    learner.version += 1
    publish()
    liar = forged(honest_groups(learner, engine, seed=5))
    auditor.check(b"mallory", b"m2", learner.version, liar, valid_streak=0, current_version=learner.version)
    steps = learner.steps
    before = {k: p.detach().clone() for k, p in learner.model.named_parameters() if p.requires_grad}
    assert learner.step(liar) is None and learner.steps == steps
    assert all(torch.equal(p, before[k]) for k, p in learner.model.named_parameters() if p.requires_grad)


def test_deferred_audit_falls_back_to_the_shadow_model_once_the_learner_moved_on(setup):
    learner, auditor, engine, verdicts, publish = setup
    v = learner.version
    honest = honest_groups(learner, engine, seed=6)
    auditor.check(b"alice", b"h2", v, honest, valid_streak=0, current_version=v)
    move_policy(learner, engine, seed=7)  # weights change, version not yet bumped
    verdicts.seen.clear()
    shadow = auditor.stats["shadow_passes"]
    result = learner.step(honest)
    assert result is not None and result.groups_used == len(honest)
    assert verdicts.seen == [(b"h2", None, "train")] and auditor.stats["shadow_passes"] == shadow + 1


def test_a_deferred_batch_is_rejected_only_on_the_published_tensors(setup):
    """The learner's pass uses its fp32 LoRA weights, the volunteer the published bf16-rounded ones. A batch
    that is exact under the published tensors but off under the fp32 ones (here: a tolerance between the
    two, on an adapter big enough for bf16 rounding to show) passes: the shadow model re-checks it."""
    learner, auditor, engine, verdicts, publish = setup
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    learner.version += 1
    publish()  # bf16 tensors to the engine and the auditor; the learner keeps fp32
    v = learner.version
    honest = honest_groups(learner, engine, seed=8)
    live, _ = learner.score_groups(honest)
    exact, batch = auditor.shadow_logprobs(honest, v)
    s_live = mismatch(live, batch["sampling_logps"], batch["mask"])
    s_exact = mismatch(exact, batch["sampling_logps"], batch["mask"])
    assert s_exact * 10 < s_live, (s_exact, s_live)  # bf16 rounding is what separates them
    liar = forged(honest_groups(learner, engine, seed=9))
    old_tol, auditor.policy.base = auditor.policy.base, (s_exact * s_live) ** 0.5  # batches not naming a dtype get base
    try:
        auditor.check(b"alice", b"h3", v, honest, valid_streak=0, current_version=v)
        auditor.check(b"mallory", b"m3", v, liar, valid_streak=0, current_version=v)
        verdicts.seen.clear()
        confirms = auditor.stats["shadow_confirms"]
        result = learner.step(honest + liar)
    finally:
        auditor.policy.base = old_tol
    assert sorted(verdicts.seen) == [(b"h3", None, "train"), (b"m3", RejectCode.LOGPROB_MISMATCH, "train")]
    assert auditor.stats["shadow_confirms"] == confirms + 2 and result.groups_used == len(honest)
def test_a_restarted_auditor_checks_against_the_versions_it_kept_on_disk(setup, tmp_path):
    learner, _, engine, _, _ = setup
    verdicts = Verdicts()
    before = Auditor(learner, tolerance=0.01, keep_versions=3, store_dir=tmp_path / "audit_versions")
    specs, blobs = export_lora(learner.model, "bf16")
    v = 1000 + learner.version  # a version of its own, generated with by the engine below
    engine.load_adapter(v, specs, blobs)
    before.remember_published(v, specs, blobs, learner.steps)
    honest, liar = honest_groups(learner, engine, seed=11), forged(honest_groups(learner, engine, seed=12))
    for i in range(1, 4):  # newer versions push the oldest file out: the directory holds what memory holds
        before.remember_published(v + i, specs, blobs, learner.steps)
    assert sorted(p.name for p in (tmp_path / "audit_versions").iterdir()) == [
        f"v{x:010d}.safetensors" for x in (v + 1, v + 2, v + 3)]
    foreign = [tmp_path / "audit_versions" / name for name in ("v7.safetensors", "vnotes.safetensors")]
    for path in foreign:  # not the store's names: neither pruned nor loaded, nor taking a kept version's place
        path.write_bytes(b"not a version")
    before.remember_published(v, specs, blobs, learner.steps)  # v again (v + 1 goes): the three kept are on disk
    assert all(path.exists() for path in foreign)

    after = Auditor(learner, tolerance=0.01, keep_versions=4, store_dir=tmp_path / "audit_versions",
                    on_verdict=verdicts)  # a resumed coordinator
    assert after.load_persisted() == 3 and after.held_versions() == [v, v + 2, v + 3]
    assert not after._weights_are(v)  # never mistaken for the learner's weights
    assert after.check(b"s", b"spooled", v, honest, valid_streak=0, current_version=v + 4) == "passed"
    with pytest.raises(ProtocolError) as e:
        after.check(b"s", b"forged", v, liar, valid_streak=0, current_version=v + 4)
    assert e.value.code is RejectCode.LOGPROB_MISMATCH

    # A journal replay whose train-time audit was pending at the crash: audited, not trained unaudited.
    replayed = honest_groups(learner, engine, seed=13) + liar
    for g in replayed:
        g.version = v
    for g in replayed[:-len(liar)]:
        g.batch_id, g.audit = b"ok", True
    for g in liar:
        g.batch_id, g.audit = b"bad", True
    after.expect(b"ok", b"alice")
    after.expect(b"bad", b"mallory")
    hook, learner.audit_hook = learner.audit_hook, after.train_hook
    try:
        result = learner.step(replayed)
    finally:
        learner.audit_hook = hook
    assert result is not None and result.groups_used == len(replayed) - len(liar)
    assert sorted(verdicts.seen[-2:]) == [(b"bad", RejectCode.LOGPROB_MISMATCH, "train"), (b"ok", None, "train")]


def test_an_auditor_on_its_own_device_holds_a_full_copy_and_judges_the_same(setup):
    """--audit-device: shadow passes on another device than the learner's hold the whole model there. Here
    "cpu:0" names a device other than the learner's "cpu" (the only kind this machine has), so the full-copy
    path runs: no parameter shared with the learner, and the same verdicts as the shared-base auditor."""
    learner, auditor, engine, _, _ = setup
    own = Auditor(learner, tolerance=0.01, keep_versions=2, device="cpu:0")
    assert own.own_copy and not auditor.own_copy
    shared = {p.data_ptr() for p in learner.model.parameters()}
    assert not any(p.data_ptr() in shared for p in own.model.parameters())
    specs, blobs = export_lora(learner.model, "bf16")
    v = 5000 + learner.version  # a version of its own, served by the engine below
    engine.load_adapter(v, specs, blobs)
    own.remember_published(v, specs, blobs, learner.steps)
    honest = honest_groups(learner, engine, seed=21)
    assert own.check(b"s", b"h", v, honest, valid_streak=0, current_version=v + 1) == "passed"
    with pytest.raises(ProtocolError) as e:
        own.check(b"s", b"f", v, forged(honest), valid_streak=0, current_version=v + 1)
    assert e.value.code is RejectCode.LOGPROB_MISMATCH


TOP_P = SamplingParams(temperature=0.9, top_p=0.6, top_k=12, min_p=0.02, repetition_penalty=1.2, max_new_tokens=6)


def unprocessed(learner, groups):
    """A cheat's claim: each token's temperature-only log-prob (what the learner itself computes without
    the knobs), where the engine sampled from the top-p distribution."""
    plain = [TrainGroup(g.prompt_ids, g.completions, g.sampling_logprobs, g.rewards, g.version, g.temperature)
             for g in groups]
    logps, mask = learner.score_groups(plain)
    rows = [(gi, j) for gi, g in enumerate(groups) for j in range(len(g.completions))]
    out = [TrainGroup(g.prompt_ids, g.completions, [None] * len(g.completions), g.rewards, g.version, g.temperature,
                      **{k: getattr(g, k) for k in ("top_p", "top_k", "min_p", "repetition_penalty")})
           for g in groups]
    for i, (gi, j) in enumerate(rows):
        out[gi].sampling_logprobs[j] = logps[i, :len(groups[gi].completions[j])].tolist()
    return out


def test_an_honest_top_p_batch_passes_and_fabricated_ones_are_rejected(setup):
    """With top-p / top-k / min-p / repetition penalty the audit recomputes the processed distribution the
    volunteer sampled: an honest batch passes on both paths; logprobs forged, or reported for the
    untruncated distribution, are LOGPROB_MISMATCH."""
    learner, auditor, engine, verdicts, publish = setup
    learner.version += 1  # a fresh version: earlier tests stepped without publishing, or loaded one of their own
    publish()
    v = learner.version
    honest = honest_groups(learner, engine, n=3, seed=21, sampling=TOP_P)
    liar = forged(honest_groups(learner, engine, n=2, seed=22, sampling=TOP_P))
    untruncated = unprocessed(learner, honest_groups(learner, engine, n=2, seed=23, sampling=TOP_P))
    stat_honest = auditor._shadow_mismatch(honest, v)
    stat_untruncated = auditor._shadow_mismatch(untruncated, v)
    print(f"top-p audit statistic: honest {stat_honest:.2e}, untruncated claim {stat_untruncated:.2e}, "
          f"tolerance {auditor.tolerance:.2e}")
    # train-time path: judged on the learner's own forward pass, the liars dropped before the gradient
    for name, groups in ((b"h", honest), (b"m", liar), (b"u", untruncated)):
        assert auditor.check(name, name, v, groups, valid_streak=0, current_version=v) == "deferred"
    verdicts.seen.clear()
    result = learner.step(honest + liar + untruncated)
    assert result is not None and result.groups_used == len(honest)
    assert sorted(verdicts.seen) == [(b"h", None, "train"), (b"m", RejectCode.LOGPROB_MISMATCH, "train"),
                                     (b"u", RejectCode.LOGPROB_MISMATCH, "train")]
    # ingest-time path: the version they were generated with, now an older one, from the kept tensors
    learner.version += 1
    publish()
    assert auditor.check(b"s", b"honest-topp", v, honest, valid_streak=0, current_version=v + 1) == "passed"
    for name, groups in ((b"forged-topp", liar), (b"untruncated-topp", untruncated)):
        with pytest.raises(ProtocolError) as e:
            auditor.check(b"s", name, v, groups, valid_streak=0, current_version=v + 1)
        assert e.value.code is RejectCode.LOGPROB_MISMATCH


def test_the_audit_cost_is_reported_against_the_learners_time(setup):
    """The learner loop tells the auditor how long each step took; status() divides the audit's own time by it."""
    learner, _, engine, _, _ = setup
    own = Auditor(learner, tolerance=0.01, keep_versions=2)  # books of its own
    assert own.status()["cost_fraction_of_learner"] is None  # no learner step yet
    specs, blobs = export_lora(learner.model, "bf16")
    v = 6000 + learner.version
    engine.load_adapter(v, specs, blobs)
    own.remember_published(v, specs, blobs, learner.steps)
    assert own.check(b"s", b"c", v, honest_groups(learner, engine, seed=22), valid_streak=0,
                     current_version=v + 1) == "passed"
    own.learner_stepped(1.5)
    own.learner_stepped(2.5)
    s = own.status()
    assert s["learner_seconds"] == 4.0 and s["seconds_ingest"] > 0
    assert s["cost_fraction_of_learner"] == pytest.approx((s["seconds_ingest"] + s["seconds_train"]) / 4.0)
