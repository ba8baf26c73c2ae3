"""Data-parallel learner: torch.distributed DDP over the LoRA parameters (gloo on CPU, nccl on GPU).

Owned here: `DistributedLearner` (a `Learner` whose forward goes through `DistributedDataParallel`),
the group broadcast from rank 0, the follower loop of ranks > 0, and `make_learner` (plain `Learner`
unless launched by torchrun / accelerate with WORLD_SIZE > 1). Only rank 0 runs the network side
(coordinator/service.py); the other ranks only train.

One step, on every rank:
  1. rank 0 broadcasts the step's groups and its version counter (msgpack bytes in a uint8 tensor —
     torch.distributed's object collectives pickle, so they are not used);
  2. every rank drops the same stale groups, computes the same advantages and the same *global* step
     normaliser (coordinator/loss.py `StepNormaliser`, over all ranks' rows: every rank sees every group),
     and trains the rows of the groups `fresh[rank::world]` (whole groups) in micro-batches;
  3. each micro-batch's loss is already divided by the global normaliser, so the gradient all-reduce is a
     plain *sum* (a DDP comm hook; DDP's default averaging would divide by the world size), issued once per
     step: every micro-batch but the last runs under `no_sync()`. The summed gradient is exactly the
     1-process gradient of the same batch, whatever the slice sizes;
  4. loss statistics are summed (SUM / MAX / MIN all-reduces of `LossTotals`), then identical clipping,
     AdamW and scheduler steps everywhere, so the adapters stay identical (rank 0 publishes).
A rank whose slice is empty still runs forward/backward on one group with its loss times 0 (DDP needs every
rank in every all-reduce), and every rank runs as many micro-batches as the busiest one (extras count 0), so
the wrappers' collectives always pair up. The train-time generation audit is off under DDP (one slice).
End of a run: rank 0 releases the followers (`close()`: the STOP header, a barrier, `destroy_process_group`,
then it writes its summary); each follower and each `ddp_check` rank ends with `finish_rank()` (the same
barrier, then `os._exit`, no teardown: gloo's teardown can hang, see `finish_rank`).
Devices: `--device cuda` (or auto with a GPU) means cuda:LOCAL_RANK on each rank, with NCCL; CPU ranks use gloo.

    torchrun --standalone --nproc-per-node 2 -m asyncrl.coordinator.cli run --model tiny ...
    accelerate launch --multi_gpu --num_processes 2 -m asyncrl.coordinator.cli run ...    (GPU nodes)
    torchrun --standalone --nproc-per-node 2 -m asyncrl.coordinator.ddp_check --out /tmp/ddp.safetensors
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext

import msgspec
import torch
import torch.distributed as dist

from .learner import Learner, LossTotals, Row, TrainGroup, encode_hook

STOP = -1  # header length that tells followers to leave their loop


def world() -> tuple[int, int]:
    """(rank, world size) from torchrun / accelerate's environment; (0, 1) when not launched by one."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


LEAVE_TIMEOUT_S = 120  # a rank missing at the end this long is reported, not waited for


def _barrier_at_end() -> None:
    """Every rank, at the end: wait for the others, so no rank tears down while another still has a collective
    in flight. On gloo a monitored barrier, so a rank that never arrives is named in an error instead of
    hanging the others."""
    if dist.get_backend() == "gloo":
        from datetime import timedelta

        dist.monitored_barrier(timeout=timedelta(seconds=LEAVE_TIMEOUT_S))
    else:
        dist.barrier()


def leave_process_group() -> None:
    """A rank whose process goes on (rank 0 of a coordinator, which then writes its summary): wait for the
    others, then tear the process group down in order.

    Exiting with gloo's threads still running aborts the process at exit ("terminate called without an
    active exception", SIGABRT) after the work is done, which torchrun reports as a failed run.
    """
    if dist.is_available() and dist.is_initialized():
        _barrier_at_end()
        dist.destroy_process_group()


