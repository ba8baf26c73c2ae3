"""Learner throughput: `Learner.step` tokens/s vs a bare torch LoRA forward+backward loop, each side alone.

Both sides train the same model (same base weights, same LoRA init, AdamW on the LoRA parameters) on the
same fixed batches, split into the same micro-batches (`plan_micro_batches` at `micro_batch_tokens`; every
shape here is sized for at least 2 per step, so gradient accumulation is part of what is measured) with the
coordinator's default gradient checkpointing on both sides. The bare loop gets the very tensors the learner's
collate builds, already on the device, and per micro-batch does forward (LM head from the shortest prompt
on) -> log-probability of the taken tokens (gather - logsumexp) -> advantage-weighted sum / completion tokens
-> backward; one optimizer step per batch: the least a micro-batched policy-gradient step has to do, so the
ratio measures the learner's overhead (collate from Python lists, group advantages, the clipped/IS-weighted
loss and its statistics, grad clipping) and nothing else.

Each side runs alone: the learner's steps, then its model and optimizer are freed (and the CUDA cache
emptied) before the bare side is built, so each side's peak GPU memory is its own. Tokens = non-pad tokens
(prompt + completion) per step; `ratio` = learner / bare (goal >= 0.70) from the medians of the per-step
rates. On CPU the rates use process CPU time (one torch thread), which other processes on a shared machine
cannot inflate (`ratio_wall` next to it); on CUDA wall-clock (synchronised).

    .venv/bin/python bench/learner_throughput.py --json-out runs/bench/learner_throughput.json
    python bench/learner_throughput.py --device cuda --shape qwen2.5-1.5b   # 16 rows x <=1024 tokens, bf16

On CUDA it also reports each side's peak GPU memory (`max_memory_allocated` over its timed steps) and MFU:
model FLOPs per step / step time / the GPU's dense bf16 peak (`--peak-tflops`, or a table by name; an H100
PCIe and an H100 SXM differ, so the table keys on the full name). FLOPs per step for a LoRA step = 4N per
token (forward 2N, backward through the frozen weights 2N: no weight gradients) + causal attention
(3 x 4 x layers x hidden x T^2/2 per row) + the LM head only at completion positions (2 x 3 x hidden x
vocab per completion token: forward, recompute, gradient — models/logprobs.py computes no head for prompt
tokens). Checkpointing's recompute is not counted (model FLOPs, not hardware FLOPs).

`--shape qwen2.5-1.5b` / `qwen2.5-7b` write a randomly initialised model with those shapes (from the config,
on the GPU when there is one) and a stand-in tokenizer with Qwen2.5's 151,665 ids (the softmax spans the
tokenizer's ids, so the head is measured at its real width) to a temp dir once and load it through the same `from_pretrained` path as any
model. bench/device_check.py runs both shapes through `learner_side` / `bare_side`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    # rows per group x groups per batch; prompt length; longest completion (lengths vary down to half);
    # micro_batch_tokens: at least 2 micro-batches per step
    "tiny": dict(rows_per_group=16, groups=4, prompt_len=6, completion_len=8, lora_r=16, micro_batch_tokens=512),
    "smoke": dict(rows_per_group=4, groups=2, prompt_len=6, completion_len=8, lora_r=8, micro_batch_tokens=64),
    "qwen2.5-1.5b": dict(rows_per_group=8, groups=2, prompt_len=256, completion_len=768, lora_r=16,
                         micro_batch_tokens=8192,
                         config=dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                     num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2.5-7b": dict(rows_per_group=8, groups=2, prompt_len=256, completion_len=768, lora_r=16,
                       micro_batch_tokens=8192,
                       config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                   num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)),
}

# Dense bf16 peak (TFLOP/s, no sparsity), matched on the device name in this order.
PEAK_BF16_TFLOPS = (("H200", 989), ("H100 PCIe", 756), ("H100 NVL", 835), ("H100", 989), ("H800", 989),
                    ("A100", 312), ("A800", 312), ("L40S", 362), ("L40", 181), ("RTX 4090", 165), ("RTX 3090", 71),
                    ("A10G", 125), ("A10", 125), ("L4", 121))


def peak_flops(name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def model_path(shape: str, device: str = "cpu") -> str:
    """The shape's model directory: the built-in tiny model, or a random-weight Qwen2.5-shaped one written once."""
    from asyncrl.models import tinymodel

    if shape in ("tiny", "smoke"):
        return str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))
    path = Path(os.environ.get("ASYNCRL_BENCH_DIR", tempfile.gettempdir())) / f"asyncrl-{shape}-shaped-v2"
    if (path / "config.json").exists():
        return str(path)
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**SHAPES[shape]["config"], max_position_embeddings=32768, rope_theta=1_000_000.0,
                      dtype="bfloat16")
    with torch.device(device if str(device).startswith("cuda") else "cpu"):  # random init is fast on a GPU
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    shaped_tokenizer(QWEN_TOKENS).save_pretrained(path)
    del model
    free_memory()
    return str(path)


