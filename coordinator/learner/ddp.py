"""Data-parallel learner: torch.distributed DDP over the LoRA parameters (gloo on CPU, nccl on GPU).

Owned here: `DistributedLearner` (a `Learner` whose forward goes through `DistributedDataParallel`),
the group broadcast from rank 0, the follower loop of ranks > 0, and `make_learner` (plain `Learner`
unless launched by torchrun / accelerate with WORLD_SIZE > 1). Only rank 0 runs the network side
(coordinator/service.py); the other ranks only train.

One step, on every rank:
  1. rank 0 broadcasts the step's groups and its version counter (msgpack bytes in a uint8 tensor —
     torch.distributed's object collectives pickle, so they are not used);
  2. every rank drops the same stale groups, computes the same advantages and the same *global* step
     normaliser (coordinator/learner/loss.py `StepNormaliser`, over all ranks' rows: every rank sees every group),
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

Devices: `--device cuda` (or auto with a GPU) means cuda:LOCAL_RANK on each rank, with NCCL; CPU ranks use gloo.
Every collective this module issues goes through `Collectives`, on a tensor on the learner's device (NCCL
takes no CPU tensors), and records that device (ddp_check reports them; tests/coordinator/learner/test_ddp.py checks).
Waiting: collectives time out after COLLECTIVE_TIMEOUT_S (`init_process_group(timeout=)`), so a dead rank is
an error, not a hang. Between steps rank 0 may wait for rollouts far longer (start-up calibration, an empty
swarm), so its `Heartbeat` thread broadcasts a HEARTBEAT header every HEARTBEAT_S while no step is running;
followers answer it by waiting again. A step and a heartbeat never interleave (one lock).

End of a run: rank 0 releases the followers (`close()`: heartbeat stopped, the STOP header, the end barrier)
and goes on to write its summary; every process that joined a group then ends with `os._exit` after
flushing — followers and `ddp_check` ranks through `finish_rank()` (the same barrier, then exit), rank 0
through `end_process()` once its summary is written. No process tears a group down or runs the interpreter's
normal exit with gloo's threads alive: gloo's `destroy_process_group` can hang (pytorch/pytorch#75097), and a
normal exit can abort in C++ destructors ("terminate called without an active exception", SIGABRT).

    torchrun --standalone --nproc-per-node 2 -m asyncrl.coordinator.cli run --model tiny ...
    accelerate launch --multi_gpu --num_processes 2 -m asyncrl.coordinator.cli run ...    (GPU nodes)
    torchrun --standalone --nproc-per-node 2 -m asyncrl.coordinator.learner.ddp_check --out /tmp/ddp.safetensors
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import nullcontext
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from .learner import Learner, LossTotals, Row, TrainGroup, encode_hook

STOP = -1       # header length that tells followers to leave their loop
HEARTBEAT = -2  # header length that tells followers rank 0 is alive and still waiting for rollouts
COLLECTIVE_TIMEOUT_S = 600  # a collective that waits this long fails (a rank died or hangs)
HEARTBEAT_S = 30            # rank 0's heartbeat period while no step runs (well under the timeout)


def world() -> tuple[int, int]:
    """(rank, world size) from torchrun / accelerate's environment; (0, 1) when not launched by one."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


LEAVE_TIMEOUT_S = 120  # a rank missing at the end this long is reported, not waited for


def _barrier_at_end() -> None:
    """Every rank, at the end: wait for the others, so no rank exits while another still has a collective
    in flight. On gloo a monitored barrier, so a rank that never arrives is named in an error instead of
    hanging the others."""
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=LEAVE_TIMEOUT_S))
    else:
        dist.barrier()


def joined() -> bool:
    """Whether this process joined a process group (it must then end through `end_process`)."""
    return dist.is_available() and dist.is_initialized()


