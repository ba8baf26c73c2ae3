"""A real pretrained model learns a real task: the swarm against one process, same model, task and budget.

Owned here: the real-model benchmark of issue 44 (docs/real-model.md). With no flags it trains
SmolLM2-135M-Instruct on reasoning-gym `basic_arithmetic` restricted to two-term sums of 1-2 digit
numbers ("Calculate 24 + 84."; `chain_sum` adds differences with negative results, which the 135M model
got wrong in every greedy try here), scored on the last number of the completion, and:

 1. evaluates the base (greedy, the first `--n-eval` problems of the task's evaluation split);
 2. **swarm** arm: a real `asyncrl-coordinator run` and `--volunteers` `asyncrl-client join` processes on
    this machine, until `--steps` optimizer steps or `--wall-budget-s`; the checkpoints of every
    `--eval-every`-th step and the last are evaluated afterwards by `asyncrl-coordinator eval`'s code (the exported adapter loaded with
    stock transformers + peft);
 3. **local** arm: one process, the project's own `Learner` and `TransformersEngine`, generating then
    training in turn (no network, no signing, no audit, no leases), same hyperparameters and budget; its
    adapter is snapshotted every `--eval-every` steps and evaluated afterwards in-process (the same greedy
    code on the engine's model). Evaluating after the arm ends keeps evaluation off both arms' clocks.

The arms run one after the other, or with `--concurrent` at the same time (the local arm in a child
process), so that on a shared machine both see the same background load. Threads default to 1 per
process: on an oversubscribed machine a multi-threaded torch op waits at its barrier for a descheduled
thread, which made a 2-thread process many times slower than a 1-thread one here. The base
and every checkpoint are evaluated after both arms have stopped training.

Each arm's clock starts when its first process starts (model loading included) and its curve is
(wall seconds, greedy accuracy) at each evaluated step. JSON keys: acc_base, acc_trained (the swarm's
last evaluated checkpoint), acc_local, gain_ci95 ([low, high] of acc_trained - acc_base: Newcombe's hybrid
score interval for a difference of two proportions, from the two Wilson intervals; the same problems are
scored, so this treats them as independent samples and is conservative), n_eval, steps, wall_s,
tokens_generated, task, model, curves, time_to_target_ratio (the swarm's wall time to first reach
A = acc_base + 0.5 (acc_local - acc_base) over the local arm's; null when either never reaches it) and
export_check (the swarm's last checkpoint scored by stock loading and by the in-process loading: equal
within one problem). A PNG plots both curves.

Size: both arms, their evaluation and the report stay in this one script, so one set of flags drives both
arms and a reader sees in one place that they differ only in what the swarm adds (processes, network,
signing, audit, leases).

    .venv/bin/python bench/real_model.py --json-out runs/bench/real_model.json --png-out docs/img/real_model.png
    .venv/bin/python bench/real_model.py --model tiny --task reasoning_gym:chain_sum --task-param max_digits=1 \\
        --task-param min_terms=2 --task-param max_terms=2 --steps 3 --n-eval 8 \\
        --wall-budget-s 300 --eval-every 1 --group-size 2 --groups-per-step 2 --max-new-tokens 8   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script: bench.* imports
from bench.straggler import spawn, stop  # their own sessions; SIGTERM, then SIGKILL after a grace

DEFAULT_TASK = "reasoning_gym:basic_arithmetic"
DEFAULT_PARAMS = ("min_terms=2", "max_terms=2", "min_digits=1", "max_digits=2", 'operators=["+"]',
                  "allow_negation=false", "allow_parentheses=false")  # two-term sums of 1-2 digit numbers


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    from asyncrl.coordinator.operator.evaluate import wilson as w

    lo, hi = w(k, n, z)
    return lo, hi


def newcombe(k1: int, n1: int, k0: int, n0: int) -> list[float]:
    """Newcombe's hybrid score 95% interval for p1 - p0 (method 10 of Newcombe 1998)."""
    p1, p0 = k1 / n1, k0 / n0
    l1, u1 = wilson(k1, n1)
    l0, u0 = wilson(k0, n0)
    d = p1 - p0
    return [d - math.sqrt((p1 - l1) ** 2 + (u0 - p0) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p0 - l0) ** 2)]


