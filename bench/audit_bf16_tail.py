"""Honest bf16 engines against the audit, on the adapter versions a real run kept: is the tolerance wide enough?

Owned by the trust work (issue 15). The start-up calibration (coordinator/trust/audit.py `calibrate`) sees
256 completions of the *starting* policy, computed as a bf16 engine would (autocast); a run then trains
for hours. This replays that gap: for version 0 and the last two versions kept in `<run-dir>/audit_versions/`
(e.g. of `asyncrl demo --steps 400`), it calibrates on that version exactly as the coordinator does at
start-up, then has a real bf16 `TransformersEngine` (weights and activations in bf16, as GPU engines run)
generate `--batches` honest batches (4 prompts x 16 completions) and reports the audit statistic of each
(`coordinator.trust.audit.mismatch`) against that tolerance: median, p90, worst, how many would be rejected.
`--versions` picks the kept versions (default: the last two). The `plain` rows redo it all with the
statistic and calibration used before 2026-12-04 (plain per-completion mean, 64 calibration completions).

    .venv/bin/asyncrl demo --steps 400 --run-dir /tmp/tail_demo
    .venv/bin/python bench/audit_bf16_tail.py --run-dir /tmp/tail_demo --batches 60
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path



CALIBRATION_PROMPTS = 32  # x 8 honest completions per version, as the start-up calibration sampled them
CALIBRATION_TOKENS = 64  # longest completion (the statistic is a per-token trimmed mean)

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, help="a tiny-model run whose audit_versions/ holds kept versions")
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--versions", type=int, nargs="*", default=None, help="kept versions to try (default: last two)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    import torch
    from safetensors.torch import load_file

    from asyncrl import tasks
    from asyncrl.client.engine import TransformersEngine
    from asyncrl.coordinator.config_file import resolve_config
    from asyncrl.coordinator.learner.learner import Learner, TrainGroup
    from asyncrl.coordinator.trust import audit as audit_mod
    from asyncrl.coordinator.trust.audit import Auditor, stored_versions
    from asyncrl.models import tinymodel
    from asyncrl.models.lora import export_lora, load_lora, tensors_from_bytes
    from asyncrl.protocol.messages import LoraSpec, SamplingParams

    torch.set_num_threads(1)
    files = stored_versions(Path(args.run_dir, "audit_versions"))
    if not files:
        ap.error(f"no kept versions under {args.run_dir}/audit_versions")
    cfg = resolve_config({"model": "tiny"})
    path = str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))
    lora = LoraSpec(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=0.0, target_modules=tuple(cfg.lora_targets))
    learner = Learner(path, lora, lr=cfg.lr, loss=cfg.loss, max_staleness=cfg.max_staleness, seed=0)
    auditor = Auditor(learner, tolerance=cfg.audit_tolerance, keep_versions=1 << 20)
    engine = TransformersEngine(path, lora, seed=3, dtype=torch.bfloat16)
    tok = learner.tokenizer
    source = tasks.get_task(cfg.task, 1)
    sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    versions = [(0, export_lora(learner.model, cfg.publish_dtype))]
    picked = [v for v in files if v in set(args.versions)] if args.versions else list(files)[-2:]
    for v in picked:
        load_lora(learner.model, load_file(str(files[v])))
        versions.append((v, export_lora(learner.model, cfg.publish_dtype)))
    trimmed = audit_mod.per_completion

    def plain(rec, claimed, mask):  # the statistic before 2026-12-04
        mask = mask.float()
        return ((rec.float() - claimed.float()).abs() * mask).sum(1) / mask.sum(1).clamp(min=1.0)

    out = {"run_dir": args.run_dir, "batches": args.batches, "versions": {}}
    for version, (specs, blobs) in versions:
        auditor.remember_published(version, specs, blobs, -1)
        engine.load_adapter(version, specs, blobs)
        for name, stat, n_prompts in (("trimmed", trimmed, CALIBRATION_PROMPTS), ("plain", plain, 8)):
            audit_mod.per_completion = stat  # calibrate() and mismatch() read it from the module
            source = tasks.get_task(cfg.task, 1)  # the same prompts and (engine seed) samples for both
            engine.generator.manual_seed(1000 + version)
            prompts = [list(tok(next(source).text)["input_ids"]) for _ in range(64)]
            cal = auditor.calibrate(tensors_from_bytes(specs, blobs), prompts[:n_prompts], temperature=cfg.temperature,
                                    max_new_tokens=min(cfg.max_new_tokens, CALIBRATION_TOKENS), group_size=8)
            tol = cal["tolerances"]["bf16"]
            stats = []
            for b in range(args.batches):
                batch = [prompts[(4 * b + i) % len(prompts)] for i in range(4)]
                groups = [TrainGroup(p, [s.token_ids for s in ss], [list(s.logprobs) for s in ss], [0.0] * len(ss),
                                     version, sampling.temperature)
                          for p, ss in zip(batch, engine.generate(batch, 16, sampling))]
                rec, b_ = auditor.shadow_logprobs(groups, version)
                stats.append(audit_mod.mismatch(rec, b_["sampling_logps"], b_["mask"]))
            stats.sort()
            row = {"calibration_completions": cal["calibration"]["bf16"]["n"],
                   "calibrated_worst": cal["calibration"]["bf16"]["worst"], "tolerance": tol,
                   "median": stats[len(stats) // 2], "p90": stats[int(0.9 * len(stats))], "worst": stats[-1],
                   "over_tolerance": sum(s > tol for s in stats), "headroom": tol / stats[-1] if stats[-1] else None}
            out["versions"].setdefault(version, {})[name] = row
            print(f"v{version} {name}: " + json.dumps({k: round(v, 5) if isinstance(v, float) else v
                                                       for k, v in row.items()}), flush=True)
    audit_mod.per_completion = trimmed
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
