"""Device check: the figures a first GPU run needs, from one command, inside a time budget.

    python bench/device_check.py --json-out runs/bench/device_check.json          # one GPU, <= 8 min
    python bench/device_check.py --smoke --json-out D.json                        # CPU, tiny shapes, < 3 min

Needs torch, transformers and peft, plus the project's small pure-Python wire codec (msgspec, which
asyncrl.protocol.messages imports) — no vLLM, no hivemind, no network. It runs from a plain checkout (asyncrl is
made importable from the repository when it is not installed) and imports only modules that pull neither
hivemind nor vLLM (tests/test_device_check.py checks that). Missing modules are named in one line before
anything runs.

Sections, in this order (a section that would start past the budget is skipped and listed in `skipped`):
  learner.small   Qwen2.5-1.5B shape (random weights from its config): `Learner.step` tokens/s, peak GPU
                  memory, MFU, and the ratio to a bare micro-batched LoRA loop, each side alone
                  (bench/learner_throughput.py `compare`): bf16 base, fp32 LoRA, >= 2 micro-batches per step
                  with accumulation, gradient checkpointing on (the coordinator's default).
  generation      the transformers engine (client/engine.py) in bf16 with a trained-looking LoRA (random
                  lora_B) on the 1.5B shape: generated tokens/s.
  audit           the audit's statistic (coordinator/trust/audit.py `mismatch`) of those honest samples against the
                  learner's own recomputation (bf16 base, fp32 LoRA, the published bf16 adapter): per batch,
                  and the tolerance the audit policy would learn for the class transformers/bf16
                  (coordinator/trust/audit_policy.py, fed through its public `judge`).
  export          `export --merge`'s merge (coordinator/operator/export.py `merge_adapter`: on the device, base dtype)
                  of that adapter into the 1.5B base, and writing the merged model.
  learner.large   the same as learner.small at the Qwen2.5-7B shape.
`--smoke` runs the same sections on the CPU with the tiny model (both learner roles, a few rows) in fp32 (a CPU
without AMX emulates bf16, ~10x slower) and writes the same keys; figures that need a GPU (peak GPU memory,
MFU) are null there.

The budget (`--budget-s`, default 480 s; 170 s with --smoke) is enforced inside: every timed loop stops at
its section's share, a section is skipped when the budget is spent, and a watchdog writes what was measured
(`complete: false`) and exits 3 if the budget plus a grace is exceeded anyway (e.g. a model load that hangs).
Output: the JSON (`--json-out`) and a short text report next to it (`.txt`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDS = ("torch", "transformers", "peft", "safetensors", "numpy", "msgspec")
FORBIDDEN = {"hivemind", "vllm"}  # a bare GPU machine may have neither; reported in `loaded_forbidden`
GRACE_S = 30
SCHEMA = 1

# Section -> share of the budget its timed loops may use (setup time comes out of the same budget).
SHARES = {"learner.small": 0.25, "generation": 0.12, "audit": 0.08, "export": 0.10, "learner.large": 0.45}


def _importable_checkout() -> None:
    """Import `asyncrl.*` from this checkout (installed or not, the figures are this tree's): the subpackages
    are the top-level folders (pyproject's package-dir), so the checkout root joins asyncrl's search path."""
    sys.path.insert(0, str(ROOT))
    import asyncrl

    if str(ROOT) not in asyncrl.__path__:
        asyncrl.__path__.append(str(ROOT))


def missing_modules() -> list[str]:
    return [m for m in NEEDS if importlib.util.find_spec(m) is None]


LEARNER_KEYS = ("shape", "device", "gpu", "base_dtype", "lora_dtype", "lora_params", "micro_batch_tokens",
                "micro_batches", "bare_micro_batches", "gradient_checkpointing", "rows_per_step", "steps", "bare_steps",
                "learner_tokens_per_s", "bare_tokens_per_s", "learner_step_s", "bare_step_s", "ratio", "ratio_wall",
                "ratio_basis", "learner_peak_gpu_bytes", "bare_peak_gpu_bytes", "flops_per_step", "peak_flops", "mfu",
                "mfu_6n", "bare_mfu")


def empty_result() -> dict:
    """Every key a full GPU run fills (values null until measured); --smoke writes the same keys."""
    return {
        "device_check": SCHEMA, "smoke": None, "device": None, "gpu": None, "versions": {}, "budget_s": None,
        "elapsed_s": None, "complete": False, "skipped": [], "errors": {}, "loaded_forbidden": [],
        "learner": {"small": dict.fromkeys(LEARNER_KEYS), "large": dict.fromkeys(LEARNER_KEYS)},
        "generation": dict.fromkeys(("shape", "dtype", "rows", "prompt_tokens", "max_new_tokens", "tokens",
                                     "seconds", "tokens_per_s", "peak_gpu_bytes")),
        "audit": dict.fromkeys(("engine_class", "batches", "completions", "mismatch", "worst", "quantile_95",
                                "base_tolerance", "learn_ceiling", "learned_tolerance", "passed_at_learned",
                                "passed_at_base")),
        "export": dict.fromkeys(("shape", "device", "dtype", "merge_s", "save_s", "bytes_written")),
    }


class Budget:
    def __init__(self, seconds: float):
        self.start = time.time()
        self.seconds = seconds

    def left(self) -> float:
        return self.start + self.seconds - time.time()

    def share(self, section: str) -> float:
        """The deadline of a section's timed loops: its share of the budget, within what is left."""
        return time.time() + max(0.0, min(self.left(), SHARES[section] * self.seconds))


def _shapes(smoke: bool) -> dict[str, str]:
    return {"small": "smoke", "large": "smoke"} if smoke else {"small": "qwen2.5-1.5b", "large": "qwen2.5-7b"}


def run_learner(result: dict, role: str, shape: str, ctx: dict, budget: Budget) -> None:
    from bench.learner_throughput import compare

    steps = 2 if ctx["smoke"] else 20
    figures = compare(shape, device=ctx["device"], dtype=ctx["dtype"], steps=steps, batches=2,
                      deadline=budget.share(f"learner.{role}"))
    if role == "small":
        ctx["lora"] = figures["_lora"]
    result["learner"][role].update({k: figures[k] for k in LEARNER_KEYS})


def _trained_adapter(ctx: dict, shape: str):
    """A Learner on the small shape with a trained-looking adapter (lora_B random), and that adapter as
    published: bf16 (specs, blobs) and tensors."""
    import torch

    from asyncrl.coordinator.config import LORA_TARGETS
    from asyncrl.coordinator.learner.learner import Learner
    from asyncrl.coordinator.learner.loss import LossConfig
    from asyncrl.models.lora import export_lora, load_lora, tensors_from_bytes
    from asyncrl.protocol.messages import LoraSpec

    from bench.learner_throughput import SHAPES, model_path

    spec = SHAPES[shape]
    lora = LoraSpec(r=spec["lora_r"], alpha=2.0 * spec["lora_r"], dropout=0.0, target_modules=LORA_TARGETS)
    path = model_path(shape, ctx["device"])
    learner = Learner(path, lora, lr=1e-4, loss=LossConfig(), max_staleness=None, device=ctx["device"],
                      dtype=ctx["dtype"], gradient_checkpointing=True)
    gen = torch.Generator().manual_seed(1)
    for name, p in learner.model.named_parameters():
        if "lora_B" in name:
            p.data = (torch.randn(p.shape, generator=gen) * 0.02).to(p.device, p.dtype)
    specs, blobs = export_lora(learner.model, "bf16")
    tensors = tensors_from_bytes(specs, blobs)
    load_lora(learner.model, tensors)  # the learner holds exactly what volunteers are served
    return path, lora, learner, specs, blobs, tensors


def run_generation_and_audit(result: dict, shape: str, ctx: dict, budget: Budget) -> None:
    import random

    import torch

    from asyncrl.client.engine import TransformersEngine
    from asyncrl.coordinator.learner.learner import TrainGroup
    from asyncrl.coordinator.trust.audit import DEFAULT_TOLERANCE, is_trained, mismatch
    from asyncrl.coordinator.trust.audit_policy import LEARN_QUANTILE, AuditPolicy, quantile
    from asyncrl.protocol.messages import SamplingParams

    smoke = ctx["smoke"]
    path, lora, learner, specs, blobs, tensors = _trained_adapter(ctx, shape)
    ctx["adapter"] = (path, lora, tensors)
    engine = TransformersEngine(path, lora, device=ctx["device"], dtype=ctx["dtype"], seed=2, stop_token_ids=[0])
    engine.load_adapter(1, specs, blobs)
    prompts_n, group, prompt_len, new = (2, 2, 6, 8) if smoke else (8, 8, 256, 256)
    rng = random.Random(3)
    vocab = min(engine.vocab_size, len(engine.tokenizer))  # ids the tokenizer has
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new)
    deadline = budget.share("generation")
    batches, seconds, tokens, rounds = [], 0.0, 0, 0
    if str(ctx["device"]).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    while rounds == 0 or (time.time() < deadline and rounds < (2 if smoke else 4)):
        prompts = [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(prompts_n)]
        t0 = time.perf_counter()
        samples = engine.generate(prompts, group, sampling)
        if str(ctx["device"]).startswith("cuda"):
            torch.cuda.synchronize()
        seconds += time.perf_counter() - t0
        tokens += sum(len(s.token_ids) for g in samples for s in g)
        batches.extend((p, g) for p, g in zip(prompts, samples))
        rounds += 1
    result["generation"].update(shape=shape, dtype=str(ctx["dtype"]).replace("torch.", ""), rows=prompts_n * group,
                                prompt_tokens=prompt_len, max_new_tokens=new, tokens=tokens, seconds=seconds,
                                tokens_per_s=tokens / seconds, peak_gpu_bytes=int(torch.cuda.max_memory_allocated())
                                if str(ctx["device"]).startswith("cuda") else None)
    del engine
    # The audit's statistic per batch (one prompt's group = one batch), against the learner's recomputation.
    deadline = budget.share("audit")
    stats = []
    for prompt, samples in batches:
        if stats and time.time() > deadline:
            break
        g = TrainGroup(prompt, [s.token_ids for s in samples], [s.logprobs for s in samples], [0.0] * len(samples),
                       version=1, temperature=sampling.temperature)
        recomputed, mask = learner.score_groups([g])
        claimed = torch.zeros_like(recomputed)
        for i, s in enumerate(samples):
            claimed[i, :len(s.logprobs)] = torch.tensor(s.logprobs)
        stats.append(mismatch(recomputed, claimed, mask))
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(ctx["dtype"], "fp32")
    policy = AuditPolicy(DEFAULT_TOLERANCE, learn_batches=len(stats))
    for i, stat in enumerate(stats):
        policy.judge(f"honest-{i}".encode(), stat, dtype_name, "transformers", trained=is_trained(tensors))
    learned = policy.tolerance(dtype_name, "transformers")
    result["audit"].update(engine_class=f"transformers/{dtype_name}", batches=len(stats),
                           completions=len(stats) * group, mismatch=stats, worst=max(stats),
                           quantile_95=quantile(stats, LEARN_QUANTILE), base_tolerance=DEFAULT_TOLERANCE,
                           learn_ceiling=policy.ceiling(dtype_name), learned_tolerance=learned,
                           passed_at_learned=sum(s <= learned for s in stats),
                           passed_at_base=sum(s <= DEFAULT_TOLERANCE for s in stats))
    del learner
    from bench.learner_throughput import free_memory

    free_memory()


def run_export(result: dict, shape: str, ctx: dict, budget: Budget) -> None:
    import tempfile

    import torch

    from asyncrl.coordinator.operator.export import merge_adapter
    from asyncrl.models.lora import peft_config, standard_adapter_names

    from bench.learner_throughput import free_memory

    path, lora, tensors = ctx["adapter"]
    cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in peft_config(lora).to_dict().items()}
    named = standard_adapter_names(tensors)
    device = ctx["device"]
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    t0 = time.perf_counter()
    merged = merge_adapter(path, cfg, named, device=device)
    sync()
    merge_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="asyncrl-merge-") as out:
        t0 = time.perf_counter()
        merged.save_pretrained(out, safe_serialization=True)
        save_s = time.perf_counter() - t0
        written = sum(f.stat().st_size for f in Path(out).iterdir())
    result["export"].update(shape=shape, device=str(device), dtype=str(next(merged.parameters()).dtype).replace(
        "torch.", ""), merge_s=merge_s, save_s=save_s, bytes_written=written)
    del merged
    free_memory()


