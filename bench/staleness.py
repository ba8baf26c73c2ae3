"""Staleness benchmark: forced staleness k with and without the importance-sampling correction.

Owned by the staleness/benchmark work (issue 5, part B). In-process, no network (10 runs must fit in
15 minutes on a 2-core CPU), but the staleness is real: the coordinator's own `Learner` trains, and a
`TransformersEngine` (the volunteer's engine) generates every step's rollouts with the adapter exactly
k versions old — the learner's LoRA exported in the publish dtype (bf16) after every step, the last
k+1 exports kept, the oldest loaded into the engine: what `asyncrl-client join --hold-version k`
does over the network. Versions before k exist are served by v0 (staleness min(step, k)).

Every run: same seed (LoRA init, prompts, sampling), same number of trainer steps, `max_staleness`
unlimited; k in {0, 2, 4, 8, 32} x correction in {clip (corrected), none (uncorrected)}.
"clip" is the coordinator's default correction: the importance ratio pi_theta / mu against the
volunteer's sampling log-probabilities, PPO-clipped (coordinator/loss.py); "none" trains on stale
samples as if they were on-policy. `--corrections clip,none,tis-token` adds the truncated-IS arm
(measured in docs/benchmarks.md: it learns, then collapses at k=8 late in training).
`final_reward` is measured, not read off stale training batches: the final adapter generates on a
fixed set of evaluation prompts (`--eval-prompts` x `--eval-samples`), as does the initial one
(`start_reward`). JSON: final_reward per setting ("k8/tis-token"...), k8_corrected_vs_k0
(final k=8 clip / final k=0 clip; goal >= 0.90), k32_corrected_stable (every loss finite
and final >= start), and per-run traces.

    .venv/bin/python bench/staleness.py --json-out runs/bench/staleness.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import deque
from pathlib import Path

from asyncrl.protocol.atomic import write_json_atomic

GROUP_SIZE = 16
MAX_NEW_TOKENS = 8


def build(seed: int, correction: str, lr: float, lora_r: int):
    from asyncrl.client.engine import TransformersEngine
    from asyncrl.coordinator.config import LORA_TARGETS
    from asyncrl.coordinator.learner import Learner
    from asyncrl.coordinator.loss import LossConfig
    from asyncrl.models import tinymodel
    from asyncrl.protocol.messages import LoraSpec

    path = str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))
    lora = LoraSpec(r=lora_r, alpha=2.0 * lora_r, dropout=0.0, target_modules=LORA_TARGETS)
    learner = Learner(path, lora, lr=lr, loss=LossConfig(correction=correction, max_completion_length=MAX_NEW_TOKENS),
                      max_staleness=None, seed=seed)
    engine = TransformersEngine(path, lora, seed=seed)
    return learner, engine


def evaluate(engine, learner, prompts, samples: int) -> float:
    from asyncrl import tasks
    from asyncrl.models.lora import export_lora
    from asyncrl.protocol.messages import SamplingParams

    specs, blobs = export_lora(learner.model, "bf16")
    engine.load_adapter(learner.version, specs, blobs)
    ids = [learner.tokenizer(p.text)["input_ids"] for p in prompts]
    out = engine.generate(ids, samples, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS))
    scores = [tasks.score(p.reward, engine.tokenizer.decode(s.token_ids, skip_special_tokens=True), p.answer)
              for p, group in zip(prompts, out) for s in group]
    return sum(scores) / len(scores)


def run_one(k: int, correction: str, a) -> dict:
    import torch

    from asyncrl import tasks
    from asyncrl.coordinator.learner import TrainGroup
    from asyncrl.models.lora import export_lora
    from asyncrl.protocol.messages import SamplingParams

    torch.manual_seed(a.seed)
    learner, engine = build(a.seed, correction, a.lr, a.lora_r)
    eval_source = tasks.get_task("repeat", a.seed + 10_000)
    eval_prompts = [next(eval_source) for _ in range(a.eval_prompts)]
    start = evaluate(engine, learner, eval_prompts, a.eval_samples)
    engine.generator.manual_seed(a.seed)  # training samples do not depend on the evaluation above
    source = tasks.get_task("repeat", a.seed)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS)
    held: deque = deque(maxlen=k + 1)  # (version, specs, blobs): the last k+1 published adapters
    serving = None
    trace = []
    t0 = time.perf_counter()
    for _ in range(a.steps):
        held.append((learner.version, *export_lora(learner.model, "bf16")))
        version, specs, blobs = held[0]  # k versions behind the newest (or v0 early on)
        if version != serving:
            engine.load_adapter(version, specs, blobs)
            serving = version
        prompts = [next(source) for _ in range(a.groups_per_step)]
        ids = [learner.tokenizer(p.text)["input_ids"] for p in prompts]
        samples = engine.generate(ids, GROUP_SIZE, sampling)
        groups = []
        for p, pid, group in zip(prompts, ids, samples):
            rewards = [tasks.score(p.reward, engine.tokenizer.decode(s.token_ids, skip_special_tokens=True), p.answer)
                       for s in group]
            groups.append(TrainGroup(pid, [s.token_ids for s in group], [s.logprobs for s in group], rewards,
                                     version, sampling.temperature))
        res = learner.step(groups)
        learner.version += 1  # publish_every = 1
        m = res.metrics
        trace.append({"step": learner.steps, "loss": res.loss, "reward": res.reward_mean,
                      "staleness": m["staleness_max"], "ratio_max": m["ratio_max"], "ratio_min": m["ratio_min"],
                      "is_weight_mean": m["is_weight_mean"], "is_truncated_fraction": m["is_truncated_fraction"]})
    train_s = time.perf_counter() - t0
    final = evaluate(engine, learner, eval_prompts, a.eval_samples)
    losses = [t["loss"] for t in trace]
    tail = trace[-10:]
    return {
        "k": k, "correction": correction, "steps": a.steps, "start_reward": start, "final_reward": final,
        "all_losses_finite": all(math.isfinite(x) for x in losses),
        "train_reward_last10": sum(t["reward"] for t in tail) / len(tail),
        "ratio_max_last10": max(t["ratio_max"] for t in tail), "ratio_min_last10": min(t["ratio_min"] for t in tail),
        "is_truncated_fraction_last10": sum(t["is_truncated_fraction"] for t in tail) / len(tail),
        "train_s": train_s,
        "reward_trace": [round(t["reward"], 4) for t in trace],
    }


def _run_in_worker(k: int, correction: str, a) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    return run_one(k, correction, a)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json-out", default="runs/bench/staleness.json")
    p.add_argument("--ks", default="0,2,4,8,32")
    p.add_argument("--corrections", default="clip,none", help="first = the corrected arm")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (one process each)")
    a = p.parse_args(argv)

    ks = [int(x) for x in a.ks.split(",")]
    corrections = a.corrections.split(",")
    t0 = time.time()
    settings = [(k, c) for c in corrections for k in ks]
    settings.sort(key=lambda kc: -kc[0])  # longest-lagging first: they finish last otherwise
    runs = {}
    # One process per run (spawned, `--threads` torch threads each), `--jobs` at a time: the runs are
    # independent and each is single-threaded, so a 2-core machine runs two at once.
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from multiprocessing import get_context

    with ProcessPoolExecutor(max_workers=a.jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(_run_in_worker, k, c, a): (k, c) for k, c in settings}
        for fut in as_completed(futures):
            k, correction = futures[fut]
            r = fut.result()
            runs[f"k{k}/{correction}"] = r
            print(f"k={k:<3d} {correction:<12s} start {r['start_reward']:.3f} final {r['final_reward']:.3f} "
                  f"(train last10 {r['train_reward_last10']:.3f}, ratio [{r['ratio_min_last10']:.2f}, "
                  f"{r['ratio_max_last10']:.2f}], finite {r['all_losses_finite']}) {r['train_s']:.0f}s", flush=True)
    runs = {f"k{k}/{c}": runs[f"k{k}/{c}"] for c in corrections for k in ks}
    corr = corrections[0]
    k0, k8, k32 = runs.get(f"k0/{corr}"), runs.get(f"k8/{corr}"), runs.get(f"k32/{corr}")
    out = {
        "benchmark": "staleness",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "steps": a.steps, "groups_per_step": a.groups_per_step, "group_size": GROUP_SIZE, "lr": a.lr,
        "corrected": corr, "uncorrected": corrections[1:] or None,
        "final_reward": {name: r["final_reward"] for name, r in runs.items()},
        "start_reward": k0["start_reward"] if k0 else None,
        "k8_corrected_vs_k0": (k8["final_reward"] / k0["final_reward"]) if k0 and k8 and k0["final_reward"] else None,
        "k32_corrected_stable": (k32["all_losses_finite"] and k32["final_reward"] >= k32["start_reward"]) if k32 else None,
        "goal": {"k8_corrected_vs_k0_min": 0.90, "k32_corrected_stable": True},
        "runs": runs,
        "total_wall_s": time.time() - t0,
    }
    if len(corrections) > 1:
        unc = corrections[1]
        u0, u8 = runs.get(f"k0/{unc}"), runs.get(f"k8/{unc}")
        out["k8_uncorrected_vs_k0"] = (u8["final_reward"] / u0["final_reward"]) if u0 and u8 and u0["final_reward"] else None
    Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.json_out, out, indent=2)
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