def end_process(code: int = 0) -> None:
    """A process that joined a process group ends here: output flushed, then `os._exit(code)` — no group
    teardown, no interpreter exit (see the module docstring). Returns only when no process group is joined."""
    if not joined():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def finish_rank(code: int = 0) -> None:
    """A rank whose work is done (a follower, each `ddp_check` rank): the end barrier (it pairs with rank 0's
    `close()`), then `end_process(code)`. Returns only when no process group is joined."""
    if not joined():
        return
    stop_heartbeat()
    _barrier_at_end()
    end_process(code)


class Collectives:
    """The one way this module talks to the other ranks: each call checks that its tensor sits on the learner's
    device (NCCL has no CPU tensors; a CPU tensor under gloo on a GPU learner would be a silent copy) and
    records (operation, device), which ddp_check reports."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.seen: dict[tuple[str, str], int] = {}

    def _check(self, op: str, t: torch.Tensor) -> None:
        if t.device != self.device:
            raise RuntimeError(f"{op} on a {t.device} tensor; this rank's collectives run on {self.device}")
        key = (op, str(t.device))
        self.seen[key] = self.seen.get(key, 0) + 1

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        self._check("broadcast", t)
        dist.broadcast(t, src=src)

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        self._check("all_reduce", t)
        return dist.all_reduce(t, op=op, async_op=async_op)

    def tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def report(self) -> dict:
        return {"device": str(self.device), "calls": {f"{op}@{dev}": n for (op, dev), n in sorted(self.seen.items())}}


def _sum_hook(comm: Collectives, bucket):
    fut = comm.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _join_process_group(learner) -> bool:
    """Pin this rank's GPU, join the process group (nccl on CUDA, gloo on CPU) with the collective timeout, and
    give the learner its `Collectives` on its own device; True on CUDA."""
    cuda = str(learner.device).startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(learner.device))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=learner.collective_timeout_s))
    learner.rank, learner.world = dist.get_rank(), dist.get_world_size()
    learner.comm = Collectives(torch.device(learner.device))
    return cuda


class Heartbeat:
    """Rank 0, between steps: a HEARTBEAT header every `period_s`, so followers waiting for the next step's
    header never reach the collective timeout. `lock` is held by every step; a beat never runs inside one.
    One per process (a process may build several learners on its one group, as ddp_check does)."""

    def __init__(self, comm: Collectives, lock: threading.Lock, period_s: float):
        self.lock, self.period_s = lock, period_s
        self.send = lambda: comm.broadcast(comm.tensor([HEARTBEAT, 0], torch.int64), src=0)
        self.stopped = threading.Event()
        self.beats = 0
        self.thread = threading.Thread(target=self._run, name="ddp-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.period_s):
            with self.lock:
                if self.stopped.is_set():
                    return
                self.send()
                self.beats += 1

    def stop(self) -> None:
        with self.lock:  # a beat in flight finishes first; none starts after
            self.stopped.set()
        self.thread.join()


_STEP_LOCK = threading.Lock()  # held by every step on rank 0 and by every heartbeat
_heartbeat: Heartbeat | None = None


def start_heartbeat(comm: Collectives, period_s: float) -> None:
    """Rank 0 (no-op elsewhere). Only while every follower waits in `_broadcast` for the next header — a
    coordinator's followers always do (`follow()`); ranks that build learners in lockstep (ddp_check) do only
    until their first step."""
    global _heartbeat
    if _heartbeat is None and dist.get_rank() == 0:
        _heartbeat = Heartbeat(comm, _STEP_LOCK, period_s)


def stop_heartbeat() -> None:
    """Before the end barrier (no header may follow it), or before ranks leave their wait for a header."""
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


class DistributedLearner(Learner):
    def __init__(self, *args, collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, heartbeat_s: float | None = None,
                 **kwargs):
        self.collective_timeout_s = collective_timeout_s
        super().__init__(*args, **kwargs)
        cuda = _join_process_group(self)
        from torch.nn.parallel import DistributedDataParallel

        # broadcast_buffers=False: the only buffers (rotary tables) are identical everywhere; a broadcast per
        # micro-batch forward would only cost time.
        self.ddp = DistributedDataParallel(self.scorer, device_ids=[torch.device(self.device).index] if cuda else None,
                                           broadcast_buffers=False)
        self.ddp.register_comm_hook(self.comm, _sum_hook)
        if heartbeat_s:
            start_heartbeat(self.comm, heartbeat_s)

    # The generation audit would see only this rank's slice (and could leave a rank out of an all-reduce).
    audit_hook = property(lambda self: None, lambda self, value: None)

    # ---- group broadcast (rank 0 -> all) ------------------------------------------------------
    def _send_header(self, length: int) -> None:
        """Rank 0: a bare header (STOP or HEARTBEAT)."""
        self.comm.broadcast(self.comm.tensor([length, self.version], torch.int64), src=0)

    def _broadcast(self, groups: list[TrainGroup] | None) -> list[TrainGroup] | None:
        """Rank 0 sends `groups` (None: STOP); a follower receives the next step's groups (None after STOP),
        waiting through heartbeats. Header and payload travel as tensors on the learner's device."""
        if self.rank == 0:
            if groups is None:
                self._send_header(STOP)
                return None
            payload = msgspec.msgpack.encode(groups, enc_hook=encode_hook)
            self._send_header(len(payload))
            self.comm.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.comm.device), src=0)
            return groups
        while True:
            header = self.comm.tensor([0, 0], torch.int64)
            self.comm.broadcast(header, src=0)
            length, version = header.tolist()
            if length != HEARTBEAT:
                break
        if length == STOP:
            return None
        self.version = version
        buf = torch.empty(length, dtype=torch.uint8, device=self.comm.device)
        self.comm.broadcast(buf, src=0)
        return msgspec.msgpack.decode(buf.cpu().numpy().tobytes(), type=list[TrainGroup])

    def close(self) -> None:
        """Rank 0: stop the heartbeat and release the followers (they return from `follow()` and end with
        `finish_rank`, whose barrier pairs with the one here). The group stays joined: rank 0 writes its
        summary, then ends with `end_process()`."""
        if self.rank == 0 and dist.is_initialized() and not getattr(self, "_closed", False):
            self._closed = True
            stop_heartbeat()
            self._broadcast(None)
            _barrier_at_end()

    def follow(self) -> int:
        """Ranks > 0: train whatever rank 0 broadcasts until it closes. Returns the steps taken; the caller
        then ends the rank with `finish_rank()` (its barrier pairs with rank 0's close())."""
        while True:
            groups = self._broadcast(None)
            if groups is None:
                return self.steps
            self._step_local(groups)

    def collectives(self) -> dict:
        """What this rank sent through `Collectives`: its device and the calls by operation and tensor device."""
        return self.comm.report()

    # ---- one step ----------------------------------------------------------------------------
    def step(self, groups: list[TrainGroup]):
        with _STEP_LOCK:  # no heartbeat inside a step's collectives
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
        t = self.comm.tensor([n], torch.int64)
        self.comm.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _forward(self, batch):
        return self.ddp(batch)  # through the DDP wrapper, so the last backward all-reduces the gradients

    def _reduce(self, totals: LossTotals) -> LossTotals:
        sums, hi, lo = (t.to(self.comm.device) for t in totals.as_tensors())
        self.comm.all_reduce(sums)
        self.comm.all_reduce(hi, op=dist.ReduceOp.MAX)
        self.comm.all_reduce(lo, op=dist.ReduceOp.MIN)
        totals.load_tensors(sums, hi, lo)
        return totals

    def _reduce_count(self, n: int) -> int:
        t = self.comm.tensor([n], torch.int64)
        self.comm.all_reduce(t)
        return int(t.item())


