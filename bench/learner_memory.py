"""Learner memory at a real vocabulary: peak RSS of one GRPO step for R = 16 and R = 64 rows.

A Qwen2-shaped model with Qwen2.5's 151,936-token vocabulary and a tiny body (2 layers, hidden 64, random
weights, written once to a directory and loaded through the learner's ordinary `from_pretrained` path),
one `Learner.step` on R rows x (128 prompt + 512 completion) tokens, groups of 16, the same micro-batch
budget for every R. Each R runs in a *fresh* subprocess and reports its kernel high-water mark
(`getrusage(RUSAGE_SELF).ru_maxrss`, so model load, imports and the step are all inside it); the step's
own peak is therefore an upper bound. `full_batch_logits_bytes` is what the pre-micro-batching learner
allocated for the fp32 logits alone (R x 513 kept positions x V x 4; its logsumexp temporary was as large
again), computed, not run: it needs more memory than this machine has.

`ratio`: learner tokens/s over a bare torch loop at the same micro-batches (same rows, same padding, same
LoRA model): forward with `logits_to_keep`, full-vocabulary fp32 logits, gather - logsumexp,
advantage-weighted mean, backward, AdamW — the least a policy-gradient step does, written naively. It is
measured at R = 16 in that child after its learner step (CPU time of the process, one measurement each;
run the script more than once for the spread). Goals (issue 13): peak <= 3 GB at R = 64,
peak_ratio_64_vs_16 <= 1.10, ratio >= 0.70.

    .venv/bin/python bench/learner_memory.py --json-out runs/bench/learner_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 151936
PROMPT, COMPLETION, GROUP = 128, 512, 16


def model_dir() -> Path:
    path = Path(os.environ.get("ASYNCRL_BENCH_DIR", tempfile.gettempdir())) / "asyncrl-qwen2-vocab-tiny-body"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from asyncrl.models import tinymodel

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                      tie_word_embeddings=True, dtype="float32")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    tinymodel.build_tokenizer().save_pretrained(path)  # only the pad id is used; token ids are random
    return path


def make_groups(rows: int, seed: int = 0):
    from asyncrl.coordinator.learner.learner import TrainGroup

    rng = random.Random(seed)
    groups = []
    for _ in range(rows // GROUP):
        prompt = [rng.randrange(1, VOCAB) for _ in range(PROMPT)]
        comps = [[rng.randrange(1, VOCAB) for _ in range(COMPLETION)] for _ in range(GROUP)]
        groups.append(TrainGroup(prompt, comps, [[-2.0] * COMPLETION for _ in comps],
                                 [rng.random() for _ in comps], version=0))
    return groups


def bare_step(model, optimizer, batches) -> None:
    """Naive policy-gradient step over the given collated micro-batches (full [b, T, V] fp32 logits)."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    total = sum(float(b["mask"].sum()) for b in batches)
    for b in batches:
        ids = b["ids"]
        start = int(b["prompt_lens"].min()) - 1
        logits = model(input_ids=ids, attention_mask=b["attn"], logits_to_keep=ids.shape[1] - start).logits
        logits = logits[:, :-1].float()
        logp = logits.gather(2, ids[:, start + 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        mask = b["attn"][:, start + 1:].float() * (torch.arange(logp.shape[1]) >= (b["prompt_lens"] - 1 - start).view(-1, 1))
        loss = -(logp * mask * b["adv"].view(-1, 1)).sum() / total
        loss.backward()
    optimizer.step()


def child(rows: int, micro_batch_tokens: int, threads: int, gradient_checkpointing: bool) -> dict:
    import torch

    from asyncrl.coordinator.config import LORA_TARGETS
    from asyncrl.coordinator.learner.learner import Learner, plan_micro_batches, rows_of
    from asyncrl.coordinator.learner.loss import LossConfig
    from asyncrl.models.lora import load_base_model, with_lora
    from asyncrl.protocol.messages import LoraSpec

    torch.set_num_threads(threads)
    path = str(model_dir())
    lora = LoraSpec(r=16, alpha=32.0, dropout=0.0, target_modules=LORA_TARGETS)
    learner = Learner(path, lora, lr=1e-4, loss=LossConfig(max_completion_length=COMPLETION), max_staleness=None,
                      device="cpu", dtype="fp32", micro_batch_tokens=micro_batch_tokens,
                      gradient_checkpointing=gradient_checkpointing)
    groups = make_groups(rows)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    w0, c0 = time.perf_counter(), time.process_time()
    result = learner.step(groups)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    out = {"rows": rows, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "rss_high_water_before_step_bytes": rss_before, "tokens": result.tokens,
           "micro_batches": result.metrics["micro_batches"], "step_wall_s": wall, "step_cpu_s": cpu,
           "tokens_per_s": result.tokens / wall, "tokens_per_cpu_s": result.tokens / cpu,
           "loss": result.loss, "grad_norm": result.metrics["grad_norm"]}
    if rows <= 16:  # the bare loop at the same micro-batches (its full logits make it the memory hog: last)
        base, _ = load_base_model(path, dtype=torch.float32)
        bare = with_lora(base, lora, seed=0).train()
        opt = torch.optim.AdamW([p for p in bare.parameters() if p.requires_grad], lr=1e-4)
        rs = rows_of(groups)
        for r in rs:
            r.advantage = r.reward - 0.5
        batches = [learner._collate_rows([rs[i] for i in idx]) for idx in plan_micro_batches(
            [len(r.ids) for r in rs], micro_batch_tokens)]
        w0, c0 = time.perf_counter(), time.process_time()
        bare_step(bare, opt, batches)
        bwall, bcpu = time.perf_counter() - w0, time.process_time() - c0
        out.update(bare_step_wall_s=bwall, bare_step_cpu_s=bcpu, bare_tokens_per_s=result.tokens / bwall,
                   bare_tokens_per_cpu_s=result.tokens / bcpu,
                   bare_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json-out", default="runs/bench/learner_memory.json")
    p.add_argument("--rows", default="16,64", help="comma list of R (multiples of 16)")
    p.add_argument("--micro-batch-tokens", type=int, default=2048,
                   help="the same budget for every R (and for the bare loop's micro-batches)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-gradient-checkpointing", dest="ckpt", action="store_false")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.micro_batch_tokens, a.threads, a.ckpt)), flush=True)
        return 0

    from asyncrl.protocol.atomic import write_json_atomic

    model_dir()  # written once, outside the measured children
    results = {}
    for rows in [int(r) for r in a.rows.split(",")]:
        cmd = [sys.executable, __file__, "--child", str(rows), "--micro-batch-tokens", str(a.micro_batch_tokens),
               "--threads", str(a.threads)] + ([] if a.ckpt else ["--no-gradient-checkpointing"])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        results[rows] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"R={rows}: peak RSS {results[rows]['peak_rss_bytes'] / 2**30:.2f} GiB, "
              f"{results[rows]['tokens_per_s']:.0f} tokens/s, {results[rows]['micro_batches']} micro-batches", flush=True)
    small, large = min(results), max(results)
    keep = COMPLETION + 1  # positions the old path kept (from the shortest prompt's last token on)
    ref = results[small]
    out = {
        "benchmark": "learner_memory", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average": os.getloadavg(), "threads": a.threads,
        "model": {"vocab_size": VOCAB, "hidden_size": 64, "layers": 2, "lora_r": 16, "dtype": "fp32"},
        "shape": {"prompt": PROMPT, "completion": COMPLETION, "group_size": GROUP},
        "micro_batch_tokens": a.micro_batch_tokens, "gradient_checkpointing": a.ckpt,
        "peak_rss_bytes": {str(r): v["peak_rss_bytes"] for r, v in results.items()},
        "peak_ratio_64_vs_16": results[large]["peak_rss_bytes"] / results[small]["peak_rss_bytes"],
        "full_batch_logits_bytes": large * keep * VOCAB * 4,
        "full_batch_logits_bytes_by_rows": {str(r): r * keep * VOCAB * 4 for r in results},
        "tokens_per_s": results[large]["tokens_per_s"],
        "tokens_per_s_by_rows": {str(r): v["tokens_per_s"] for r, v in results.items()},
        "ratio": ref["tokens_per_cpu_s"] / ref["bare_tokens_per_cpu_s"],
        "ratio_basis": f"process CPU time, R={small}, same micro-batches",
        "ratio_wall": ref["tokens_per_s"] / ref["bare_tokens_per_s"],
        "bare_peak_rss_bytes": ref["bare_peak_rss_bytes"],
        "runs": {str(r): v for r, v in results.items()},
        "goals": {"peak_rss_bytes_64_max": 3 * 10**9, "peak_ratio_64_vs_16_max": 1.10, "ratio_min": 0.70},
    }
    Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.json_out, out, indent=2)
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
