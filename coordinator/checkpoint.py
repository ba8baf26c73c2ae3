"""Checkpoints: the coordinator's whole training state, atomically on disk, and `--resume` from it.

Owned here: the on-disk format, atomic writing and retention, and capturing/restoring the state of
the components the hub hands in (this module never imports the hub). A checkpoint is a directory

    <run_dir>/checkpoints/step-00000120-<ns>/
        meta.json              step, version, base model + LoRA spec (checked on resume), optimizer
                               param groups, scheduler, python/numpy RNG, task board (leases, requeue,
                               prompt-source position, counters), client stats, counters
        adapter.safetensors    trainable LoRA parameters, fp32, by PEFT name
        adapter/               the same adapter as a standard PEFT directory (adapter_config.json with the
                               pinned base + adapter_model.safetensors with standard names): what
                               `PeftModel.from_pretrained` and vLLM's LoRARequest load (coordinator/operator/export.py)
        optimizer.safetensors  AdamW state tensors ("state.<param index>.<key>")
        rng.safetensors        torch (and CUDA) RNG states
        seen_ids.bin           the ids of the batches in the ingest journal at snapshot time (32 bytes each)
        pending_ids.bin        accepted but not yet trained at snapshot time (re-queued from the journal)
        replay_guard.msgpack   protocol.envelope.ReplayGuard state (nonces stay single-use)

written into `.tmp-...` and renamed into place (a crash leaves a whole checkpoint or none); the last
`keep` (2) are retained. No pickle anywhere: safetensors + JSON + msgpack. The end of a run also copies
the final checkpoint's `adapter/` to `<run_dir>/adapter/`.

Consistency: the snapshot is taken with the `Gate` closed, i.e. with no lease or submit handler in
flight, so board, seen ids, journal and learner queue describe the same instant.

Version lineage: `record_published` writes `<run_dir>/lineage.json` *before* each version reaches the
DHT, so after a crash the coordinator knows the highest version any volunteer may hold even if it was
published after the last checkpoint. A resumed run publishes `max(checkpoint, lineage) + 1` first,
as a keyframe (the codec's delta state is not carried over), so versions strictly increase and every
volunteer can decode it.

Exactly-once across a crash (with coordinator/ingest/journal.py): journalled batches trained as of the
checkpoint are `seen_ids` minus `pending_ids` and are not replayed; batches acked after it are re-queued
from the journal and their leases settled on the restored board; a batch whose lease was granted after
the checkpoint and never accepted gets UNKNOWN_LEASE (its prompt is handed out again). Every accepted id
(DUPLICATE_BATCH after resume) is in `<run_dir>/seen_ids.log`, appended incrementally by the trust-state
thread (coordinator/ingest/ingest_books.py), plus the journal's own ids — so a checkpoint never copies the
whole seen set, whatever the run's length.

Size: the on-disk format, the atomic write and the restore of each component must stay in lockstep (a
field written is a field read back), so they are read together.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from asyncrl.protocol.atomic import fsync_dir, write_durable, write_json_atomic

from .ingest.ingest import AcceptedBatch

FORMAT = 1
PREFIX = "step-"
ID_BYTES = 32


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one from a different run / model / LoRA shape."""


