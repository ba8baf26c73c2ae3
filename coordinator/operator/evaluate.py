"""`asyncrl-coordinator eval`: greedy accuracy of a run's trained adapter (or of its base) on the task's
evaluation split, loaded the way anyone outside asyncrl would load it.

    asyncrl-coordinator eval --run-dir runs/r1 --n 200                    # the newest checkpoint's adapter
    asyncrl-coordinator eval --run-dir runs/r1 --step 40 --json-out r1-40.json
    asyncrl-coordinator eval --run-dir runs/r1 --base --n 200             # the base model, no adapter

Owned here: choosing the evaluation problems, loading, batched greedy generation, scoring and the report.

Loading is stock: the checkpoint's adapter is exported (coordinator/operator/export.py) to a temporary PEFT directory
and put on the base with `peft.PeftModel.from_pretrained`; the base is `AutoModelForCausalLM.from_pretrained`
on the run's pinned base directory (located and verified through models/pinning.py), in fp32. So the figure
is what the exported adapter gives outside asyncrl.

Problems: the first `--n` of the run's reasoning_gym: evaluation split (tasks/rgym.py; the task, its
parameters and seeds come from `<run_dir>/config.json`, flags may override them), templated exactly as the
training prompts were. Before scoring, the problems are checked against the run's own training split: an
evaluation problem whose question the run trained on is refused (SPLIT_OVERLAP, exit 2).

Generation: greedy (`do_sample=False`), left-padded batches of `--batch-size` in problem order, stopping
at the pinned stop tokens or `--max-new-tokens` (default: the run's max_new_tokens). A problem counts as
correct when the task's reward (the same `tasks.score_group` the swarm trains on) is 1.0; `mean_score`
averages the reward itself (reasoning-gym gives partial credit on some datasets).

Exit codes: 0 scored · 2 bad arguments, no checkpoint, not a reasoning_gym: task, or SPLIT_OVERLAP.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import tempfile
from pathlib import Path

EXIT_OK, EXIT_USAGE = 0, 2


class EvalError(RuntimeError):
    """Nothing to evaluate, or problems that cannot be used; the message says what to change."""


def add_subcommand(sub) -> None:
    p = sub.add_parser("eval", help="greedy accuracy of a run's adapter (or --base) on the task's evaluation split")
    p.add_argument("--run-dir", required=True, help="the run directory (config.json, checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint at this optimizer step (default: newest)")
    p.add_argument("--base", action="store_true", help="evaluate the base model without the adapter")
    p.add_argument("--n", type=int, default=200, help="evaluation problems (the split's first N; default 200)")
    p.add_argument("--batch-size", type=int, default=32, help="problems per generate() call (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the run's max_new_tokens")
    p.add_argument("--task", default=None, help="override the run's task (a reasoning_gym:<dataset>)")
    p.add_argument("--task-param", dest="task_params", action="append", metavar="KEY=VALUE",
                   help="override the run's generator parameters (repeatable; all of them)")
    p.add_argument("--task-eval-seed", type=int, default=None, help="override the evaluation split's seed")
    p.add_argument("--json-out", default=None, help="write the report (with every completion) here")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        report = evaluate(Path(args.run_dir), step=args.step, base=args.base, n=args.n, batch_size=args.batch_size,
                          max_new_tokens=args.max_new_tokens, task=args.task, task_params=args.task_params,
                          eval_seed=args.task_eval_seed, progress=not args.no_progress)
    except EvalError as exc:
        print(f"asyncrl-coordinator eval: {exc}", file=sys.stderr)
        return EXIT_USAGE
    what = "base" if report["base"] else f"step {report['step']} adapter"
    lo, hi = report["ci95"]
    print(f"{report['task']} ({what}): {report['correct']}/{report['n']} correct = {report['accuracy']:.3f} "
          f"(Wilson 95% {lo:.3f}-{hi:.3f}); mean score {report['mean_score']:.3f}; answered {report['answered']}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return EXIT_OK


# ---- the problems ---------------------------------------------------------------------------------
def run_config(run_dir: Path):
    from ..config import ConfigError
    from ..config_file import resolve_config

    path = run_dir / "config.json"
    if not path.is_file():
        raise EvalError(f"{run_dir} is not a run directory (no config.json)")
    try:
        return resolve_config(json.loads(path.read_text()), source=str(path))
    except ConfigError as exc:
        raise EvalError(f"{path}: {exc}") from None


def eval_config(cfg, *, task: str | None = None, task_params=None, eval_seed: int | None = None, n: int = 200):
    """The run's config with the evaluation overrides, the split grown to hold `n` problems."""
    changes = {k: v for k, v in (("task", task), ("task_params", tuple(task_params) if task_params else None),
                                 ("task_eval_seed", eval_seed)) if v is not None}
    changes["task_eval_size"] = max(n, cfg.task_eval_size)
    return dataclasses.replace(cfg, **changes)


def eval_prompts(run_cfg, cfg, tokenizer, n: int) -> list:
    """The first `n` problems of `cfg`'s evaluation split as leased prompts; SPLIT_OVERLAP (EvalError) when
    one of them is in `run_cfg`'s training split."""
    from asyncrl.tasks import rgym
    from asyncrl.tasks.sources import TaskSourceError, open_source

    if not cfg.task.startswith(rgym.PREFIX):
        raise EvalError(f"eval needs a reasoning_gym:<dataset> task (it has an evaluation split); the run's is "
                        f"{cfg.task!r}: pass --task")
    if n < 1:
        raise EvalError("--n must be at least 1")
    try:
        source = open_source(cfg.task, tokenizer=tokenizer, split="eval", **cfg.task_options())
        prompts = [next(source) for _ in range(n)]
        if run_cfg.task.startswith(rgym.PREFIX):
            trained, _, _ = rgym.splits(rgym.dataset_name(run_cfg.task), run_cfg.task_generator())
            rgym.check_disjoint(trained, [{"question": json.loads(p.columns)["prompt"]} for p in prompts])
    except (TaskSourceError, ValueError) as exc:
        raise EvalError(str(exc)) from None
    return prompts


