"""Data-parallel learner: torch.distributed DDP over the LoRA parameters (gloo on CPU, nccl on GPU).

Owned here: `DistributedLearner` (a `Learner` whose forward goes through `DistributedDataParallel`),
the group broadcast from rank 0, the follower loop of ranks > 0, and `make_learner` (plain `Learner`
unless launched by torchrun / accelerate with WORLD_SIZE > 1). Only rank 0 runs the network side
(coordinator/service.py); the other ranks only train.

One step, on every rank:
  1. rank 0 broadcasts the step's groups and its version counter (msgpack bytes in a uint8 tensor —
     torch.distributed's object collectives pickle, so they are not used);
  2. every rank drops the same stale groups and takes the slice `fresh[rank::world]` (whole groups, so
     group-relative advantages are unchanged);
  3. forward + backward through DDP. The gradient all-reduce is a *weighted sum* (a DDP comm hook), each
     rank's weight being its share of the global normaliser — sequences for `grpo` / `dr_grpo`, completion
     tokens for `dapo` — so the summed gradient is exactly the 1-process gradient of the same batch,
     whatever the slice sizes (DDP's default averaging would be exact only for equal slices);
  4. identical clipping and AdamW step everywhere, so the adapters stay identical (rank 0 publishes).
A rank whose slice is empty still runs forward/backward on one group with weight 0 (DDP needs every
rank in every all-reduce). The train-time generation audit is off under DDP (it would see one slice).

    torchrun --standalone --nproc-per-node 2 -m asyncrl.coordinator.cli run --model tiny ...
    accelerate launch --multi_gpu --num_processes 2 -m asyncrl.coordinator.cli run ...    (GPU nodes)
    torchrun --standalone --nproc-per-node 2 -m asyncrl.coordinator.ddp_check --out /tmp/ddp.safetensors
"""

from __future__ import annotations

import os

import msgspec
import torch
import torch.distributed as dist

from .learner import Learner, TrainGroup

STOP = -1  # header length that tells followers to leave their loop


def world() -> tuple[int, int]:
    """(rank, world size) from torchrun / accelerate's environment; (0, 1) when not launched by one."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _weighted_sum_hook(learner: "DistributedLearner", bucket):
    buf = bucket.buffer()
    buf.mul_(learner.grad_weight)
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class DistributedLearner(Learner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cuda = str(self.device).startswith("cuda")
        if cuda:
            torch.cuda.set_device(torch.device(self.device))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = DistributedDataParallel(self.model, device_ids=[torch.device(self.device).index] if cuda else None)
        self.grad_weight = 1.0
        self.ddp.register_comm_hook(self, _weighted_sum_hook)

    # The generation audit would see only this rank's slice (and could leave a rank out of an all-reduce).
    audit_hook = property(lambda self: None, lambda self, value: None)

    # ---- group broadcast (rank 0 -> all) ------------------------------------------------------
    def _broadcast(self, groups: list[TrainGroup] | None) -> list[TrainGroup] | None:
        header = torch.zeros(2, dtype=torch.int64)
        payload = b""
        if self.rank == 0:
            payload = msgspec.msgpack.encode(groups) if groups is not None else b""
            header[0] = len(payload) if groups is not None else STOP
            header[1] = self.version
        dist.broadcast(header, src=0)
        if int(header[0]) == STOP:
            return None
        self.version = int(header[1])
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(header[0]), dtype=torch.uint8)
        dist.broadcast(buf, src=0)
        if self.rank == 0:
            return groups
        return msgspec.msgpack.decode(buf.numpy().tobytes(), type=list[TrainGroup])

    def close(self) -> None:
        """Rank 0: release the followers (they return from `follow()`)."""
        if self.rank == 0 and dist.is_initialized():
            self._broadcast(None)

    def follow(self) -> int:
        """Ranks > 0: train whatever rank 0 broadcasts until it closes. Returns the steps taken."""
        while True:
            groups = self._broadcast(None)
            if groups is None:
                return self.steps
            self._step_local(groups)

    # ---- one step ----------------------------------------------------------------------------
    def step(self, groups: list[TrainGroup]):
        return self._step_local(self._broadcast(groups))

    def _step_local(self, groups: list[TrainGroup]):
        fresh = [g for g in groups if not self.is_stale(g.version)]
        if not fresh:
            return None  # the same on every rank: no collective is entered
        mine = fresh[self.rank::self.world]
        loss_type = self.loss_cfg.loss_type
        size = (lambda gs: sum(len(c) for g in gs for c in g.completions)) if loss_type == "dapo" else \
            (lambda gs: sum(len(g.completions) for g in gs))
        self.grad_weight = size(mine) / max(1, size(fresh))
        if not mine:
            mine = fresh[:1]  # take part in the all-reduce, contribute nothing
        result = super().step(mine)
        if result is not None:
            result.groups_used = len(fresh)
            result.groups_dropped_stale = len(groups) - len(fresh)
        return result

    def _completion_logprobs(self, batch):
        # Learner's forward, but through the DDP wrapper so the backward all-reduces the gradients.
        inner, self.model = self.model, self.ddp
        try:
            return super()._completion_logprobs(batch)
        finally:
            self.model = inner


def make_learner(*args, **kwargs) -> Learner:
    """A plain Learner, or a DistributedLearner when launched with WORLD_SIZE > 1 (device "cuda" then
    means this rank's GPU, cuda:LOCAL_RANK)."""
    if world()[1] == 1:
        return Learner(*args, **kwargs)
    if str(kwargs.get("device", "cpu")) == "cuda":
        kwargs["device"] = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return DistributedLearner(*args, **kwargs)


def run_follower(cfg, out=print) -> int:
    """Entry for ranks > 0 under torchrun: no network, no files; train what rank 0 broadcasts."""
    import time
    from pathlib import Path

    from asyncrl.models import tinymodel
    from asyncrl.protocol.messages import LoraSpec

    from .service import resolve_model

    if cfg.model in ("tiny", tinymodel.TINY_MODEL_NAME):  # rank 0 writes the tiny model; do not race it
        marker = Path(tinymodel.default_tiny_model_dir()) / tinymodel.MARKER
        deadline = time.time() + 600
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.5)
    path, _, _ = resolve_model(cfg.model)
    lora = LoraSpec(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, target_modules=tuple(cfg.lora_targets))
    learner = DistributedLearner(path, lora, lr=cfg.lr, loss=cfg.loss, max_staleness=cfg.max_staleness, seed=cfg.seed)
    if cfg.resume:
        from .checkpoint import Checkpointer, CheckpointError, restore_learner

        ckpt = Checkpointer(Path(cfg.run_dir) / "checkpoints", out=out).latest()
        if ckpt is None:
            raise CheckpointError(f"--resume: no checkpoint in {cfg.run_dir}/checkpoints")
        restore_learner(ckpt, learner)
    out(f"rank {learner.rank}/{learner.world}: following rank 0")
    steps = learner.follow()
    out(f"rank {learner.rank}: done after {steps} steps")
    return 0