class Gate:
    """Many handlers at once, or one snapshot: `closed()` waits for handlers in flight and holds new ones."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False

    def run(self, fn, *args):
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._active += 1
        try:
            return fn(*args)
        finally:
            with self._cond:
                self._active -= 1
                if not self._active:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def closed(self):
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._closed = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._closed = False
                self._cond.notify_all()


# ---- small file helpers ------------------------------------------------------------------------
def record_published(run_dir: Path, version: int) -> None:
    """High-water mark of published versions (call before the pointer reaches the DHT)."""
    write_json_atomic(Path(run_dir) / "lineage.json", {"last_published_version": int(version)}, indent=1)


def last_published(run_dir: Path) -> int | None:
    path = Path(run_dir) / "lineage.json"
    return int(json.loads(path.read_text())["last_published_version"]) if path.exists() else None


def latest_meta(run_dir: Path) -> dict | None:
    """meta.json of the newest complete checkpoint in a run dir, read-only (None when there is none)."""
    for path in sorted((Path(run_dir) / "checkpoints").glob(f"{PREFIX}*"), reverse=True):
        try:
            return json.loads((path / "meta.json").read_text())
        except (OSError, ValueError):
            continue
    return None


def _ids_bytes(ids) -> bytes:
    return b"".join(sorted(ids))


def _ids_from(data: bytes) -> set[bytes]:
    if len(data) % ID_BYTES:
        raise CheckpointError("corrupt id file (length not a multiple of 32)")
    return {data[i:i + ID_BYTES] for i in range(0, len(data), ID_BYTES)}


# ---- state capture -----------------------------------------------------------------------------
def _rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    meta = {"python": [version, list(state), gauss], "numpy": [kind, keys.tolist(), pos, has_gauss, cached]}
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    return meta, tensors


def _set_rng_state(meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    version, state, gauss = meta["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda."))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _optimizer_state(optimizer) -> tuple[dict, dict[str, torch.Tensor]]:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"state.{idx}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{k}"] = v
    return {"param_groups": sd["param_groups"], "scalars": scalars}, tensors


def _load_optimizer(optimizer, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        _, idx, k = key.split(".", 2)
        state.setdefault(int(idx), {})[k] = v
    for key, v in meta["scalars"].items():
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
              for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _scheduler_state(learner):
    sched = getattr(learner, "scheduler", None)
    if sched is None:
        return None
    state = sched.state_dict()
    json.dumps(state)  # a scheduler with lambdas/objects in its state is not supported: fail loudly
    return state


@dataclass
class Checkpoint:
    path: Path
    meta: dict

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.path / f"{name}.safetensors"))

    def ids(self, name: str) -> set[bytes]:
        return _ids_from((self.path / f"{name}.bin").read_bytes())

    @property
    def trained_ids(self) -> set[bytes]:
        return self.ids("seen_ids") - self.ids("pending_ids")


class Checkpointer:
    """Writes and finds checkpoints under `root`; keeps the newest `keep`."""

    def __init__(self, root: Path, *, keep: int = 2, out=print):
        self.root = Path(root)
        self.keep = keep
        self.out = out
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):  # half-written: never a checkpoint
            shutil.rmtree(stale, ignore_errors=True)

    def _complete(self) -> list[Path]:
        return sorted(p for p in self.root.glob(f"{PREFIX}*") if (p / "meta.json").exists())

    def latest(self) -> Checkpoint | None:
        """The newest readable checkpoint (an unreadable newest one is reported and skipped)."""
        for path in reversed(self._complete()):
            try:
                meta = json.loads((path / "meta.json").read_text())
                if meta.get("format") != FORMAT:
                    raise CheckpointError(f"format {meta.get('format')} (this build reads {FORMAT})")
                return Checkpoint(path, meta)
            except (OSError, ValueError, CheckpointError) as exc:
                self.out(f"warning: skipping unreadable checkpoint {path.name}: {exc}")
        return None

    def write(self, step: int, meta: dict, tensors: dict[str, dict[str, torch.Tensor]], blobs: dict[str, bytes]) -> Path:
        from safetensors.torch import save

        tmp = self.root / f".tmp-{step:08d}-{os.getpid()}-{time.time_ns()}"
        tmp.mkdir()
        for name, group in tensors.items():
            write_durable(tmp / f"{name}.safetensors", save({k: v.contiguous() for k, v in group.items()}))
        for name, data in blobs.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)  # "adapter/adapter_config.json"
            write_durable(tmp / name, data)
        write_durable(tmp / "meta.json", json.dumps({"format": FORMAT, "step": step, **meta}).encode())
        final = self.root / f"{PREFIX}{step:08d}-{time.time_ns()}"
        for sub in {(tmp / name).parent for name in blobs} - {tmp}:
            fsync_dir(sub)
        fsync_dir(tmp)  # the files' directory entries, then the rename itself
        os.rename(tmp, final)
        fsync_dir(self.root)
        for old in self._complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final


@dataclass(frozen=True)
class AdapterExport:
    """What each checkpoint's standard PEFT directory says about its base (coordinator/operator/export.py reads it)."""

    lora: object             # protocol.messages.LoraSpec
    base_model: str          # adapter_config's base_model_name_or_path: the hub id, or the local directory
    revision: str | None     # PEFT's `revision`: the pin (hub commit, or sha256:/gguf-sha256: content hash)
    pin: dict                # models.pinning.BasePin fields: `export --merge` verifies the base against them

    @classmethod
    def of_base(cls, lora, path: str, pin) -> "AdapterExport":
        """For the base `pin` (models.pinning.BasePin) loaded from `path`: a hub model is named by its id at its
        commit; a local directory or converted GGUF by its path, with its content-hash pin as the revision, so the
        exported adapter still says exactly which base it was trained on (transformers ignores `revision` for a
        local directory, so loading is unchanged)."""
        from asyncrl.models import pinning

        hub = pinning.is_commit_sha(pin.revision)
        return cls(lora=lora, base_model=pin.name if hub else str(path), revision=pin.revision,
                   pin=asdict(pin))

    def files(self, model) -> dict[str, bytes]:
        from peft import get_peft_model_state_dict

        from asyncrl.models.lora import peft_dir_files

        state = {k: v.detach().to("cpu", torch.float32).clone() for k, v in get_peft_model_state_dict(model).items()}
        files = peft_dir_files(self.lora, self.base_model, state, revision=self.revision)
        return {f"adapter/{name}": data for name, data in files.items()}