def report_text(r: dict) -> str:
    def gib(x):
        return "not measured" if x is None else f"{x / (1 << 30):.1f} GiB"

    def num(x, fmt="{:.0f}"):
        return "not measured" if x is None else fmt.format(x)

    lines = [f"device check ({'smoke, ' if r['smoke'] else ''}{r['device']}{', ' + r['gpu'] if r['gpu'] else ''}): "
             f"{'complete' if r['complete'] else 'INCOMPLETE'} in {num(r['elapsed_s'])} s of {num(r['budget_s'])}"]
    for role in ("small", "large"):
        x = r["learner"][role]
        lines.append(f"learner {x['shape']}: {num(x['learner_tokens_per_s'])} tok/s (bare {num(x['bare_tokens_per_s'])}, "
                     f"ratio {num(x['ratio'], '{:.2f}')}), {num(x['micro_batches'])} micro-batches, peak "
                     f"{gib(x['learner_peak_gpu_bytes'])}, MFU {num(x['mfu'], '{:.1%}')}")
    g, a, e = r["generation"], r["audit"], r["export"]
    lines.append(f"generation (transformers, {g['dtype']}, LoRA): {num(g['tokens_per_s'])} tok/s over {num(g['rows'])} rows")
    lines.append(f"audit {a['engine_class']}: worst {num(a['worst'], '{:.2e}')}, q95 {num(a['quantile_95'], '{:.2e}')} "
                 f"over {num(a['batches'])} batches; learned tolerance {num(a['learned_tolerance'], '{:.3g}')} "
                 f"(base {a['base_tolerance']}, ceiling {a['learn_ceiling']}); honest passing at base: "
                 f"{num(a['passed_at_base'])}/{num(a['batches'])}")
    lines.append(f"export --merge on {e['device']} in {e['dtype']}: merge {num(e['merge_s'], '{:.1f}')} s, "
                 f"write {num(e['save_s'], '{:.1f}')} s")
    if r["skipped"]:
        lines.append("skipped (budget): " + ", ".join(r["skipped"]))
    for k, v in r["errors"].items():
        lines.append(f"error in {k}: {v}")
    return "\n".join(lines) + "\n"