# ---- loading, stock ---------------------------------------------------------------------------------
def base_directory(run_dir: Path, cfg) -> str:
    """The run's base model directory: a checkpoint's pin located and verified, else the config's model."""
    from asyncrl.models import pinning, sources

    from .export import ExportError, find_checkpoint

    try:
        meta = json.loads((find_checkpoint(run_dir, None) / "meta.json").read_text())
    except ExportError:
        meta = {}
    try:
        if meta.get("base_pin"):
            pin = pinning.BasePin(**{**meta["base_pin"], "stop_token_ids": tuple(meta["base_pin"]["stop_token_ids"])})
            return sources.locate(pin).path
        return sources.resolve(cfg.model, cfg.model_revision).path
    except pinning.PinError as exc:
        raise EvalError(f"cannot load the base model: {exc}") from None


def load_model(run_dir: Path, cfg, *, step: int | None, base: bool):
    """(model, tokenizer, stop ids, info): stock transformers, plus stock peft on the exported adapter."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.models.pinning import stop_token_ids

    from .export import ExportError, export

    base_dir = base_directory(run_dir, cfg)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    info = {"base": base, "step": None, "adapter_version": None, "base_dir": str(base_dir)}
    if not base:
        from peft import PeftModel

        with tempfile.TemporaryDirectory() as tmp:
            try:
                result = export(run_dir, Path(tmp) / "adapter", step=step)
            except ExportError as exc:
                raise EvalError(str(exc)) from None
            model = PeftModel.from_pretrained(model, str(result.out))
        info.update(step=result.step, adapter_version=result.version)
    return model.eval(), tokenizer, stop_token_ids(base_dir, tokenizer), info


# ---- generation and scoring ---------------------------------------------------------------------------
def wilson(k: int, n: int, z: float = 1.959964) -> list[float]:
    """Wilson score interval of a binomial proportion k/n."""
    if n == 0:
        return [0.0, 1.0]
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, mid - half), min(1.0, mid + half)]


def greedy_eval(model, tokenizer, prompts, *, max_new_tokens: int, stop_ids, batch_size: int = 32,
                progress: bool = False) -> dict:
    """Greedy completions of `prompts` (tasks.Prompt, in order, left-padded batches) and their scores."""
    import torch

    from asyncrl import tasks
    from asyncrl.tasks import rgym
    from asyncrl.tasks.sources import encode_prompts

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = list(stop_ids) or [tokenizer.eos_token_id]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), desc="eval", unit="problem", file=sys.stderr)
    items = []
    for lo in range(0, len(prompts), batch_size):
        chunk = prompts[lo:lo + batch_size]
        ids = encode_prompts(tokenizer, [p.text for p in chunk])
        width = max(len(r) for r in ids)
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        attention = torch.zeros((len(ids), width), dtype=torch.long)
        for i, r in enumerate(ids):
            input_ids[i, width - len(r):] = torch.tensor(r)
            attention[i, width - len(r):] = 1
        device = next(model.parameters()).device
        with torch.no_grad():
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                                 pad_token_id=pad, temperature=None, top_p=None, top_k=None)
        for p, row in zip(chunk, out[:, width:].tolist()):
            cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            comp = row[:cut]
            text = tokenizer.decode(comp, skip_special_tokens=True)
            score = tasks.score_group(p, [text], [comp]).rewards[0]
            cols = json.loads(p.columns) if p.columns else {}
            extracted = rgym.extract(text, cols.get("rg_extractor", "raw")) if "rg_dataset" in cols else text
            items.append({"question": cols.get("prompt", p.text), "answer": p.answer, "completion": text,
                          "extracted": extracted, "score": score})
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    correct = sum(1 for it in items if it["score"] >= 1.0)
    n = len(items)
    return {"n": n, "correct": correct, "accuracy": correct / n if n else 0.0, "ci95": wilson(correct, n),
            "mean_score": sum(it["score"] for it in items) / n if n else 0.0,
            "answered": sum(1 for it in items if it["extracted"] is not None), "items": items}


def evaluate(run_dir: Path, *, step: int | None = None, base: bool = False, n: int = 200, batch_size: int = 32,
             max_new_tokens: int | None = None, task: str | None = None, task_params=None,
             eval_seed: int | None = None, progress: bool = True) -> dict:
    """The whole command: config, problems, stock loading, greedy generation, the report."""
    run_cfg = run_config(run_dir)
    try:
        cfg = eval_config(run_cfg, task=task, task_params=task_params, eval_seed=eval_seed, n=n)
    except ValueError as exc:
        raise EvalError(str(exc)) from None
    model, tokenizer, stops, info = load_model(run_dir, run_cfg, step=step, base=base)
    prompts = eval_prompts(run_cfg, cfg, tokenizer, n)
    budget = max_new_tokens or cfg.max_new_tokens
    result = greedy_eval(model, tokenizer, prompts, max_new_tokens=budget, stop_ids=stops, batch_size=batch_size,
                         progress=progress)
    gen = cfg.task_generator().resolved()
    return {"task": cfg.task, "task_params": list(cfg.task_params), "eval_seed": gen.eval_seed,
            "model": run_cfg.model, "max_new_tokens": budget, "run_dir": str(run_dir), **info, **result}