def identity_meta(*, run_id: str, base_model: str, base_revision: str, lora) -> dict:
    return {"run_id": run_id, "base_model": base_model, "base_revision": base_revision,
            "lora": {"r": lora.r, "alpha": lora.alpha, "target_modules": sorted(lora.target_modules)}}


def save(checkpointer: Checkpointer, *, gate: Gate, learner, board, ingest, identity: dict,
         extra: dict | None = None, held=None, export: AdapterExport | None = None, journal=None) -> Path:
    """Snapshot everything (handlers held off only while copying in memory), then write it. `held()`:
    accepted batches the learner loop holds outside the ingest queue (the --sync round's)."""
    with gate.closed():
        books = ingest.snapshot()  # under the ingest lock, released before the board's is taken
        pending = untrained_ids(ingest, held)
        seen = (journal.ids() if journal is not None else set()) | pending
        board_state = board.state()
    guard = books.replay_bytes()
    adapter = {n: p.detach().to("cpu", torch.float32).clone() for n, p in learner.model.named_parameters()
               if p.requires_grad}
    opt_meta, opt_tensors = _optimizer_state(learner.optimizer)
    rng_meta, rng_tensors = _rng_state()
    meta = {**identity, "version": learner.version, "learner_steps": learner.steps, "created_at": time.time(),
            "optimizer": opt_meta, "scheduler": _scheduler_state(learner), "rng": rng_meta, "board": board_state,
            "clients": books.clients, "extra": extra or {}}
    blobs = {"seen_ids.bin": _ids_bytes(seen), "pending_ids.bin": _ids_bytes(pending), "replay_guard.msgpack": guard}
    if export is not None:
        meta["base_pin"] = export.pin
        blobs.update(export.files(learner.model))
    path = checkpointer.write(learner.steps, meta, {"adapter": adapter, "optimizer": opt_tensors, "rng": rng_tensors},
                              blobs)
    return path


def untrained_ids(ingest, held=None) -> set[bytes]:
    """Accepted batches not trained yet (a checkpoint's pending_ids: --resume re-queues them from the journal):
    those waiting for their audit (coordinator/trust/audit_worker.py), in the learner's queue, or held by the
    learner loop (`held()`, the --sync round's). Read in that order: a batch the audit worker passes on
    meanwhile is in the queue by the time the queue is read, so none falls between the two reads."""
    pending = set(ingest.awaiting_audit())
    with ingest.queue.mutex:
        pending |= {item.batch_id for item in ingest.queue.queue}
    return pending | {item.batch_id for item in (held() if held is not None else ())}