def finish_rank(code: int = 0) -> None:
    """A rank whose process ends here (a follower, each `ddp_check` rank): wait for the others, then end the
    process with `code` without tearing the group down. Returns only when no process group is joined.

    `destroy_process_group` on gloo can hang after the work is done (pytorch/pytorch#75097). A process
    that ends has nothing to tear down: `os._exit` closes its sockets (the others are past the barrier) and
    skips the C++ destructors that abort with gloo's threads alive. Output is flushed first.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    _barrier_at_end()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _sum_hook(state, bucket):
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _join_process_group(learner) -> bool:
    """Pin this rank's GPU, join the process group (nccl on CUDA, gloo on CPU); True on CUDA."""
    cuda = str(learner.device).startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(learner.device))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    learner.rank, learner.world = dist.get_rank(), dist.get_world_size()
    return cuda


class DistributedLearner(Learner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cuda = _join_process_group(self)
        from torch.nn.parallel import DistributedDataParallel

        # broadcast_buffers=False: the only buffers (rotary tables) are identical everywhere; a broadcast per
        # micro-batch forward would only cost time.
        self.ddp = DistributedDataParallel(self.scorer, device_ids=[torch.device(self.device).index] if cuda else None,
                                           broadcast_buffers=False)
        self.ddp.register_comm_hook(None, _sum_hook)

    # The generation audit would see only this rank's slice (and could leave a rank out of an all-reduce).
    audit_hook = property(lambda self: None, lambda self, value: None)

    # ---- group broadcast (rank 0 -> all) ------------------------------------------------------
    def _broadcast(self, groups: list[TrainGroup] | None) -> list[TrainGroup] | None:
        header = torch.zeros(2, dtype=torch.int64)
        payload = b""
        if self.rank == 0:
            payload = msgspec.msgpack.encode(groups, enc_hook=encode_hook) if groups is not None else b""
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
        """Rank 0: release the followers (they return from `follow()` and end with `finish_rank`)."""
        if self.rank == 0 and dist.is_initialized():
            self._broadcast(None)
            leave_process_group()  # its barrier pairs with the followers' finish_rank()

    def follow(self) -> int:
        """Ranks > 0: train whatever rank 0 broadcasts until it closes. Returns the steps taken; the caller
        then ends the rank with `finish_rank()` (its barrier pairs with rank 0's close())."""
        while True:
            groups = self._broadcast(None)
            if groups is None:
                return self.steps
            self._step_local(groups)

    # ---- one step ----------------------------------------------------------------------------
    def step(self, groups: list[TrainGroup]):
        return self._step_local(self._broadcast(groups))

    def _step_local(self, groups: list[TrainGroup]):
        result = super().step(groups)  # the same stale groups on every rank: None everywhere or nowhere
        return result

    # ---- Learner seams -------------------------------------------------------------------------------
    def _local_rows(self, rows: list[Row]) -> tuple[list[Row], float]:
        mine = [r for r in rows if r.group % self.world == self.rank]
        if not mine:  # take part in the all-reduce, contribute nothing
            return [r for r in rows if r.group == 0], 0.0
        return mine, 1.0

    def _sync(self, last: bool):
        return nullcontext() if last else self.ddp.no_sync()

    def _micro_batch_count(self, n: int) -> int:
        """The most micro-batches any rank needs: every rank makes the same sequence of forward/backward
        calls, so whatever the wrapper does collectively in them (FSDP's all-gathers, DDP's bucket rebuild
        after the first step) pairs up. Extra micro-batches repeat the last one with loss x 0."""
        t = torch.tensor([n], dtype=torch.int64, device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _forward(self, batch):
        return self.ddp(batch)  # through the DDP wrapper, so the last backward all-reduces the gradients

    def _reduce(self, totals: LossTotals) -> LossTotals:
        sums, hi, lo = (t.to(self._comm_device) for t in totals.as_tensors())
        dist.all_reduce(sums)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        totals.load_tensors(sums.cpu(), hi.cpu(), lo.cpu())
        return totals

    def _reduce_count(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=self._comm_device)
        dist.all_reduce(t)
        return int(t.item())

    @property
    def _comm_device(self):
        return torch.device(self.device) if str(self.device).startswith("cuda") else torch.device("cpu")


class ShardedLearner(DistributedLearner):
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) for base models that do not fit one GPU: every decoder
    layer and the scorer root are sharded over the ranks, so each holds 1/world of the frozen base weights
    (all-gathered layer by layer in forward and again in backward). The LoRA parameters are FSDP's
    `ignored_params`: replicated plain tensors on every rank, so optimizer, export, checkpoints and
    publishing are unchanged; their gradients are summed with one all-reduce per step (`_finish_gradients`).
    Every rank runs the same number of micro-batches (as under DDP; here each forward is a sequence of
    all-gathers). The base model is loaded on the host and sharded onto the
    device. Under FSDP the ingest-time audit is off too (its shadow forward would need every rank)."""

    sharded = True

    def __init__(self, *args, **kwargs):
        Learner.__init__(self, *args, **kwargs)  # not DistributedLearner's: no DDP wrapper

    def _load_device(self) -> str:
        return "cpu"

    def _prepare_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        cuda = _join_process_group(self)
        mesh = init_device_mesh("cuda" if cuda else "cpu", (self.world,))
        lora = {p for p in self.model.parameters() if p.requires_grad}
        for layer in self.model.get_base_model().get_decoder().layers:
            fully_shard(layer, mesh=mesh, ignored_params=lora)
        fully_shard(self.scorer, mesh=mesh, ignored_params=lora)
        for p in lora:
            p.data = p.data.to(self.device)
        self.ddp = self.scorer  # the sharded module: every forward goes through it

    def _sync(self, last: bool):
        return nullcontext()

    def _finish_gradients(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # a sum: each rank's loss is already divided by the global normaliser
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g)
            offset += g.numel()


def local_device(device: str) -> str:
    """This rank's device under torchrun: cuda (and auto with a GPU) become cuda:LOCAL_RANK."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return device


def make_learner(*args, parallel: str = "ddp", **kwargs) -> Learner:
    """A plain Learner, or under torchrun (WORLD_SIZE > 1) a DistributedLearner (parallel="ddp") or a
    ShardedLearner ("fsdp"); device "cuda" (or auto with a GPU) then means this rank's GPU, cuda:LOCAL_RANK."""
    if world()[1] == 1:
        return Learner(*args, **kwargs)
    kwargs["device"] = local_device(str(kwargs.get("device", "cpu")))
    if parallel == "fsdp":
        return ShardedLearner(*args, **kwargs)
    if parallel != "ddp":
        raise ValueError(f"parallel must be ddp or fsdp, not {parallel!r}")
    return DistributedLearner(*args, **kwargs)


def run_follower(cfg, out=print) -> int:
    """Entry for ranks > 0 under torchrun: no network, no files; train what rank 0 broadcasts."""
    import time
    from pathlib import Path

    from asyncrl.models import tinymodel
    from asyncrl.protocol.messages import LoraSpec

    from .base_model import resolve_model

    if cfg.model in ("tiny", tinymodel.TINY_MODEL_NAME):  # rank 0 writes the tiny model; do not race it
        marker = Path(tinymodel.default_tiny_model_dir()) / tinymodel.MARKER
        deadline = time.time() + 600
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.5)
    path = resolve_model(cfg, out=out).path
    lora = LoraSpec(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, target_modules=tuple(cfg.lora_targets))
    learner = make_learner(path, lora, **cfg.learner_kwargs())  # the same options as rank 0 (service.py)
    if cfg.resume:
        from .checkpoint import Checkpointer, CheckpointError, restore_learner

        ckpt = Checkpointer(Path(cfg.run_dir) / "checkpoints", out=out).latest()
        if ckpt is None:
            raise CheckpointError(f"--resume: no checkpoint in {cfg.run_dir}/checkpoints")
        restore_learner(ckpt, learner)
    out(f"rank {learner.rank}/{learner.world}: following rank 0")
    steps = learner.follow()
    out(f"rank {learner.rank}: done after {steps} steps")
    finish_rank(0)
    return 0
