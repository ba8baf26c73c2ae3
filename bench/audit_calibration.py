"""Calibrate the generation audit's tolerance: honest mismatch vs forged batches, and the audit's cost.

Owned by the trust work (issue 7). One process, no network: the real `Learner` trains the built-in
tiny model on the `repeat` task from batches an honest volunteer engine (`TransformersEngine`, fp32,
loaded with the *published bf16* adapter, exactly as `asyncrl-client` does) generates; the real
`Auditor` (coordinator/trust/audit.py) recomputes logprobs. For every adapter version it measures:

  honest      batches generated with version v, claimed v: the statistic on both audit paths —
              `shadow` (shadow model + the published bf16 LoRA: what older-version audits use) and
              `learner` (the learner's own fp32 forward pass: what current-version audits reuse);
  fabricated  the same tokens with made-up logprobs: uniform random, the uniform policy's log(1/V),
              the honest values shuffled / scaled x0.5 / plus noise, all zero ("certain"), the base
              model's logprobs (adapter off); plus hand-picked completions (the rewarded answer) with
              confident made-up logprobs;
  wrong_version  generated with version u, claimed v, for |u - v| in 1..4 (both directions);
  other_base  generated with another base model (the tiny model built from another seed) + the adapter;
  bf16_volunteer (probe) an honest volunteer running the base model in bf16 (GPU-style) — reported,
              not part of the pass/fail, since the default tolerance is calibrated for fp32 engines.

The statistic is coordinator.trust.audit.mismatch: the worst completion's trimmed mean |claimed - recomputed| per
token. Output: max/quantiles of honest values, min of each attack, false-reject rate and catch rates
at `--tolerance`, and the audit's cost as a fraction of learner time.

Learned tolerances (coordinator/trust/audit_policy.py): the honest batches of each engine class (fp32 and bf16
transformers engines here) go, in order, through the coordinator's own `AuditPolicy` with
`--learn-batches`: its learning period, the tolerance it learns, and every later honest batch judged by
it (misses, strikes); every attack is then judged against each class's learned tolerance.

`--model` takes any base the coordinator takes (e.g. `smollm2-135m-instruct`, a real pretrained model whose
peaked logits make dtype noise larger than the tiny model's; no "another base model" rows then: that
needs a second model with the same vocabulary). Its pass/fail is on the learned tolerances: no honest
batch struck or rejected after learning, >= 99 % of fabricated batches caught (of a bf16 class: those beyond its
own noise, SMALL_LIES below).

    .venv/bin/python bench/audit_calibration.py --json-out runs/bench/audit_calibration.json
    .venv/bin/python bench/audit_calibration.py --model smollm2-135m-instruct --versions 4 --batches-per-version 4 \
        --prompts 2 --group-size 4 --max-new-tokens 16 --bf16-probe 12 --learn-batches 6 \
        --json-out runs/bench/audit_calibration_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

from asyncrl.protocol.atomic import write_json_atomic


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=60, help="adapter versions (training steps + 1)")
    ap.add_argument("--batches-per-version", type=int, default=9)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per batch (a lease)")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--tolerance", type=float, default=None, help="default: CoordinatorConfig.audit_tolerance")
    ap.add_argument("--bf16-probe", type=int, default=40, help="honest bf16-engine batches to probe (0 = skip)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default="runs/bench/audit_calibration.json")
    ap.add_argument("--model", default="tiny", help="base model, as the coordinator's --model (default: built-in tiny)")
    ap.add_argument("--learn-batches", type=int, default=None,
                    help="batches each engine class learns from (default: CoordinatorConfig.audit_learn_batches)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from asyncrl import tasks
    from asyncrl.client.engine import TransformersEngine
    from asyncrl.coordinator.config_file import resolve_config
    from asyncrl.coordinator.learner.learner import Learner, TrainGroup
    from asyncrl.coordinator.learner.learner import collate_groups as collate
    from asyncrl.coordinator.trust.audit import Auditor, completion_logprobs, mismatch
    from asyncrl.models import tinymodel
    from asyncrl.models.lora import export_lora
    from asyncrl.protocol.messages import LoraSpec, SamplingParams

    cfg = resolve_config({"model": args.model})  # the model's settings (its preset), as `--model` gets
    tol = args.tolerance if args.tolerance is not None else cfg.audit_tolerance
    tiny = args.model == "tiny"
    if tiny:
        path = str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))
        other_base = str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir().with_name("tiny-qwen2-seed1"),
                                                    seed=1))
    else:
        from asyncrl.models import sources

        path, other_base = str(sources.resolve(args.model).path), None
    lora = LoraSpec(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=0.0, target_modules=tuple(cfg.lora_targets))
    learner = Learner(path, lora, lr=cfg.lr, loss=cfg.loss, max_staleness=cfg.max_staleness, seed=args.seed)
    auditor = Auditor(learner, tolerance=tol, floor=cfg.audit_floor, keep_versions=args.versions + 1)
    engine = TransformersEngine(path, lora, seed=args.seed + 1)
    liar_engine = TransformersEngine(other_base, lora, seed=args.seed + 2) if other_base else None
    bf16_engine = TransformersEngine(path, lora, seed=args.seed + 3, dtype=torch.bfloat16) if args.bf16_probe else None
    tok = learner.tokenizer
    vocab = learner.vocab_size
    sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=args.max_new_tokens)
    source = tasks.get_task("repeat", args.seed)
    rng = random.Random(args.seed)
    published: dict[int, tuple] = {}

    def publish():
        specs, blobs = export_lora(learner.model, cfg.publish_dtype)
        auditor.remember_published(learner.version, specs, blobs, learner.steps)
        published[learner.version] = (specs, blobs)
        engine.load_adapter(learner.version, specs, blobs)

    def generate(eng, version):
        prompts = [next(source) for _ in range(args.prompts)]
        ids = [tok(p.text)["input_ids"] for p in prompts]
        groups = []
        for p, pid, samples in zip(prompts, ids, eng.generate(ids, args.group_size, sampling)):
            rewards = [tasks.score(p.reward, tok.decode(s.token_ids, skip_special_tokens=True), p.answer)
                       for s in samples]
            groups.append(TrainGroup(pid, [s.token_ids for s in samples], [list(s.logprobs) for s in samples],
                                     rewards, version, sampling.temperature))
        return groups

    def with_claims(groups, claims):
        return [TrainGroup(g.prompt_ids, g.completions, c, g.rewards, g.version, g.temperature)
                for g, c in zip(groups, claims)]

    def learner_logprobs(groups):
        b = learner._collate(groups)
        with torch.no_grad():
            return learner._completion_logprobs(b).cpu(), b["mask"].cpu()

    def claimed_tensor(groups, like):
        out = torch.zeros_like(like)
        r = 0
        for g in groups:
            for lp in g.sampling_logprobs:
                out[r, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
                r += 1
        return out

    def fabrications(groups, base_lp, version):
        """name -> per-completion claimed logprob lists (same tokens as `groups`)."""
        rows = [(gi, j) for gi, g in enumerate(groups) for j in range(len(g.completions))]
        out = {}
        def build(fn):
            claims = [[None] * len(g.completions) for g in groups]
            for r, (gi, j) in enumerate(rows):
                honest = groups[gi].sampling_logprobs[j]
                claims[gi][j] = [min(0.0, float(x)) for x in fn(r, honest)]
            return claims
        out["uniform_random"] = build(lambda r, h: [-rng.uniform(0.0, 4.0) for _ in h])
        out["uniform_policy"] = build(lambda r, h: [-math.log(vocab)] * len(h))
        out["shuffled"] = build(lambda r, h: rng.sample(h, len(h)) if len(h) > 1 else [h[0] - 1.0])
        out["scaled_x0.5"] = build(lambda r, h: [0.5 * x for x in h])
        out["noise_0.1"] = build(lambda r, h: [x + rng.gauss(0.0, 0.1) for x in h])
        out["all_zero"] = build(lambda r, h: [0.0] * len(h))
        if version > 0:  # version 0's LoRA B matrices are zero: the base model *is* that policy
            out["base_model"] = build(lambda r, h: base_lp[r, :len(h)].tolist())
        return out

    res = {k: [] for k in ("honest_shadow", "honest_learner", "wrong_version_shadow", "wrong_version_learner",
                           "other_base_shadow", "other_base_learner", "cherry_picked_shadow",
                           "cherry_picked_learner", "bf16_volunteer_shadow", "bf16_volunteer_learner")}
    fab: dict[str, list[float]] = {}
    fab_learner: dict[str, list[float]] = {}
    history: dict[int, list] = {}
    honest_versions: list[int] = []  # the claimed version of each honest_shadow / bf16 entry (v0 = the zero adapter)
    bf16_versions: list[int] = []
    t_learner = t_shadow = t_reuse = 0.0
    n_steps = n_shadow = n_reuse = 0
    t0 = time.time()
    publish()
    for v in range(args.versions):
        batches = [generate(engine, v) for _ in range(args.batches_per_version)]
        history[v] = batches
        for groups in batches:
            s0 = time.perf_counter()
            rec, b = auditor.shadow_logprobs(groups, v)
            res["honest_shadow"].append(mismatch(rec, b["sampling_logps"], b["mask"]))
            honest_versions.append(v)
            t_shadow += time.perf_counter() - s0
            n_shadow += 1
            llp, mask = learner_logprobs(groups)
            s0 = time.perf_counter()
            res["honest_learner"].append(mismatch(llp, claimed_tensor(groups, llp), mask))
            t_reuse += time.perf_counter() - s0
            n_reuse += 1
            with torch.no_grad(), learner.model.disable_adapter():
                base_lp = completion_logprobs(learner.model, collate(groups, tok.pad_token_id, learner.device))
            for name, claims in fabrications(groups, base_lp, v).items():
                forged = with_claims(groups, claims)
                fab.setdefault(name, []).append(mismatch(rec, claimed_tensor(forged, rec), b["mask"]))
                fab_learner.setdefault(name, []).append(mismatch(llp, claimed_tensor(forged, llp), mask))
        # hand-picked completions (the rewarded answer) with confident made-up logprobs
        for groups in batches[:2]:
            picked = []
            for g in groups:
                letter = tok.decode(g.prompt_ids)[4]
                comp = tok(letter * args.max_new_tokens)["input_ids"][: args.max_new_tokens]
                picked.append(TrainGroup(g.prompt_ids, [comp] * len(g.completions),
                                         [[-0.01] * len(comp)] * len(g.completions), g.rewards, v))
            rec, b = auditor.shadow_logprobs(picked, v)
            res["cherry_picked_shadow"].append(mismatch(rec, b["sampling_logps"], b["mask"]))
            llp, mask = learner_logprobs(picked)
            res["cherry_picked_learner"].append(mismatch(llp, claimed_tensor(picked, llp), mask))
        # another base model, same adapter
        specs, blobs = published[v]
        if liar_engine is not None:
            liar_engine.load_adapter(v, specs, blobs)
            liar = generate(liar_engine, v)
            rec, b = auditor.shadow_logprobs(liar, v)
            res["other_base_shadow"].append(mismatch(rec, b["sampling_logps"], b["mask"]))
            llp, mask = learner_logprobs(liar)
            res["other_base_learner"].append(mismatch(llp, claimed_tensor(liar, llp), mask))
        # wrong version, both directions, up to max_staleness apart
        for k in range(1, 5):
            u = v - k
            if u < 0:
                break
            for groups in history[u][:2]:  # generated with u, claimed v (= current)
                rec, b = auditor.shadow_logprobs(groups, v)
                res["wrong_version_shadow"].append(mismatch(rec, b["sampling_logps"], b["mask"]))
                llp, mask = learner_logprobs(groups)
                res["wrong_version_learner"].append(mismatch(llp, claimed_tensor(groups, llp), mask))
            for groups in batches[:1]:  # generated with v, claimed u (older)
                rec, b = auditor.shadow_logprobs(groups, u)
                res["wrong_version_shadow"].append(mismatch(rec, b["sampling_logps"], b["mask"]))
        history.pop(v - 4, None)
        if bf16_engine is not None and v % max(1, args.versions // max(1, args.bf16_probe)) == 0:
            bf16_engine.load_adapter(v, specs, blobs)
            for _ in range(max(1, args.bf16_probe // max(1, args.versions))):
                groups = generate(bf16_engine, v)
                rec, b = auditor.shadow_logprobs(groups, v)
                res["bf16_volunteer_shadow"].append(mismatch(rec, b["sampling_logps"], b["mask"]))
                llp, mask = learner_logprobs(groups)
                res["bf16_volunteer_learner"].append(mismatch(llp, claimed_tensor(groups, llp), mask))
                bf16_versions.append(v)
        # train on two honest batches (8 groups: the default groups_per_step), publish the next version
        s0 = time.perf_counter()
        learner.step([g for groups in batches[:2] for g in groups])
        t_learner += time.perf_counter() - s0
        n_steps += 1
        learner.version += 1
        publish()
        if v % 10 == 0:
            print(f"[{time.time() - t0:5.0f}s] v{v}: honest max shadow {max(res['honest_shadow']):.2e} "
                  f"learner {max(res['honest_learner']):.2e}; wrong-version min "
                  f"{min(res['wrong_version_shadow'] or [float('nan')]):.2e}", flush=True)

    def summary(xs, attack: bool):
        xs = sorted(xs)
        if not xs:
            return None
        q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]
        d = {"n": len(xs), "min": xs[0], "p50": q(0.5), "p99": q(0.99), "max": xs[-1]}
        d["caught" if attack else "rejected"] = sum(1 for x in xs if x > tol)
        d["rate"] = d["caught" if attack else "rejected"] / len(xs)
        return d

    out = {"tolerance": tol, "statistic": "max over completions of the trimmed mean |claimed - recomputed| logprob per token (largest 1 in 16 left out; completions under 4 tokens pooled, no verdict under 4 pooled tokens)",
           "model": "built-in tiny (asyncrl/tiny-qwen2)" if tiny else args.model, "versions": args.versions,
           "batch": {"prompts": args.prompts, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens},
           "honest": {"shadow": summary(res["honest_shadow"], False), "learner": summary(res["honest_learner"], False)},
           "fabricated": {"shadow": {k: summary(v, True) for k, v in fab.items()},
                          "learner": {k: summary(v, True) for k, v in fab_learner.items()}},
           "cherry_picked": {"shadow": summary(res["cherry_picked_shadow"], True),
                             "learner": summary(res["cherry_picked_learner"], True)},
           "wrong_version": {"shadow": summary(res["wrong_version_shadow"], True),
                             "learner": summary(res["wrong_version_learner"], True)},
           "other_base": {"shadow": summary(res["other_base_shadow"], True),
                          "learner": summary(res["other_base_learner"], True)},
           "bf16_volunteer_probe": {"shadow": summary(res["bf16_volunteer_shadow"], False),
                                    "learner": summary(res["bf16_volunteer_learner"], False)}}
    all_fab = [x for v in list(fab.values()) + list(fab_learner.values()) for x in v]
    all_fab += res["cherry_picked_shadow"] + res["cherry_picked_learner"]
    wrong = res["wrong_version_shadow"] + res["wrong_version_learner"]
    honest = res["honest_shadow"] + res["honest_learner"]
    step_s = t_learner / max(1, n_steps)
    shadow_s = t_shadow / max(1, n_shadow)
    reuse_s = t_reuse / max(1, n_reuse)
    batches_per_step = 2
    out["totals"] = {
        "honest_batches": len(res["honest_shadow"]), "honest_checks": len(honest),
        "false_rejects": sum(1 for x in honest if x > tol),
        "fabricated_batches": len(all_fab), "fabricated_caught_rate": sum(1 for x in all_fab if x > tol) / len(all_fab),
        "wrong_version_batches": len(wrong), "wrong_version_caught_rate": sum(1 for x in wrong if x > tol) / len(wrong),
        "separation": {"honest_max": max(honest), "attack_min": min(all_fab + wrong + res["other_base_shadow"])},
    }
    out["cost"] = {
        "learner_step_s": step_s, "shadow_audit_s_per_batch": shadow_s, "reuse_check_s_per_batch": reuse_s,
        "batches_per_step": batches_per_step,
        "every_batch_on_shadow_fraction": batches_per_step * shadow_s / step_s,
        "every_batch_reusing_learner_pass_fraction": batches_per_step * reuse_s / step_s,
        "trusted_floor_fraction": cfg.audit_floor * batches_per_step * shadow_s / step_s,
        "note": "fraction of learner step time; 'every batch on shadow' is the worst case (all volunteers new, "
                "all batches one version behind); current-version batches reuse the learner's forward pass",
    }
    out["learned"] = learned_tolerances(
        cfg, tol, args.learn_batches or cfg.audit_learn_batches,
        {"transformers/fp32": (res["honest_shadow"], honest_versions),
         "transformers/bf16": (res["bf16_volunteer_shadow"], bf16_versions)},
        {"fabricated": [x for k, v in fab.items() if k not in SMALL_LIES for x in v] + res["cherry_picked_shadow"],
         **{f"small_lie:{k}": fab[k] for k in SMALL_LIES if k in fab},
         "wrong_version": res["wrong_version_shadow"], "other_base": res["other_base_shadow"]})
    out["wall_s"] = time.time() - t0
    t = out["totals"]
    print(json.dumps({"tolerance": tol, **t, "learned": out["learned"], "cost": out["cost"]}, indent=1))
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.json_out, out, indent=1)
    learned_ok = all(c["learned"] and c["struck"] == 0 and c["rejected_after_learning"] == 0
                     and all(a["rate"] >= 0.99 for name, a in c["caught"].items() if a["n"] and (
                         name == "fabricated" or (name.startswith("small_lie:") and cls.endswith("/fp32"))))
                     for cls, c in out["learned"].items() if c["batches"])
    if tiny:
        ok = (t["honest_batches"] >= 500 and t["false_rejects"] == 0 and t["fabricated_caught_rate"] >= 0.99
              and t["wrong_version_caught_rate"] >= 0.99 and learned_ok)
    else:  # a real model: judged by the tolerances its engine classes learn, as a coordinator judges it
        ok = learned_ok
    print("PASS" if ok else "FAIL", f"-> {args.json_out}")
    return 0 if ok else 1


SMALL_LIES = ("noise_0.1", "base_model")
"""Fabrications the size of an engine's own noise: the honest values plus ~0.08 nats/token of noise, and the base
model's logprobs while the adapter is still near zero. On a real model an honest bf16 engine is that far from the
audit's fp32 recomputation too (docs/SECURITY.md), so no logprob comparison tells them apart from a half-precision
engine: reported per class, and required caught (>= 99 %) of fp32 classes only."""


def learned_tolerances(cfg, base: float, learn_batches: int, honest: dict, attacks: dict) -> dict:
    """Each engine class's honest statistics, in order, through the coordinator's AuditPolicy (learning
    period, then its learned tolerance); then every attack judged against that tolerance."""
    from asyncrl.coordinator.trust.audit_policy import AuditPolicy

    out = {}
    for cls, (stats, versions) in honest.items():
        kind, dtype = cls.split("/")
        policy = AuditPolicy(base, margin=cfg.audit_margin, learn_batches=learn_batches,
                             learn_tolerance=cfg.audit_learn_tolerance,
                             learn_tolerance_half=cfg.audit_learn_tolerance_half, quarantine_passes=cfg.audit_quarantine_passes,
                             quarantine_strikes=cfg.audit_quarantine_strikes)
        rejected_learning = rejected_after = 0
        for stat, version in zip(stats, versions):
            learning = policy.learning(dtype, kind)
            j = policy.judge(b"honest", stat, dtype, kind, trained=version > 0)
            if not j.ok:
                rejected_learning += learning
                rejected_after += not learning
        tol_learned = None if policy.learning(dtype, kind) else policy.tolerance(dtype, kind)
        judge_at = tol_learned if tol_learned is not None else policy.ceiling(dtype)
        caught = {name: {"n": len(xs), "caught": sum(1 for x in xs if x > judge_at),
                         "rate": sum(1 for x in xs if x > judge_at) / len(xs) if xs else None}
                  for name, xs in attacks.items()}
        out[cls] = {"batches": len(stats), "learn_batches": learn_batches, "learned": tol_learned is not None,
                    "tolerance": tol_learned, "ceiling": policy.ceiling(dtype), "base": base,
                    "honest_worst": max(stats) if stats else None,
                    "rejected_while_learning": rejected_learning, "rejected_after_learning": rejected_after,
                    "struck": policy.stats["strikes"], "caught": caught}
    return out


if __name__ == "__main__":
    sys.exit(main())
