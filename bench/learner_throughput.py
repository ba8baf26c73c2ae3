"""Learner throughput: `Learner.step` tokens/s vs a bare torch LoRA forward+backward loop.

Owned by the staleness/benchmark work (issue 5, part B). Both sides train the same model (same base
weights, same LoRA init, AdamW on the LoRA parameters) on the same fixed batches with the same
padding: the bare loop gets the very tensors `Learner._collate` builds, already on the device, and
does forward (LM head from the shortest prompt on) -> log-probability of the taken tokens (gather -
logsumexp) -> advantage-weighted mean -> backward -> optimizer step: the least a policy-gradient step
has to do, written as efficiently as the learner's own forward, so the ratio measures the learner's
overhead and nothing else. The learner adds everything it really does (collate
from Python lists, group advantages, the clipped/IS-weighted loss and its statistics, grad clipping).
Tokens = non-pad tokens (prompt + completion) per step. The two are interleaved batch by batch (in
alternating order) and each round's tokens/s is summed per side; `ratio` = learner / bare (goal
>= 0.70) is the median over rounds of the per-round ratio. On CPU `ratio` is computed from process CPU
time (one torch thread), which other processes on a shared machine cannot inflate; the wall-clock
ratio is reported next to it as `ratio_wall`. On CUDA, `ratio` is wall-clock (synchronised).


    .venv/bin/python bench/learner_throughput.py --json-out runs/bench/learner_throughput.json
    python bench/learner_throughput.py --device cuda --shape qwen2.5-1.5b   # 8 x 1024 tokens, bf16

`--shape qwen2.5-1.5b` writes a randomly initialised model with Qwen2.5-1.5B's shapes (28 layers,
hidden 1536, vocab 151936; about 3 GB in bf16) to a temp dir once and loads it through the same
`from_pretrained` path as any model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.protocol.atomic import write_json_atomic

SHAPES = {
    # rows per group x groups per batch; prompt length; longest completion (lengths vary down to half)
    "tiny": dict(rows_per_group=16, groups=8, prompt_len=6, completion_len=8, lora_r=16),
    "qwen2.5-1.5b": dict(rows_per_group=8, groups=1, prompt_len=256, completion_len=768, lora_r=16),
}


def model_path(shape: str) -> str:
    from asyncrl.models import tinymodel

    if shape == "tiny":
        return str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))
    path = Path(os.environ.get("ASYNCRL_BENCH_DIR", tempfile.gettempdir())) / "asyncrl-qwen2.5-1.5b-shaped"
    if (path / "config.json").exists():
        return str(path)
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1_000_000.0, tie_word_embeddings=True, dtype="bfloat16")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    tinymodel.build_tokenizer().save_pretrained(path)  # only pad/eos ids are used; token ids are random
    return str(path)


def make_batches(n: int, spec: dict, vocab: int, seed: int):
    """Fixed random batches of TrainGroups (varied completion lengths so padding is real)."""
    from asyncrl.coordinator.learner import TrainGroup

    rng = random.Random(seed)
    batches = []
    for b in range(n):
        groups = []
        for g in range(spec["groups"]):
            prompt = [rng.randrange(1, vocab) for _ in range(spec["prompt_len"])]
            comps = [[rng.randrange(1, vocab) for _ in range(rng.randint(spec["completion_len"] // 2, spec["completion_len"]))]
                     for _ in range(spec["rows_per_group"])]
            groups.append(TrainGroup(prompt, comps, [[-2.0] * len(c) for c in comps],
                                     [rng.random() for _ in comps], version=0))
        batches.append(groups)
    return batches


def bare_step(model, optimizer, batch) -> None:
    import torch

    ids, start = batch["ids"], batch["start"]
    logits = model(input_ids=ids, attention_mask=batch["attn"], logits_to_keep=ids.shape[1] - start).logits
    logits = logits[:, :-1].float()
    logp = logits.gather(2, ids[:, start + 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    loss_mask = batch["loss_mask"][:, start:]
    loss = -(logp * loss_mask * batch["adv"].view(-1, 1)).sum() / loss_mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json-out", default="runs/bench/learner_throughput.json")
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16"], help="default: fp32 on cpu, bf16 on cuda")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch

    from asyncrl.coordinator.config import LORA_TARGETS
    from asyncrl.coordinator.learner import Learner
    from asyncrl.coordinator.loss import LossConfig
    from asyncrl.models.lora import load_base_model, with_lora
    from asyncrl.protocol.messages import LoraSpec

    torch.set_num_threads(a.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")]
    spec = SHAPES[a.shape]
    path = model_path(a.shape)
    lora = LoraSpec(r=spec["lora_r"], alpha=2.0 * spec["lora_r"], dropout=0.0, target_modules=LORA_TARGETS)
    learner = Learner(path, lora, lr=1e-4, loss=LossConfig(max_completion_length=spec["completion_len"]),
                      max_staleness=None, seed=a.seed, device=a.device, dtype=dtype)
    base, _ = load_base_model(path, dtype=dtype)
    bare = with_lora(base, lora, seed=a.seed).to(a.device).train()
    bare_opt = torch.optim.AdamW([q for q in bare.parameters() if q.requires_grad], lr=1e-4)
    batches = make_batches(a.batches, spec, learner.vocab_size, a.seed)

    collated = []
    for groups in batches:  # exactly the learner's tensors (same padding), prepared outside the timing
        c = learner._collate(groups)
        ids = c["ids"]
        loss_mask = torch.zeros(ids.shape[0], ids.shape[1] - 1, device=ids.device)
        for i in range(ids.shape[0]):
            pl, cl = int(c["prompt_lens"][i]), int(c["comp_lens"][i])
            loss_mask[i, pl - 1:pl - 1 + cl] = 1.0
        adv = c["rewards"] - c["rewards"].mean()
        collated.append({"ids": ids, "attn": c["attn"], "loss_mask": loss_mask, "adv": adv.to(ids.device),
                         "tokens": int(c["attn"].sum()), "start": int(c["prompt_lens"].min()) - 1})
    tokens = sum(c["tokens"] for c in collated)

    def sync():
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()

    def timed(fn) -> tuple[float, float]:
        """(wall seconds, process-CPU seconds) of one call."""
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        sync()
        return time.perf_counter() - t0, time.process_time() - c0

    learner.step(batches[0])  # warm-up (allocator, kernels)
    bare_step(bare, bare_opt, collated[0])
    learner_tps, bare_tps = [], []  # per round: (tokens / wall s, tokens / cpu s)
    for r in range(a.rounds):
        lw = lc = bw = bc = 0.0
        for i, (groups, c) in enumerate(zip(batches, collated)):
            order = [("learner", groups), ("bare", c)]
            if (r + i) % 2:
                order.reverse()
            for side, item in order:
                if side == "learner":
                    w, cpu = timed(lambda: learner.step(item))
                    lw, lc = lw + w, lc + cpu
                else:
                    w, cpu = timed(lambda: bare_step(bare, bare_opt, item))
                    bw, bc = bw + w, bc + cpu
        learner_tps.append((tokens / lw, tokens / max(lc, 1e-9)))
        bare_tps.append((tokens / bw, tokens / max(bc, 1e-9)))
        print(f"round {r}: learner {learner_tps[-1][0]:.0f} tok/s  bare {bare_tps[-1][0]:.0f} tok/s  "
              f"(cpu time: {learner_tps[-1][1]:.0f} / {bare_tps[-1][1]:.0f})", flush=True)
    on_cpu = not a.device.startswith("cuda")
    out = {
        "benchmark": "learner_throughput",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": a.device, "shape": a.shape, "dtype": str(dtype).replace("torch.", ""), "threads": a.threads,
        "batches": a.batches, "rounds": a.rounds, "tokens_per_round": tokens,
        "rows_per_batch": spec["groups"] * spec["rows_per_group"], "lora_r": spec["lora_r"],
        "ratio_basis": "process CPU time" if on_cpu else "wall clock",
        "ratio_wall": statistics.median(l[0] / b[0] for l, b in zip(learner_tps, bare_tps)),
        "learner_tokens_per_s": statistics.median(x[0] for x in learner_tps),
        "bare_tokens_per_s": statistics.median(x[0] for x in bare_tps),
        "learner_rounds": [x[0] for x in learner_tps], "bare_rounds": [x[0] for x in bare_tps],
    }
    if on_cpu:
        out["ratio_cpu_time"] = statistics.median(l[1] / b[1] for l, b in zip(learner_tps, bare_tps))
        out["learner_tokens_per_cpu_s"] = statistics.median(x[1] for x in learner_tps)
        out["bare_tokens_per_cpu_s"] = statistics.median(x[1] for x in bare_tps)
    out["ratio"] = out["ratio_cpu_time"] if on_cpu else out["ratio_wall"]
    out["goal_ratio_min"] = 0.70
    Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.json_out, out, indent=2)
    print(json.dumps({k: v for k, v in out.items() if not k.endswith("_rounds")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