def check_identity(ckpt: Checkpoint, identity: dict) -> None:
    for key, want in identity.items():
        if ckpt.meta.get(key) != want:
            raise CheckpointError(f"{ckpt.path.name} was written with {key}={ckpt.meta.get(key)!r}; this run has "
                                  f"{key}={want!r} (resume with the same --run-id, --model and --lora-r)")


def restore_learner(ckpt: Checkpoint, learner) -> None:
    """Adapter, optimizer, scheduler, RNG, step and version counters (no network state)."""
    adapter = ckpt.tensors("adapter")
    params = {n: p for n, p in learner.model.named_parameters() if p.requires_grad}
    if set(params) != set(adapter):
        missing, extra = sorted(set(params) - set(adapter))[:3], sorted(set(adapter) - set(params))[:3]
        raise CheckpointError(f"adapter parameters differ from the model's (missing {missing}, unexpected {extra})")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(adapter[n].to(p.device, p.dtype))
    _load_optimizer(learner.optimizer, ckpt.meta["optimizer"], ckpt.tensors("optimizer"))
    if ckpt.meta.get("scheduler") is not None and getattr(learner, "scheduler", None) is not None:
        learner.scheduler.load_state_dict(ckpt.meta["scheduler"])
    _set_rng_state(ckpt.meta["rng"], ckpt.tensors("rng"))
    learner.resume_at(int(ckpt.meta["learner_steps"]), int(ckpt.meta["version"]))


def restore(ckpt: Checkpoint, *, learner, board, ingest, journal, run_dir: Path, auditor=None) -> dict:
    """Bring every component back to the checkpoint, then replay the journal. Returns what happened.
    With `auditor`: the published versions kept on disk come back first, and a replayed batch whose
    train-time audit was pending is checked by the learner's pass against the version it claims."""
    restore_learner(ckpt, learner)
    reloaded = auditor.load_persisted() if auditor is not None else 0
    board.restore(ckpt.meta["board"])
    seen, pending = ckpt.ids("seen_ids"), ckpt.ids("pending_ids")
    trained = seen - pending
    replayed = settled = audits_pending = 0
    # every id accepted before the crash: <run_dir>/seen_ids.log, plus the checkpoint's journal ids
    ingest.restore_books((ckpt.path / "replay_guard.msgpack").read_bytes(), ckpt.meta["clients"], seen)
    for entry in journal.entries():
        if entry.batch_id in trained:
            continue
        if entry.batch_id not in seen:  # acked after the checkpoint: its leases are not settled there yet
            for prompt_id in entry.prompt_ids:
                board.settle_replayed(prompt_id)
            settled += 1
        item = AcceptedBatch(entry.batch_id, entry.client, list(entry.groups), entry.reward_mean, entry.version,
                             entry.received_at, signer=entry.signer, prompt_ids=tuple(entry.prompt_ids),
                             signer_key=entry.signer_key, engine_dtype=entry.engine_dtype,
                             engine_kind=entry.engine_kind)
        if auditor is not None and any(g.audit for g in item.groups):
            auditor.expect(entry.batch_id, entry.signer_key, entry.engine_dtype, entry.engine_kind)  # the flag is journalled; the audit still happens
            audits_pending += 1
        ingest.requeue(item)
        replayed += 1
    journal.discard_trained(trained)
    published = last_published(run_dir)
    # the next version is numbered above every one ever published: no number names two different adapters
    learner.resume_at(learner.steps, max(learner.version, published if published is not None else -1) + 1)
    return {"from_step": learner.steps, "checkpoint": ckpt.path.name, "version": learner.version,
            "replayed_batches": replayed, "settled_after_checkpoint": settled,
            "audits_pending_replayed": audits_pending, "audit_versions_reloaded": reloaded,
            "checkpoint_version": int(ckpt.meta["version"]), "last_published_before": published}