def write(result: dict, json_out: Path) -> None:
    json_out.parent.mkdir(parents=True, exist_ok=True)
    tmp = json_out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    os.replace(tmp, json_out)
    json_out.with_suffix(".txt").write_text(report_text(result))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, the same keys")
    p.add_argument("--json-out", default="runs/bench/device_check.json")
    p.add_argument("--budget-s", type=float, default=0.0, help="wall-clock budget (default 480; 170 with --smoke)")
    p.add_argument("--device", default="", help="default: cuda when present (cpu with --smoke)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    a = p.parse_args(argv)
    missing = missing_modules()
    if missing:
        print(f"device_check: missing {', '.join(missing)}: pip install {' '.join(missing)}", file=sys.stderr)
        return 2
    _importable_checkout()
    import peft
    import torch
    import transformers

    budget = Budget(a.budget_s or (170.0 if a.smoke else 480.0))
    json_out = Path(a.json_out)
    device = a.device or ("cpu" if a.smoke or not torch.cuda.is_available() else "cuda:0")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("device_check: no CUDA device (use --smoke on a CPU)", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    result = empty_result()
    result.update(smoke=a.smoke, device=device, budget_s=budget.seconds,
                  gpu=torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None,
                  versions={"torch": torch.__version__, "transformers": transformers.__version__,
                            "peft": peft.__version__, "python": sys.version.split()[0]})
    lock = threading.Lock()

    def overrun() -> None:  # the budget's backstop: what was measured, then out
        with lock:
            result.update(elapsed_s=time.time() - budget.start, complete=False)
            result["errors"]["budget"] = f"over {budget.seconds:.0f} s + {GRACE_S} s; stopped"
            write(result, json_out)
        print(report_text(result), flush=True)
        os._exit(3)

    watchdog = threading.Timer(budget.seconds + GRACE_S, overrun)
    watchdog.daemon = True
    watchdog.start()
    # bf16 base on a GPU (the coordinator's default there); fp32 on a CPU, whose bf16 without AMX is emulated
    ctx = {"smoke": a.smoke, "device": device, "dtype": torch.bfloat16 if device.startswith("cuda") else torch.float32}
    shapes = _shapes(a.smoke)
    sections = [("learner.small", lambda: run_learner(result, "small", shapes["small"], ctx, budget)),
                ("generation", lambda: run_generation_and_audit(result, shapes["small"], ctx, budget)),
                ("export", lambda: run_export(result, shapes["small"], ctx, budget)),
                ("learner.large", lambda: run_learner(result, "large", shapes["large"], ctx, budget))]
    for name, fn in sections:
        if budget.left() <= 0 or (name == "export" and "adapter" not in ctx):
            result["skipped"].append(name)
            continue
        print(f"device_check: {name} ({budget.left():.0f} s left)", flush=True)
        try:
            fn()
        except Exception as exc:  # one section's failure is reported; the others still run
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    with lock:
        watchdog.cancel()
        result.update(elapsed_s=time.time() - budget.start, loaded_forbidden=sorted(FORBIDDEN & set(sys.modules)),
                      complete=not result["skipped"] and not result["errors"])
        write(result, json_out)
    print(report_text(result), end="", flush=True)
    return 0 if result["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