def time_to(curve: list[dict], target: float) -> float | None:
    return next((pt["t"] for pt in curve if pt["acc"] >= target), None)


# ---- shared set-up ------------------------------------------------------------------------------------
def make_config(a, run_dir: Path):
    """The run's CoordinatorConfig (the swarm's coordinator gets the same values as flags)."""
    from asyncrl.coordinator.config_file import resolve_config

    return resolve_config({}, coordinator_overrides(a, run_dir), source="bench/real_model.py")


def coordinator_overrides(a, run_dir: Path) -> dict:
    return {"model": a.model, "run_dir": str(run_dir), "task": a.task, "task_params": tuple(a.task_param),
            "task_system_prompt": a.system_prompt, "task_extractor": a.extractor, "task_eval_size": max(a.n_eval, 200), "seed": a.seed,
            "lr": a.lr, "lora_r": a.lora_r, "group_size": a.group_size, "groups_per_step": a.groups_per_step,
            "min_groups": a.groups_per_step, "max_new_tokens": a.max_new_tokens, "max_steps": a.steps,
            "temperature": 1.0}


def model_dir(model: str) -> str:
    from asyncrl.models import sources

    return sources.resolve(model).path


def eval_prompts(cfg, tokenizer, n: int):
    from asyncrl.coordinator.operator.evaluate import eval_prompts as prompts

    return prompts(cfg, cfg, tokenizer, n)