QWEN_TOKENS = 151_665  # Qwen2.5's tokenizer; its embedding is padded to 151,936 (1.5B) / 152,064 (7B) rows


def shaped_tokenizer(n_tokens: int):
    """A tokenizer with `n_tokens` ids (id 0 is eos and pad) and nothing else real: the learner's and the
    engine's softmax run over len(tokenizer) ids (models/logprobs.py `vocab_limit`), so a Qwen-shaped model
    needs Qwen's token count, or the head it measures would be a few dozen rows wide."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, **{f"<t{i}>": i for i in range(1, n_tokens)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   padding_side="left")


def step_flops(cfg, rows) -> dict[str, float]:
    """Model FLOPs of one step over `rows` (see the module docstring): the LoRA step and the 6N convention."""
    h, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = h * cfg.num_key_value_heads // cfg.num_attention_heads
    body = layers * (2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size)  # q, o, k, v, gate/up/down
    tokens = sum(len(r.ids) for r in rows)
    completion = sum(r.comp_len for r in rows)
    attention = sum(3 * 4 * layers * h * len(r.ids) ** 2 / 2 for r in rows)
    return {"lora": 4 * body * tokens + attention + 2 * 3 * h * vocab * completion,
            "6n": 6 * body * tokens + attention + 6 * h * vocab * completion}


def make_batches(n: int, spec: dict, vocab: int, seed: int):
    """Fixed random batches of TrainGroups (varied completion lengths so padding is real)."""
    from asyncrl.coordinator.learner.learner import TrainGroup

    rng = random.Random(seed)
    batches = []
    for _ in range(n):
        groups = []
        for _ in range(spec["groups"]):
            prompt = [rng.randrange(1, vocab) for _ in range(spec["prompt_len"])]
            comps = [[rng.randrange(1, vocab) for _ in range(rng.randint(spec["completion_len"] // 2, spec["completion_len"]))]
                     for _ in range(spec["rows_per_group"])]
            groups.append(TrainGroup(prompt, comps, [[-2.0] * len(c) for c in comps],
                                     [rng.random() for _ in comps], version=0))
        batches.append(groups)
    return batches


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class StepClock:
    """Times steps (wall and process CPU, synchronised on CUDA) and tracks the peak GPU memory from a reset."""

    def __init__(self, device: str):
        import torch

        self.cuda = str(device).startswith("cuda")
        self.torch = torch
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()

    def time(self, fn):
        if self.cuda:
            self.torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        if self.cuda:
            self.torch.cuda.synchronize()
        self.wall.append(time.perf_counter() - t0)
        self.cpu.append(time.process_time() - c0)
        return out

    def peak(self) -> int | None:
        return int(self.torch.cuda.max_memory_allocated()) if self.cuda else None


def _rates(tokens: list[int], clock: StepClock) -> dict:
    wall = [t / s for t, s in zip(tokens, clock.wall)]
    cpu = [t / max(s, 1e-9) for t, s in zip(tokens, clock.cpu)]
    return {"tokens_per_s": statistics.median(wall), "tokens_per_cpu_s": statistics.median(cpu),
            "step_s": statistics.median(clock.wall), "steps": len(wall), "peak_gpu_bytes": clock.peak()}


def learner_side(path: str, spec: dict, batches, *, device: str, dtype, micro_batch_tokens: int,
                 gradient_checkpointing: bool, steps: int, deadline: float, seed: int = 0):
    """`Learner.step` over `batches` (one warm-up step, then up to `steps`, stopping at `deadline` after at
    least one). Returns (figures, the learner's LoRA tensors); the learner is freed before returning."""
    from asyncrl.coordinator.config import LORA_TARGETS
    from asyncrl.coordinator.learner.learner import Learner
    from asyncrl.coordinator.learner.loss import LossConfig
    from asyncrl.protocol.messages import LoraSpec

    lora = LoraSpec(r=spec["lora_r"], alpha=2.0 * spec["lora_r"], dropout=0.0, target_modules=LORA_TARGETS)
    learner = Learner(path, lora, lr=1e-4, loss=LossConfig(max_completion_length=spec["completion_len"]),
                      max_staleness=None, seed=seed, device=device, dtype=dtype, micro_batch_tokens=micro_batch_tokens,
                      gradient_checkpointing=gradient_checkpointing)
    learner.step(batches[0])  # warm-up (allocator, kernels)
    clock, tokens, micro = StepClock(device), [], []
    clock.reset_peak()
    for i in range(steps):
        if i and time.time() > deadline:
            break
        result = clock.time(lambda: learner.step(batches[i % len(batches)]))
        tokens.append(result.tokens)
        micro.append(result.metrics["micro_batches"])
    out = {**_rates(tokens, clock), "micro_batches": min(micro), "lora_dtype": _lora_dtype(learner.model),
           "base_dtype": str(learner.dtype).replace("torch.", ""), "config": learner.model.config}
    tensors = learner.lora_parameters()
    del learner
    free_memory()
    return out, tensors


def _lora_dtype(model) -> str:
    return str(next(p.dtype for p in model.parameters() if p.requires_grad)).replace("torch.", "")


def bare_batches(groups, pad_id: int, device: str, micro_batch_tokens: int) -> list[dict]:
    """The learner's micro-batches of `groups` (same plan, same padding) as the bare loop needs them."""
    import torch

    from asyncrl.coordinator.learner.learner import collate_rows, plan_micro_batches, rows_of

    rows = rows_of(groups)
    rewards = torch.tensor([r.reward for r in rows])
    adv = (rewards - rewards.mean()).tolist()
    n_completion = sum(r.comp_len for r in rows)
    out = []
    for idx in plan_micro_batches([len(r.ids) for r in rows], micro_batch_tokens):
        part = [rows[i] for i in idx]
        c = collate_rows(part, pad_id, device)
        ids = c["ids"]
        start = min(r.prompt_len for r in part) - 1
        mask = torch.zeros(ids.shape[0], ids.shape[1] - start - 1, device=ids.device)
        for i, r in enumerate(part):  # target position p (predicted from p-1) sits at column p - start - 1
            mask[i, r.prompt_len - start - 1:r.prompt_len - start - 1 + r.comp_len] = 1.0
        out.append({"ids": ids, "attn": c["attn"], "start": start, "mask": mask,
                    "adv": torch.tensor([adv[i] for i in idx], device=ids.device), "norm": float(n_completion)})
    return out


def bare_step(model, optimizer, micro_batches: list[dict]) -> None:
    import torch

    optimizer.zero_grad(set_to_none=True)
    for b in micro_batches:
        ids, start = b["ids"], b["start"]
        logits = model(input_ids=ids, attention_mask=b["attn"], logits_to_keep=ids.shape[1] - start).logits
        logits = logits[:, :-1].float()
        logp = logits.gather(2, ids[:, start + 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        loss = -(logp * b["mask"] * b["adv"].view(-1, 1)).sum() / b["norm"]
        loss.backward()
    optimizer.step()


def bare_side(path: str, spec: dict, batches, *, device: str, dtype, micro_batch_tokens: int,
              gradient_checkpointing: bool, steps: int, deadline: float, seed: int = 0) -> dict:
    """The bare loop alone, on the same model, batches and micro-batch plan; freed before returning."""
    import torch

    from asyncrl.coordinator.config import LORA_TARGETS
    from asyncrl.models.lora import load_base_model, with_lora
    from asyncrl.protocol.messages import LoraSpec

    lora = LoraSpec(r=spec["lora_r"], alpha=2.0 * spec["lora_r"], dropout=0.0, target_modules=LORA_TARGETS)
    base, tokenizer = load_base_model(path, dtype=dtype, device=device)
    if gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = with_lora(base, lora, seed=seed).to(device).train()
    for p in model.parameters():  # fp32 LoRA, as the learner holds it
        if p.requires_grad:
            p.data = p.data.float()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    prepared = [bare_batches(g, tokenizer.pad_token_id, device, micro_batch_tokens) for g in batches]
    tokens = [int(sum(int(b["attn"].sum()) for b in mbs)) for mbs in prepared]
    bare_step(model, optimizer, prepared[0])  # warm-up
    clock = StepClock(device)
    clock.reset_peak()
    counted = []
    for i in range(steps):
        if i and time.time() > deadline:
            break
        clock.time(lambda: bare_step(model, optimizer, prepared[i % len(prepared)]))
        counted.append(tokens[i % len(prepared)])
    out = {**_rates(counted, clock), "micro_batches": min(len(m) for m in prepared)}
    del model, optimizer, prepared
    free_memory()
    return out


def coordinator_checkpointing() -> bool:
    """The coordinator's default for gradient checkpointing (coordinator/config.py), which both sides follow."""
    from asyncrl.coordinator.config import CoordinatorConfig

    return CoordinatorConfig.__dataclass_fields__["gradient_checkpointing"].default


def compare(shape: str, *, device: str, dtype, steps: int, batches: int, seed: int = 0, deadline: float | None = None,
            micro_batch_tokens: int | None = None, gradient_checkpointing: bool | None = None,
            peak_tflops: float = 0.0) -> dict:
    """Both sides of one shape, each alone; the figures bench/device_check.py and main() report.
    `gradient_checkpointing` None: the coordinator's default."""
    import torch

    from asyncrl.coordinator.learner.learner import rows_of

    if gradient_checkpointing is None:
        gradient_checkpointing = coordinator_checkpointing()

    spec = SHAPES[shape]
    mbt = micro_batch_tokens or spec["micro_batch_tokens"]
    path = model_path(shape, device)
    from transformers import AutoConfig, AutoTokenizer

    # token ids the engines can sample (the softmax covers len(tokenizer) ids; the embedding may be padded)
    vocab = min(AutoConfig.from_pretrained(path).vocab_size, len(AutoTokenizer.from_pretrained(path)))
    fixed = make_batches(batches, spec, vocab, seed)
    deadline = deadline or time.time() + 1e9
    half = time.time() + (deadline - time.time()) / 2
    kw = dict(device=device, dtype=dtype, micro_batch_tokens=mbt, gradient_checkpointing=gradient_checkpointing,
              steps=steps, seed=seed)
    learner, lora = learner_side(path, spec, fixed, deadline=half, **kw)
    bare = bare_side(path, spec, fixed, deadline=deadline, **kw)
    cfg = learner.pop("config")
    flops = statistics.mean(step_flops(cfg, rows_of(g))["lora"] for g in fixed)
    flops_6n = statistics.mean(step_flops(cfg, rows_of(g))["6n"] for g in fixed)
    cuda = str(device).startswith("cuda")
    gpu = torch.cuda.get_device_name(torch.device(device)) if cuda else None
    peak = (peak_tflops * 1e12 or peak_flops(gpu)) if cuda else None
    on_cpu = not cuda
    ratio_wall = learner["tokens_per_s"] / bare["tokens_per_s"]
    ratio_cpu = learner["tokens_per_cpu_s"] / bare["tokens_per_cpu_s"]
    params = sum(p.numel() for p in lora.values())
    return {
        "shape": shape, "model": path, "device": device, "gpu": gpu, "base_dtype": learner["base_dtype"],
        "lora_dtype": learner["lora_dtype"], "lora_params": params, "micro_batch_tokens": mbt,
        "micro_batches": learner["micro_batches"], "bare_micro_batches": bare["micro_batches"],
        "gradient_checkpointing": gradient_checkpointing, "rows_per_step": spec["groups"] * spec["rows_per_group"],
        "steps": learner["steps"], "bare_steps": bare["steps"],
        "learner_tokens_per_s": learner["tokens_per_s"], "bare_tokens_per_s": bare["tokens_per_s"],
        "learner_step_s": learner["step_s"], "bare_step_s": bare["step_s"],
        "ratio": ratio_cpu if on_cpu else ratio_wall, "ratio_wall": ratio_wall,
        "ratio_basis": "process CPU time" if on_cpu else "wall clock",
        "learner_peak_gpu_bytes": learner["peak_gpu_bytes"], "bare_peak_gpu_bytes": bare["peak_gpu_bytes"],
        "flops_per_step": flops, "flops_per_step_6n": flops_6n, "peak_flops": peak,
        "mfu": flops / learner["step_s"] / peak if peak else None,
        "mfu_6n": flops_6n / learner["step_s"] / peak if peak else None,
        "bare_mfu": flops / bare["step_s"] / peak if peak else None,
        "_lora": lora,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json-out", default="runs/bench/learner_throughput.json")
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="base weights (auto: fp32 on cpu, bf16 on cuda); LoRA and AdamW stay fp32")
    p.add_argument("--micro-batch-tokens", type=int, default=0, help="0: the shape's (>= 2 micro-batches per step)")
    p.add_argument("--no-gradient-checkpointing", action="store_true",
                   help="both sides without checkpointing (the coordinator's default is on)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="GPU dense bf16 peak for MFU (0 = by name)")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=12, help="timed steps per side")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch

    from asyncrl.models.lora import resolve_placement
    from asyncrl.protocol.atomic import write_json_atomic

    torch.set_num_threads(a.threads)
    device, dtype = resolve_placement(a.device, a.dtype)
    out = compare(a.shape, device=device, dtype=dtype, steps=a.steps, batches=a.batches, seed=a.seed,
                  micro_batch_tokens=a.micro_batch_tokens or None,
                  gradient_checkpointing=False if a.no_gradient_checkpointing else None, peak_tflops=a.peak_tflops)
    out.pop("_lora")
    out.update(benchmark="learner_throughput", date=time.strftime("%Y-%m-%d %H:%M:%S"), threads=a.threads,
               goal_ratio_min=0.70, load_average=os.getloadavg())
    Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.json_out, out, indent=2)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