class Checkpointing:
    """The policy the hub calls: `resume()` at start, `after_step()` each step, `final()` on the way out
    (SIGTERM/SIGINT and max_steps both end the learner loop, so both get a checkpoint)."""

    def __init__(self, run_dir: Path, *, every: int, keep: int, gate: Gate, learner, board, ingest, journal,
                 identity: dict, resume: bool = True, held=None, auditor=None, out=print,
                 export: AdapterExport | None = None):
        self.run_dir = Path(run_dir)
        self.auditor = auditor
        if not resume:
            self._archive_previous(journal, out)
        self.every = every
        self.gate = gate
        self.learner, self.board, self.ingest, self.journal = learner, board, ingest, journal
        self.identity = identity
        self.held = held
        self.export = export
        self.out = out
        self.store = Checkpointer(self.run_dir / "checkpoints", keep=keep, out=out)
        self._covered: set[bytes] = set()  # batches trained as of the older retained checkpoint
        self.last_step: int | None = None
        self.seconds = 0.0

    def _archive_previous(self, journal, out) -> None:
        """A fresh run in a run_dir that holds another lineage's checkpoints or journal: move them aside
        (never delete them), so neither a later --resume nor the journal replay mixes the two runs."""
        old_ckpts = self.run_dir / "checkpoints"
        audit_copies = self.run_dir / "audit_versions"  # another lineage's version numbers: never audit against them
        if not (any(old_ckpts.glob(f"{PREFIX}*")) or len(journal) or any(audit_copies.glob("*"))):
            return
        archive = self.run_dir / f"replaced-{time.time_ns()}"
        archive.mkdir()
        if old_ckpts.exists():
            os.rename(old_ckpts, archive / "checkpoints")
        if audit_copies.exists():
            os.rename(audit_copies, archive / "audit_versions")
        os.rename(journal.path, archive / "journal")
        journal.path.mkdir()
        out(f"warning: starting a fresh run (no --resume); the previous checkpoints and journal were moved to {archive}")

    def resume(self) -> dict:
        ckpt = self.store.latest()
        if ckpt is None:
            raise CheckpointError(f"--resume: no checkpoint in {self.store.root}")
        check_identity(ckpt, self.identity)
        info = restore(ckpt, learner=self.learner, board=self.board, ingest=self.ingest, journal=self.journal,
                       run_dir=self.run_dir, auditor=self.auditor)
        self._covered = ckpt.trained_ids
        self.last_step = self.learner.steps
        return info

    def save(self) -> Path:
        t0 = time.perf_counter()
        path = save(self.store, gate=self.gate, learner=self.learner, board=self.board, ingest=self.ingest,
                    identity=self.identity, held=self.held, export=self.export, journal=self.journal)
        # Journal entries the *older* retained checkpoint already covers can go: resuming from either
        # retained checkpoint never needs them.
        self.journal.discard_trained(self._covered)
        self._covered = Checkpoint(path, {}).trained_ids
        self.last_step = self.learner.steps
        self.seconds = time.perf_counter() - t0
        return path

    def after_step(self) -> Path | None:
        if self.every and self.learner.steps % self.every == 0 and self.learner.steps != self.last_step:
            return self.save()
        return None

    def final(self) -> Path | None:
        """The last checkpoint, and its PEFT directory copied to `<run_dir>/adapter` (the run's result)."""
        try:
            path = self.save()
            if (path / "adapter").is_dir():
                publish_dir(path / "adapter", self.run_dir / "adapter")
            return path
        except Exception as exc:  # the summary and shutdown must still happen
            self.out(f"warning: final checkpoint failed: {exc.__class__.__name__}: {exc}")
            return None


def publish_dir(src: Path, dst: Path) -> None:
    """Replace directory `dst` by a copy of `src`: copied under a temp name, then swapped in by renames."""
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(tmp)
    old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    if dst.exists():
        os.rename(dst, old)
    os.rename(tmp, dst)
    fsync_dir(dst.parent)
    shutil.rmtree(old, ignore_errors=True)
