"""DDP equivalence check: the same fixed batches through 1 process and through N (torchrun), same adapter.

Builds deterministic synthetic rollout groups for the built-in tiny model (uneven group sizes and
completion lengths, so the ranks' slices differ in size and the weighted gradient reduction is
exercised), runs `--steps` learner steps for each `--loss-types` entry, and (rank 0) writes the
resulting LoRA parameters to `--out` as safetensors, keyed `<loss type>/<parameter name>`.

    python -m asyncrl.coordinator.learner.ddp_check --out /tmp/one.safetensors
    torchrun --standalone --nproc-per-node 2 -m asyncrl.coordinator.learner.ddp_check --out /tmp/two.safetensors
    torchrun --standalone --nproc-per-node 2 -m asyncrl.coordinator.learner.ddp_check --parallel fsdp --out /tmp/fsdp.safetensors
    python -m asyncrl.coordinator.learner.ddp_check --compare /tmp/one.safetensors /tmp/two.safetensors
    torchrun --standalone --nproc-per-node 2 -m asyncrl.coordinator.learner.ddp_check --device cuda --out /tmp/nccl.safetensors

tests/coordinator/learner/test_ddp.py runs these commands on CPU (gloo). `--device` picks each rank's learner device
(cuda: cuda:LOCAL_RANK with NCCL); every rank writes next to `--out` (`<out>.rank<R>.json`) the device of every
collective it issued, which must be the learner's, and where it loaded the base (FSDP: rank 0 on the host,
the others on the meta device). `--timeout-s` sets the collective timeout and `--idle-s`
makes rank 0 wait that long (heartbeats only) before its first step, as a coordinator waits for rollouts.
"""

from __future__ import annotations

import argparse
import random
import sys


def synthetic_groups(step: int, n_groups: int, seed: int = 0):
    from asyncrl.models.tinymodel import CHARS

    from .learner import TrainGroup

    rng = random.Random(f"{seed}-{step}")
    groups = []
    for g in range(n_groups):
        letter = "abcd"[rng.randrange(4)]
        prompt = [1 + CHARS.index(ch) for ch in f"rep:{letter}="]
        size = rng.randint(3, 6)
        comps = [[rng.randint(1, len(CHARS)) for _ in range(rng.randint(2, 8))] for _ in range(size)]
        logps = [[-rng.uniform(0.5, 4.0) for _ in c] for c in comps]
        rewards = [rng.random() for _ in comps]
        groups.append(TrainGroup(prompt, comps, logps, rewards, version=0))
    return groups


def run(out: str, *, steps: int, groups_per_step: int, loss_types: list[str], seed: int,
        micro_batch_tokens: int = 8192, beta: float = 0.0, parallel: str = "ddp", dtype: str = "fp32",
        device: str = "cpu", timeout_s: float = 600.0, idle_s: float = 0.0) -> None:
    import json
    import time

    import torch
    from safetensors.torch import save_file

    from asyncrl.models import tinymodel
    from asyncrl.protocol.messages import LoraSpec

    from .ddp import finish_rank, make_learner, start_heartbeat, stop_heartbeat, world
    from .loss_config import LossConfig

    torch.set_num_threads(1)
    path = str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))
    lora = LoraSpec(r=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj", "o_proj", "up_proj"))
    rank, size = world()
    result, collectives = {}, []
    for i, loss_type in enumerate(loss_types):
        learner = make_learner(path, lora, lr=1e-2, loss=LossConfig(loss_type=loss_type, beta=beta),
                               max_staleness=None, seed=seed, micro_batch_tokens=micro_batch_tokens,
                               parallel=parallel, dtype=dtype, device=device, heartbeat_s=None,
                               collective_timeout_s=timeout_s)
        if i == 0 and idle_s > 0 and rank == 0 and size > 1:  # the others wait in their first step's header broadcast
            start_heartbeat(learner.comm, timeout_s / 4)
            time.sleep(idle_s)
            stop_heartbeat()
        for step in range(steps):  # every rank calls step(); rank 0's groups are the ones broadcast
            learner.step(synthetic_groups(step, groups_per_step, seed))
        for name, value in learner.lora_parameters().items():
            result[f"{loss_type}/{name}"] = value.detach().cpu().contiguous()
        if size > 1:
            collectives.append({"loss_type": loss_type, "learner_device": str(learner.device),
                                "base_loaded_on": learner._load_device(), **learner.comm.report()})
    if collectives:  # every rank: what it loaded the base on and where its collectives ran
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump({"world_size": size, "rank": rank, "learners": collectives}, f, indent=2)
    if rank == 0:
        save_file(result, out)
        print(f"wrote {len(result)} tensors from {size} process(es) to {out}", flush=True)
    finish_rank(0)  # under torchrun every rank ends here; a single process returns


def compare(a: str, b: str, atol: float) -> float:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    if set(x) != set(y):
        raise SystemExit("the two files hold different tensors")
    diff = max(float((x[k] - y[k]).abs().max()) for k in x)
    moved = max(float(x[k].abs().max()) for k in x)
    print(f"max |difference| {diff:.3g} over {len(x)} tensors (largest value {moved:.3g})")
    return diff


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncrl.coordinator.learner.ddp_check",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", help="safetensors file for the resulting adapter (rank 0 writes it)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--groups-per-step", type=int, default=5)
    p.add_argument("--loss-types", default="grpo,dapo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-batch-tokens", type=int, default=8192,
                   help="small values split each rank's slice into several micro-batches (no_sync path)")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (adds the reference pass)")
    p.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp", help="under torchrun: DDP or FSDP2")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="base weights")
    p.add_argument("--device", default="cpu", help="cpu (gloo), cuda (cuda:LOCAL_RANK, nccl) or auto")
    p.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout (init_process_group)")
    p.add_argument("--idle-s", type=float, default=0.0, help="rank 0 waits this long before its first step")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --out files instead")
    # Gradients agree to ~1e-7 relative; AdamW then divides by sqrt(v) + eps, so a coordinate whose
    # gradient is ~1e-9 moves by about +-lr either way: a few such coordinates differ by up to ~lr/30.
    p.add_argument("--atol", type=float, default=1e-3)
    args = p.parse_args(argv)
    if args.compare:
        return 0 if compare(*args.compare, atol=args.atol) <= args.atol else 1
    if not args.out:
        p.error("--out is required")
    run(args.out, steps=args.steps, groups_per_step=args.groups_per_step,
        loss_types=[t for t in args.loss_types.split(",") if t], seed=args.seed,
        micro_batch_tokens=args.micro_batch_tokens, beta=args.beta, parallel=args.parallel, dtype=args.dtype,
        device=args.device, timeout_s=args.timeout_s, idle_s=args.idle_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
