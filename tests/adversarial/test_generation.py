"""mallory vs the generation audit: completions that are not what the claimed adapter would produce.

Rewards are right in every batch here (recomputed anyway), so only the logprob audit
(coordinator/trust/audit.py) can catch them. mallory's keys are new, so every batch of hers is audited: at
ingest on the shadow model when she claims an older version, or on the learner's own forward pass
(verdict after the ack, before any gradient) when she claims the current one.
A claim older than max_staleness (16 here) is not audited at all (the learner drops such batches unread),
which would prove nothing here; a claim of a version not yet published is refused FUTURE_VERSION before any
audit (CI run r3 of 2026-12-03). So she generates with a published adapter she holds (`published()`) and
claims the learner's newest published version, read from the run's metrics right before she seals: the
learner publishes about a version a second here, so a claim named before the slow part (following, loading
an engine, generating) went stale under load (CI runs s3 and on 6db31f3: ACCEPTED). Her leases are renewed
while she works (`mallory.leased`), as a volunteer's are, so a slow machine cannot turn an audit verdict into
UNKNOWN_LEASE.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from asyncrl.models.lora import tensors_from_bytes
from asyncrl.protocol import messages
from asyncrl.protocol.identity import Identity

from tests.adversarial.swarm import MAX_STALENESS, batch_id_of, completion, replace_completions

pytestmark = pytest.mark.integration


def published(mallory):
    """Her newest adapter, once it is at least the version of her last lease grant: published, and as fresh as
    the work she was leased (what she generates with; her claims are read from the run right before sealing)."""
    return mallory.follow(at_least=mallory.coordinator_version)


def test_fabricated_logprobs(mallory, attack):
    rec = attack("fabricated logprobs", "honest tokens, made-up logprobs (uniform random / all -0.01)")
    rng = random.Random(0)
    for make in (lambda n: [-rng.uniform(0.0, 4.0) for _ in range(n)], lambda n: [-0.01] * n):
        ident = Identity.generate()
        with mallory.leased(ident, 1) as leases:
            current = published(mallory)
            groups = replace_completions(mallory.generate(leases, current), lambda c: messages.Completion(
                c.token_ids, np.asarray(make(len(c.token_ids) // 4), dtype="<f4").tobytes(), c.reward, c.finish_reason))
            sealed = mallory.seal(ident, messages.encode(mallory.batch(groups, mallory.swarm.current_version())))
            code = mallory.final_code(sealed)
        rec.saw(code)
        assert code == "LOGPROB_MISMATCH", mallory.swarm.explain(batch_id_of(sealed))


def test_fabricated_completions(mallory, attack):
    rec = attack("fabricated completions", "hand-written rewarded answers with confident made-up logprobs")
    from asyncrl import tasks

    ident = Identity.generate()
    with mallory.leased(ident, 1) as leases:
        published(mallory)  # her engine loaded (its tokenizer writes the answers)
        tok = mallory.engine.tokenizer
        groups = []
        for lease in leases:
            ids = tok(lease.answer * 8)["input_ids"][:8]
            reward = tasks.score(lease.reward, tok.decode(ids, skip_special_tokens=True), lease.answer)
            comps = tuple(completion(ids, [-0.01] * len(ids), reward) for _ in range(lease.group_size))
            groups.append(messages.RolloutGroup(lease_id=lease.lease_id, prompt_id=lease.prompt_id,
                                                prompt_token_ids=lease.prompt_token_ids, completions=comps))
        sealed = mallory.seal(ident, messages.encode(mallory.batch(groups, mallory.swarm.current_version())))
        code = mallory.final_code(sealed)
    rec.saw(code)
    assert code == "LOGPROB_MISMATCH", mallory.swarm.explain(batch_id_of(sealed))


def test_completions_from_another_adapter_version(mallory, swarm, attack):
    rec = attack("wrong adapter version", "generated with an old version but claimed current; and the reverse "
                 "(each verdict checked against what the claimed version itself assigns her tokens)")
    oldest = min(mallory.adapters)
    mallory.follow(at_least=max(oldest + 3, 8))  # let the policy move on from what she kept
    # (a) old tokens and logprobs, claimed as the current version (dodging the staleness bound)
    ident = Identity.generate()
    with mallory.leased(ident, 1) as leases:
        groups = mallory.generate(leases, mallory.adapters[oldest])
        claim = swarm.current_version()
        claimed = audit_copy(swarm, claim)
        sealed = mallory.seal(ident, messages.encode(mallory.batch(groups, claim)))
        code = mallory.final_code(sealed)
    truth = claimed_version_mismatch(mallory, groups, claimed)
    expect_verdict(rec, code, truth, f"hers v{oldest}, claimed v{claim}", swarm, sealed)
    # (b) her newest tokens, claimed as another version that is still held (max_staleness is 16 here).
    # Far apart; still, late in training versions can be closer than the tolerance (CI on 12c2794: hers
    # v131, claimed v123, accepted) — and then the claim is also harmless (docs/SECURITY.md).
    ident = Identity.generate()
    with mallory.leased(ident, 1) as leases:
        mine = published(mallory)
        groups = mallory.generate(leases, mine)
        claim = far_held_version(swarm, mine.version)
        claimed = audit_copy(swarm, claim)
        stored = audit_copy(swarm, mine.version, missing_ok=True)  # gone when her follower lags far behind
        sealed = mallory.seal(ident, messages.encode(mallory.batch(groups, claim)))
        code = mallory.final_code(sealed)
    # the yardstick itself: her tokens under the tensors she generated with are hers, and the audit store
    # holds those very tensors for her version
    own = tensors_from_bytes(mine.manifest.tensors, mine.tensors)
    honest = claimed_version_mismatch(mallory, groups, own)
    assert honest < 1e-4, f"her tokens under her own v{mine.version}: {honest:.3g}, not ~0"
    assert stored is None or (stored.keys() == own.keys() and all(torch.equal(stored[k], own[k]) for k in own))
    truth = claimed_version_mismatch(mallory, groups, claimed)
    expect_verdict(rec, code, truth, f"hers v{mine.version}, claimed v{claim}", swarm, sealed)


def far_held_version(swarm, mine: int) -> int:
    """The version farthest from `mine` among those the coordinator will still hold when her batch arrives.

    Chosen from the learner's version read just before sealing, not from the version she generated with:
    the learner publishes one to four versions a second here, so a claim fixed before generating (mine - 8)
    went stale under load while she generated (CI on 6db31f3: ACCEPTED). A window of max_staleness - 6
    leaves six versions for sealing and submitting; at least 5 apart inside it whatever `mine` is.

    Only versions the audit store holds: a version the publisher superseded while queued (latest wins) is
    never published, so the window has gaps (a local run of 2026-12-06 chose v173, which never existed)."""
    now = swarm.current_version()
    from asyncrl.coordinator.trust.audit import stored_versions

    published = stored_versions(swarm.run / "audit_versions")
    held = [v for v in range(max(1, now - (MAX_STALENESS - 6)), now + 1) if v in published]
    claim = max(held, key=lambda v: abs(v - mine))
    assert abs(claim - mine) >= 5, (mine, now, held)
    return claim


NOISE = 2e-3
"""How far the audit's statistic may sit from `claimed_version_mismatch` on the same batch. The shadow path
loads the very tensors read here (float noise, about 1e-7); a claim of the learner's current version is
judged on the learner's own pass, whose fp32 LoRA weights differ from the published bf16 ones by up to
1.5e-3 on honest batches (docs/SECURITY.md, calibration table), and is re-checked on the shadow only when
it fails there."""


def expect_verdict(rec, code: str, truth: float, what: str, swarm, sealed: bytes) -> None:
    """The audit's verdict must be what the claimed version's own logprobs say: rejected when hers are off
    by more than the tolerance, accepted (harmless: the learner computes the same numbers, within the
    tolerance) when not. Only a claim within NOISE of the tolerance may go either way; the table's note
    says which case each claim was."""
    tolerance = float(swarm.trust()["audit"]["tolerance"])
    detail = f"{what}: true mismatch {truth:.4g} (tolerance {tolerance:g}): {swarm.explain(batch_id_of(sealed))}"
    if truth > tolerance + NOISE:
        case, expected = "off", ("LOGPROB_MISMATCH",)
    elif truth < tolerance - NOISE:
        case, expected = "within the tolerance: harmless", ("ACCEPTED",)
    else:
        case, expected = "at the tolerance: either verdict", ("ACCEPTED", "LOGPROB_MISMATCH")
    rec.saw(code, rejected=code != "ACCEPTED")
    rec.note = (rec.note + "; " if rec.note else "") + f"{what}: mismatch {truth:.2g} ({case})"
    assert code in expected, detail


def audit_copy(swarm, version: int, missing_ok: bool = False) -> dict | None:
    """The published LoRA tensors of `version` as the coordinator's audit keeps them
    (`<run_dir>/audit_versions/`, exactly what its shadow model loads; written before the version is
    visible, pruned a few seconds after it leaves the held window): read at once, judged later."""
    from safetensors.torch import load_file

    from asyncrl.coordinator.trust.audit import stored_version_path

    path = stored_version_path(swarm.run / "audit_versions", version)
    try:
        return load_file(str(path))
    except FileNotFoundError:
        if missing_ok:
            return None
        raise AssertionError(f"v{version} is not in the audit store: {sorted(p.name for p in path.parent.iterdir())}")


def claimed_version_mismatch(mallory, groups, tensors: dict) -> float:
    """What the audit should measure for `groups` claimed as the version whose published `tensors` these are,
    computed independently of it: her tokens teacher-forced through her engine's model carrying those
    tensors, processed as her engine samples (ids past the tokenizer's length masked), compared with the
    logprobs she reported by the audit's own statistic (`audit.mismatch`)."""
    from asyncrl.client.engine import processed_logprobs
    from asyncrl.coordinator.trust.audit import mismatch
    from asyncrl.models.lora import load_lora

    engine = mallory.engine
    load_lora(engine.model, {k: v.to(engine.dtype) for k, v in tensors.items()})
    engine.version = None  # her next generate() loads her own adapter back
    sampling = mallory.batch(groups, 0).sampling
    recomputed, claimed = [], []
    with torch.no_grad():
        for g in groups:
            prompt = np.frombuffer(g.prompt_token_ids, dtype="<i4").tolist()
            for c in g.completions:
                tokens = np.frombuffer(c.token_ids, dtype="<i4").tolist()
                logits = engine.model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
                logps = processed_logprobs(logits[len(prompt) - 1:-1], sampling, vocab_limit=len(engine.tokenizer))
                recomputed.append(logps.gather(1, torch.tensor(tokens)[:, None]).squeeze(1))
                claimed.append(torch.from_numpy(np.frombuffer(c.logprobs, dtype="<f4").copy()))
    width = max(len(r) for r in recomputed)

    def rows(xs):
        return torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in xs])
    return mismatch(rows(recomputed), rows(claimed), rows([torch.ones(len(r)) for r in recomputed]))


def test_completions_from_another_base_model(mallory, attack):
    rec = attack("another base model", "the published adapter on a different base model (cheaper or poisoned)")
    from asyncrl.client.engine import TransformersEngine
    from asyncrl.models import tinymodel

    ident = Identity.generate()
    with mallory.leased(ident, 1) as leases:
        current = published(mallory)
        other = tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir().with_name("tiny-other-base"), seed=1)
        engine = TransformersEngine(str(other), current.manifest.lora, seed=3)
        groups = mallory.generate(leases, current, engine=engine)
        sealed = mallory.seal(ident, messages.encode(mallory.batch(groups, mallory.swarm.current_version())))
        code = mallory.final_code(sealed)
    rec.saw(code)
    assert code == "LOGPROB_MISMATCH", mallory.swarm.explain(batch_id_of(sealed))