def evaluate_base(cfg, a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.coordinator.operator.evaluate import greedy_eval
    from asyncrl.models.pinning import stop_token_ids

    path = model_dir(cfg.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return greedy_eval(model, tok, eval_prompts(cfg, tok, a.n_eval), max_new_tokens=cfg.max_new_tokens,
                       stop_ids=stop_token_ids(path, tok), batch_size=a.eval_batch, progress=True)


def summary(result: dict) -> dict:
    return {k: result[k] for k in ("n", "correct", "accuracy", "ci95", "mean_score", "answered")}


# ---- the swarm arm ------------------------------------------------------------------------------------
def step_times(run_dir: Path) -> dict[int, float]:
    """optimizer step -> wall time of its metrics event."""
    from asyncrl.runlog import read_events

    return {int(e["step"]): float(e["t"]) for e in read_events(run_dir / "metrics.jsonl")
            if e.get("event") == "step" and "step" in e}


def swarm_arm(a, cfg, run_dir: Path) -> dict:
    flags = ["--model", a.model, "--run-dir", str(run_dir), "--run-id", f"realmodel-{a.seed}", "--task", a.task,
             "--max-steps", str(a.steps), "--seed", str(a.seed), "--lr", str(a.lr), "--lora-r", str(a.lora_r),
             "--group-size", str(a.group_size), "--groups-per-step", str(a.groups_per_step),
             "--min-groups", str(a.groups_per_step), "--max-new-tokens", str(a.max_new_tokens),
             "--prompts-per-lease", str(max(1, a.groups_per_step // a.volunteers)),
             "--checkpoint-every", "1", "--keep-checkpoints", "100000", "--no-dashboard",
             "--threads", str(a.coordinator_threads), "--task-system-prompt", a.system_prompt,
             "--task-eval-size", str(max(a.n_eval, 200)), "--task-extractor", a.extractor, "--port", "0"]
    for p in a.task_param:
        flags += ["--task-param", p]
    t0 = time.time()
    coord = spawn(["-m", "asyncrl.coordinator.cli", "run", *flags], run_dir.parent / "coordinator.log")
    vols: list[subprocess.Popen] = []
    timed_out = False
    try:
        join = run_dir / "join.txt"
        while not (join.exists() and join.read_text().strip()):
            if coord.poll() is not None or time.time() - t0 > a.wall_budget_s:
                raise RuntimeError("coordinator did not start:\n" + (run_dir.parent / "coordinator.log").read_text()[-3000:])
            time.sleep(0.5)
        address = join.read_text().strip()
        for i in range(a.volunteers):
            data = run_dir.parent / f"volunteer-{i}"
            vols.append(spawn(["-m", "asyncrl.client.cli", "join", address, "--name", f"vol-{i}", "--data-dir",
                               str(data), "--seed", str(a.seed * 100 + i), "--threads", str(a.volunteer_threads),
                               "--prompts-per-batch", str(max(1, a.groups_per_step // a.volunteers)),
                               "--fixed-lease-size", "--engine", "transformers", "--quiet"],
                              run_dir.parent / f"volunteer-{i}.log"))
        last = 0.0
        while coord.poll() is None:
            if time.time() - t0 > a.wall_budget_s:
                timed_out = True
                break
            if time.time() - last > 60:
                last = time.time()
                done = max(step_times(run_dir), default=0)
                print(f"  [swarm {time.time() - t0:6.0f}s] step {done}  load {os.getloadavg()[0]:.1f}", flush=True)
            time.sleep(2.0)
    finally:
        stop(coord, grace=300)  # SIGTERM: the coordinator checkpoints the step it is at, then exits
        for v in vols:
            stop(v, grace=60)
    wall = time.time() - t0
    times = step_times(run_dir)
    tokens = 0  # completion tokens the volunteers generated (their status.json)
    for i in range(a.volunteers):
        status = run_dir.parent / f"volunteer-{i}" / "status.json"
        if status.is_file():
            tokens += int(json.loads(status.read_text()).get("tokens", 0))
    return {"t0": t0, "wall_s": wall, "timed_out": timed_out, "steps": max(times, default=0), "step_t": times,
            "tokens_generated": tokens}


def swarm_curve(a, run_dir: Path, info: dict) -> list[dict]:
    """Checkpoints every `eval_every` steps and the last, evaluated by `asyncrl-coordinator eval`'s code (stock
    transformers + peft). The coordinator checkpoints every step, so a stop in the middle of a long step still
    leaves the one before it."""
    from asyncrl.coordinator.operator.evaluate import evaluate

    steps = sorted({int(json.loads((p / "meta.json").read_text())["step"])
                    for p in (run_dir / "checkpoints").glob("step-*") if (p / "meta.json").is_file()})
    curve = []
    for step in steps:  # every eval_every-th step, and the last (a checkpoint is written after every step)
        if step == 0 or (step % a.eval_every and step != steps[-1]):
            continue
        r = evaluate(run_dir, step=step, n=a.n_eval, batch_size=a.eval_batch, progress=False)
        t = info["step_t"].get(step)
        meta_t = max((p / "meta.json").stat().st_mtime for p in (run_dir / "checkpoints").glob(f"step-{step:08d}-*"))
        curve.append({"step": step, "t": (t if t is not None else meta_t) - info["t0"], "acc": r["accuracy"],
                      "correct": r["correct"], "n": r["n"]})
        print(f"  swarm step {step}: {r['correct']}/{r['n']} at {curve[-1]['t']:.0f}s", flush=True)
    return curve


# ---- the local arm ------------------------------------------------------------------------------------
def local_arm(a, cfg) -> dict:
    """Generate, then train, in turn, in one process: the project's own Learner and TransformersEngine."""
    import torch

    from asyncrl import tasks
    from asyncrl.client.engine import TransformersEngine
    from asyncrl.coordinator.learner.ddp import make_learner
    from asyncrl.coordinator.learner.learner import TrainGroup
    from asyncrl.models.lora import export_lora
    from asyncrl.protocol.messages import LoraSpec, SamplingParams
    from asyncrl.tasks.sources import encode_prompt, open_source

    t0 = time.time()
    torch.set_num_threads(a.local_threads)
    path = model_dir(cfg.model)
    spec = LoraSpec(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, target_modules=cfg.lora_targets)
    learner = make_learner(path, spec, **{**cfg.learner_kwargs(), "device": "cpu", "dtype": "fp32"})
    engine = TransformersEngine(path, spec, seed=a.seed)
    source = open_source(cfg.task, seed=cfg.seed, tokenizer=learner.tokenizer, **cfg.task_options())
    sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    snapshots, tokens, step = [], 0, 0
    while step < a.steps and time.time() - t0 < a.wall_budget_s:
        engine.load_adapter(learner.version, *export_lora(learner.model, cfg.publish_dtype))
        prompts = [next(source) for _ in range(cfg.groups_per_step)]
        ids = [encode_prompt(learner.tokenizer, p.text) for p in prompts]
        groups = []
        for p, pid, samples in zip(prompts, ids, engine.generate(ids, cfg.group_size, sampling)):
            comps = [s.token_ids for s in samples]
            texts = [learner.tokenizer.decode(c, skip_special_tokens=True) for c in comps]
            rewards = tasks.score_group(p, texts, comps).rewards
            tokens += sum(len(c) for c in comps)
            groups.append(TrainGroup(pid, comps, [s.logprobs for s in samples], rewards, learner.version,
                                     cfg.temperature, truncated=[s.finish_reason == "length" for s in samples]))
        result = learner.step(groups)
        learner.version += 1
        step += 1
        if step % a.eval_every == 0:
            snapshots.append((step, time.time() - t0, learner.lora_parameters()))
        print(f"  [local {time.time() - t0:6.0f}s] step {step} reward {result.reward_mean if result else 0:.3f}",
              flush=True)
    wall = time.time() - t0
    if not snapshots or snapshots[-1][0] != step:
        snapshots.append((step, wall, learner.lora_parameters()))
    return {"wall_s": wall, "steps": step, "tokens_generated": tokens, "snapshots": snapshots, "engine": engine,
            "learner": learner}


def in_process_eval(engine, named_params: dict, cfg, a, prompts) -> dict:
    """The local arm's own evaluation: LoRA tensors put into the engine's PEFT model, then the same greedy code."""
    import torch

    from asyncrl.coordinator.operator.evaluate import greedy_eval

    with torch.no_grad():
        own = dict(engine.model.named_parameters())
        for name, value in named_params.items():
            own[name].copy_(value)
    return greedy_eval(engine.model.eval(), engine.tokenizer, prompts, max_new_tokens=cfg.max_new_tokens,
                       stop_ids=engine.stop_token_ids, batch_size=a.eval_batch)


def checkpoint_params(run_dir: Path, step: int) -> dict:
    """A swarm checkpoint's LoRA tensors by in-model (PEFT) name: how the project itself loads them."""
    from safetensors.torch import load_file

    from asyncrl.coordinator.operator.export import find_checkpoint

    return load_file(str(find_checkpoint(run_dir, step) / "adapter.safetensors"))


# ---- the report ---------------------------------------------------------------------------------------
def plot(path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, style in (("swarm", "o-"), ("local", "s--")):
        pts = [{"t": 0.0, "acc": result["acc_base"]}] + result["curves"][name]
        ax.plot([p["t"] / 60 for p in pts], [p["acc"] for p in pts], style, label=name)
    ax.axhline(result["acc_base"], color="gray", lw=0.8, ls=":", label="base")
    if result.get("target") is not None:
        ax.axhline(result["target"], color="red", lw=0.8, ls=":", label="target A")
    ax.set_xlabel("wall time (min, model loading included)")
    ax.set_ylabel(f"greedy accuracy ({result['n_eval']} eval problems)")
    ax.set_title(f"{result['model']} on {result['task']} (seed {result['seed']})", fontsize=9)
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def local_report(a, cfg) -> dict:
    """The local arm, then its snapshots evaluated in-process: {"steps", "wall_s", "tokens_generated", "curve"}."""
    local = local_arm(a, cfg)
    Path(a.run_dir, "local.trained").write_text(str(local["wall_s"]))  # --concurrent: evaluation may start
    prompts = eval_prompts(cfg, local["engine"].tokenizer, a.n_eval)
    curve = []
    for step, t, params in local["snapshots"]:
        r = in_process_eval(local["engine"], params, cfg, a, prompts)
        curve.append({"step": step, "t": t, "acc": r["accuracy"], "correct": r["correct"], "n": r["n"]})
        print(f"  local step {step}: {r['correct']}/{r['n']} at {t:.0f}s", flush=True)
    return {"steps": local["steps"], "wall_s": local["wall_s"], "tokens_generated": local["tokens_generated"],
            "curve": curve}


def export_check(a, cfg, run_dir: Path, last: dict) -> dict:
    """The swarm's last evaluated checkpoint loaded the project's way (its in-model tensors into the
    engine's PEFT model, as the local arm evaluates): the same count as stock peft on the export, +-1?"""
    from asyncrl.client.engine import TransformersEngine
    from asyncrl.protocol.messages import LoraSpec

    spec = LoraSpec(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=0.0, target_modules=cfg.lora_targets)
    engine = TransformersEngine(model_dir(cfg.model), spec, seed=a.seed)
    r = in_process_eval(engine, checkpoint_params(run_dir, last["step"]), cfg, a,
                        eval_prompts(cfg, engine.tokenizer, a.n_eval))
    return {"step": last["step"], "stock_peft_correct": last["correct"], "in_process_correct": r["correct"],
            "equal_within_1": abs(r["correct"] - last["correct"]) <= 1}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--task", default=DEFAULT_TASK)
    p.add_argument("--task-param", action="append", default=None, metavar="KEY=VALUE",
                   help=f"generator parameters (default {' '.join(DEFAULT_PARAMS)})")
    p.add_argument("--system-prompt", default="reasoning_gym:direct",
                   help="task_system_prompt (reasoning-gym's 'direct': the answer alone, in <answer> tags)")
    p.add_argument("--extractor", default="last_number", choices=["answer_tags", "last_number", "raw"],
                   help="task_extractor: SmolLM2-135M never writes <answer> tags (greedy or sampled), so a tag-only "
                        "reward is 0 for every sample and GRPO gets no signal; last_number reads its final number")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per arm at most")
    p.add_argument("--wall-budget-s", type=float, default=1800, help="per arm")
    p.add_argument("--volunteers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--n-eval", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=3, help="steps between evaluated checkpoints / snapshots")
    p.add_argument("--eval-batch", type=int, default=50)
    p.add_argument("--arms", default="swarm,local")
    p.add_argument("--concurrent", action="store_true",
                   help="run the two arms at the same time (the local arm in a child process), so both see the "
                        "same background load on a shared machine")
    p.add_argument("--coordinator-threads", type=int, default=1)
    p.add_argument("--volunteer-threads", type=int, default=1)
    p.add_argument("--local-threads", type=int, default=1)
    p.add_argument("--eval-threads", type=int, default=1, help="torch threads of the evaluations")
    p.add_argument("--run-dir", default="runs/bench/real_model")
    p.add_argument("--json-out", default="runs/bench/real_model.json")
    p.add_argument("--png-out", default="runs/bench/real_model.png")
    p.add_argument("--local-only-out", default=None, help=argparse.SUPPRESS)  # --concurrent's child
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.task_param = a.task_param or list(DEFAULT_PARAMS)
    import torch

    from bench.results import provenance, write_result

    torch.set_num_threads(a.eval_threads)  # the local arm sets its own (local_arm)

    root = Path(a.run_dir)
    if a.local_only_out:  # the child of --concurrent: the local arm alone
        write_result(a.local_only_out, local_report(a, make_config(a, root / "swarm" / "run")))
        return 0
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    cfg = make_config(a, root / "swarm" / "run")
    arms = a.arms.split(",")
    loads = [os.getloadavg()[0]]
    out: dict = {"task": a.task, "task_params": a.task_param, "model": a.model, "seed": a.seed, "n_eval": a.n_eval,
                 "hyperparameters": {k: getattr(a, k) for k in ("lr", "lora_r", "group_size", "groups_per_step",
                                                                 "max_new_tokens", "steps", "wall_budget_s",
                                                                 "volunteers", "system_prompt", "extractor", "concurrent",
                                                                 "coordinator_threads", "volunteer_threads",
                                                                 "local_threads")},
                 "curves": {"swarm": [], "local": []}, "steps": {}, "wall_s": {}, "tokens_generated": {},
                 "gain_ci95_method": "Newcombe hybrid score (Wilson) interval for a difference of proportions"}
    child = None
    if "local" in arms and a.concurrent:
        child_out = root / "local.json"
        child = spawn([str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:]),
                       "--local-only-out", str(child_out)], root / "local.log")
    local = None
    if "swarm" in arms:
        run_dir = root / "swarm" / "run"
        run_dir.mkdir(parents=True)
        info = swarm_arm(a, cfg, run_dir)
        loads.append(os.getloadavg()[0])
        while child is not None and child.poll() is None and not (root / "local.trained").exists():
            time.sleep(2.0)  # evaluation stays off the local arm's clock too
        out["steps"]["swarm"], out["wall_s"]["swarm"] = info["steps"], info["wall_s"]
        out["tokens_generated"]["swarm"] = info["tokens_generated"]
        out["curves"]["swarm"] = swarm_curve(a, run_dir, info)
    print(f"base: evaluating {a.n_eval} problems ...", flush=True)
    base = evaluate_base(cfg, a)
    print(f"base: {base['correct']}/{base['n']}", flush=True)
    out["acc_base"], out["base"] = base["accuracy"], summary(base)
    if out["curves"]["swarm"]:
        out["export_check"] = export_check(a, cfg, root / "swarm" / "run", out["curves"]["swarm"][-1])
    if "local" in arms:
        if child is not None:
            if child.wait() != 0:
                raise RuntimeError("the local arm failed: " + (root / "local.log").read_text()[-3000:])
            local = json.loads((root / "local.json").read_text())
        else:
            local = local_report(a, cfg)
        loads.append(os.getloadavg()[0])
        out["steps"]["local"], out["wall_s"]["local"] = local["steps"], local["wall_s"]
        out["tokens_generated"]["local"] = local["tokens_generated"]
        out["curves"]["local"] = local["curve"]
    sw, lo = out["curves"]["swarm"], out["curves"]["local"]
    out["acc_trained"] = sw[-1]["acc"] if sw else None
    out["acc_local"] = lo[-1]["acc"] if lo else None
    if sw:
        out["gain"] = out["acc_trained"] - out["acc_base"]
        out["gain_ci95"] = newcombe(sw[-1]["correct"], sw[-1]["n"], base["correct"], base["n"])
    if sw and lo:
        target = out["acc_base"] + 0.5 * (out["acc_local"] - out["acc_base"])
        out["target"] = target
        ts, tl = time_to(sw, target), time_to(lo, target)
        out["time_to_target_s"] = {"swarm": ts, "local": tl}
        out["time_to_target_ratio"] = ts / tl if ts is not None and tl else None
    out["loadavg_1m"] = [round(x, 2) for x in loads]
    out.update(provenance())
    write_result(a.json_out, out)
    if a.png_out and (sw or lo):
        plot(Path(a.png_out), out)
    print(json.dumps({k: out.get(k) for k in ("acc_base", "acc_trained", "acc_local", "gain_ci95",
                                              "time_to_target_ratio", "export_check", "steps", "wall_s")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