class ShardedLearner(DistributedLearner):
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) for base models that do not fit one GPU: every decoder
    layer and the scorer root are sharded over the ranks, so each holds 1/world of the frozen base weights
    (all-gathered layer by layer in forward and again in backward). The LoRA parameters are FSDP's
    `ignored_params`: replicated plain tensors on every rank, so optimizer, export, checkpoints and
    publishing are unchanged; their gradients are summed with one all-reduce per step (`_finish_gradients`).
    Every rank runs the same number of micro-batches (as under DDP; here each forward is a sequence of
    all-gathers). Only rank 0 reads the base (one host copy); the other ranks build it on the meta device,
    and after sharding every rank's shards come from rank 0's copy tensor by tensor
    (`set_model_state_dict(broadcast_from_rank0=True)`), so host RAM holds one base, not one per rank. Under FSDP the ingest-time audit is off too (its shadow forward would need every rank)."""

    sharded = True

    def __init__(self, *args, collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, heartbeat_s: float | None = None,
                 **kwargs):
        self.collective_timeout_s = collective_timeout_s
        Learner.__init__(self, *args, **kwargs)  # not DistributedLearner's: no DDP wrapper
        if heartbeat_s:
            start_heartbeat(self.comm, heartbeat_s)

    def _load_device(self) -> str:
        return "cpu" if world()[0] == 0 else "meta"  # one host copy of the base, on rank 0 only

    def _prepare_model(self) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        cuda = _join_process_group(self)
        mesh = init_device_mesh("cuda" if cuda else "cpu", (self.world,))
        full = self.model.state_dict() if self.rank == 0 else {}  # rank 0's weights and LoRA init, on the host
        lora = {p for p in self.model.parameters() if p.requires_grad}
        for layer in self.model.get_base_model().get_decoder().layers:
            fully_shard(layer, mesh=mesh, ignored_params=lora)
        fully_shard(self.scorer, mesh=mesh, ignored_params=lora)
        if self.rank == 0:
            for p in lora:  # fully_shard leaves ignored parameters where they are
                p.data = p.data.to(self.device)
        else:
            self.model.to_empty(device=self.device)  # this rank's shards and the LoRA tensors, uninitialised
        # Every rank's shards (and the replicated LoRA init) from rank 0's host copy, tensor by tensor.
        set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
        for module in self.model.modules():  # buffers outside the state dict (rotary tables): rank 0's
            for buf in module.buffers(recurse=False):
                self.comm.broadcast(buf, src=0)
            if hasattr(module, "original_inv_freq") and hasattr(module, "inv_freq"):
                module.original_inv_freq = module.inv_freq.clone()
        self.ddp = self.scorer  # the sharded module: every forward goes through it

    def _sync(self, last: bool):
        return nullcontext()

    def _finish_gradients(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.comm.all_reduce(flat)  # a sum: each rank's loss is already divided by the global normaliser
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g)
            offset += g.numel()


def local_device(device: str) -> str:
    """This rank's device under torchrun: cuda (and auto with a GPU) become cuda:LOCAL_RANK."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return device


def make_learner(*args, parallel: str = "ddp", heartbeat_s: float | None = HEARTBEAT_S,
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, **kwargs) -> Learner:
    """A plain Learner, or under torchrun (WORLD_SIZE > 1) a DistributedLearner (parallel="ddp") or a
    ShardedLearner ("fsdp"); device "cuda" (or auto with a GPU) then means this rank's GPU, cuda:LOCAL_RANK.
    `heartbeat_s`: rank 0's heartbeat period (None: none; see `start_heartbeat` for when it is safe)."""
    if world()[1] == 1:
        return Learner(*args, **kwargs)
    kwargs.update(heartbeat_s=heartbeat_s, collective_timeout_s=collective_timeout_s)
    kwargs["device"] = local_device(str(kwargs.get("device", "cpu")))
    if parallel == "fsdp":
        return ShardedLearner(*args, **kwargs)
    if parallel != "ddp":
        raise ValueError(f"parallel must be ddp or fsdp, not {parallel!r}")
    return DistributedLearner(*args, **kwargs)
