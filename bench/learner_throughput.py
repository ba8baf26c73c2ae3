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

On CUDA it also reports each side's peak GPU memory (`torch.cuda.max_memory_allocated` over one step
after a reset) and MFU: tokens/s x FLOPs per token / the GPU's dense bf16 peak (`--peak-tflops`, or a
table of common GPUs by name). FLOPs per token for a LoRA step = 4N (forward 2N, backward through the frozen
weights 2N: no weight gradients) + the attention score terms (3 x 4 x layers x context x hidden) + the LM head
(2 x 3 x hidden x vocab with our recompute); `mfu_6n` uses the usual full-fine-tuning 6N convention.

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


PEAK_BF16_TFLOPS = {"H200": 989, "H100": 989, "H800": 989, "A100": 312, "A800": 312, "L40S": 362, "L40": 181,
                    "RTX 4090": 165, "RTX 3090": 71, "A10G": 125, "A10": 125, "L4": 121}


def peak_flops(name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def flops_per_token(cfg, context: float) -> dict[str, float]:
    """Matmul FLOPs per trained token (see the module docstring): LoRA step and the 6N convention."""
    h, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = h * cfg.num_key_value_heads // cfg.num_attention_heads
    body = layers * (2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size)  # q, o, k, v, gate/up/down
    attention = 3 * 4 * layers * (context / 2) * h  # QK^T and AV (causal: half the row), fwd + 2x bwd
    head = 2 * 3 * h * vocab                  # forward, recompute, gradient
    return {"lora": 4 * body + attention + head, "6n": 6 * (body + h * vocab) + attention}


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
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="base weights (auto: fp32 on cpu, bf16 on cuda); LoRA and AdamW stay fp32")
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--gradient-checkpointing", action="store_true", help="(the bare loop never checkpoints)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="GPU dense bf16 peak for MFU (0 = by name)")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch

    from asyncrl.coordinator.config import LORA_TARGETS
    from asyncrl.coordinator.learner import Learner
    from asyncrl.coordinator.loss import LossConfig
    from asyncrl.models.lora import load_base_model, resolve_placement, with_lora
    from asyncrl.protocol.messages import LoraSpec

    torch.set_num_threads(a.threads)
    a.device, dtype = resolve_placement(a.device, a.dtype)
    spec = SHAPES[a.shape]
    path = model_path(a.shape)
    lora = LoraSpec(r=spec["lora_r"], alpha=2.0 * spec["lora_r"], dropout=0.0, target_modules=LORA_TARGETS)
    learner = Learner(path, lora, lr=1e-4, loss=LossConfig(max_completion_length=spec["completion_len"]),
                      max_staleness=None, seed=a.seed, device=a.device, dtype=dtype,
                      micro_batch_tokens=a.micro_batch_tokens, gradient_checkpointing=a.gradient_checkpointing)
    base, _ = load_base_model(path, dtype=dtype, device=a.device)
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
    peaks = {}
    if a.device.startswith("cuda"):  # each side's peak over one step, from a reset
        for side, fn in (("learner", lambda: learner.step(batches[0])),
                         ("bare", lambda: bare_step(bare, bare_opt, collated[0]))):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            peaks[side] = torch.cuda.max_memory_allocated()
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
    out["micro_batch_tokens"], out["gradient_checkpointing"] = a.micro_batch_tokens, a.gradient_checkpointing
    out["load_average"] = os.getloadavg()
    if not on_cpu:
        out["gpu"] = torch.cuda.get_device_name()
        out["learner_peak_gpu_bytes"], out["bare_peak_gpu_bytes"] = peaks["learner"], peaks["bare"]
        flops = flops_per_token(learner.model.config, tokens / (a.batches * out["rows_per_batch"]))
        peak = a.peak_tflops * 1e12 or peak_flops(out["gpu"])
        out["flops_per_token"], out["peak_flops"] = flops, peak
        out["mfu"] = out["learner_tokens_per_s"] * flops["lora"] / peak if peak else None
        out["mfu_6n"] = out["learner_tokens_per_s"] * flops["6n"] / peak if peak else None
        out["bare_mfu"] = out["bare_tokens_per_s"] * flops["lora"] / peak if peak else None
    Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.json_out, out, indent=2)
    print(json.dumps({k: v for k, v in out.items() if not k.endswith("_rounds")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
