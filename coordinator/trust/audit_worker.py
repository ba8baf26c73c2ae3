"""AuditWorker: the generation audits that need a pass of their own, off the ack and off the learner.

Owned here: the queue of accepted batches waiting for a shadow-model audit (coordinator/trust/audit.py) and the
one thread that runs those audits. Ingest acks a batch once the cheap checks passed (size, signature,
freshness, nonce, schema, leases, rewards) and it is journalled; a batch the audit sampled and that the
learner's own forward pass cannot check (its claimed version is not the learner's current one, or the
learner takes no hook: DDP) comes here instead of going to the learner's queue. Its verdict decides:

  passed / unavailable (our copy of the version is lost) / stale meanwhile -> the learner's queue
  LOGPROB_MISMATCH (or a version older than any we keep)                   -> dropped, never trained:
        its groups count as dropped on the task board, its journal entry goes, the signer is judged as a
        train-time audit failure is (`Ingest.audit_verdict`: quarantine first, strikes as the policy says)
  an error of ours (a failed forward pass)                                 -> the learner's queue,
        unaudited and counted (`errors`): an honest volunteer never pays for our problem

Where it runs: the learner's device. On CUDA its forward passes go to a CUDA stream of their own, so they
overlap the learner's step instead of queueing behind it on the default stream; with `audit_device` set
the auditor holds a full copy of the model there (coordinator/trust/audit.py `Auditor`). On CPU: this thread.

Back-pressure invariant (the queue is `waiting`, bounded by `capacity`): nothing honest is ever dropped
for lack of room. Room is reserved *before* a batch's nonce is spent (`Ingest._admit`): ingest refuses a
submit with RATE_LIMITED while `held + in-flight handlers >= capacity`, so every batch that reaches
`submit` finds room and the volunteer, refused, keeps its batch in its outbox and retries. Every batch
ingest may admit is counted against the learner's queue too (held here + queued there + in flight <=
its size), so moving a batch from here to there never waits either. The refusal does not depend on
whether *this* batch would be audited: a cheat learns nothing about the sampling from a RATE_LIMITED.

Exactly-once across a crash: a batch held here is in the ingest journal with its groups' audit flag set
(written before the ack), and checkpoints count it as pending (`held_ids`). After a crash `--resume`
re-queues it from the journal and the learner's train-time hook audits it on the shadow model against
the version it claims (coordinator/checkpoint.py `restore`): audited before it is trained, never lost.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable

from asyncrl.protocol.errors import ProtocolError, RejectCode


class AuditWorker:
    def __init__(self, auditor, *, capacity: int, current_version: Callable[[], int], deliver: Callable,
                 drop: Callable, out=print):
        """`deliver(item)`: hand a batch to the learner's queue (never blocks: room was reserved at admit);
        `drop(item, code, strike)`: a failed audit's batch leaves for good (ingest books it)."""
        self.auditor = auditor
        self.capacity = max(1, capacity)
        self.current_version = current_version
        self.deliver, self.drop = deliver, drop
        self.out = out
        self._cond = threading.Condition()
        self._waiting: OrderedDict[bytes, object] = OrderedDict()  # batch id -> item, oldest first
        self._running: dict[bytes, object] = {}  # the one being audited now
        self._stop = False
        self.stats = {"queued": 0, "passed": 0, "dropped": 0, "errors": 0, "max_held": 0}
        self._thread = threading.Thread(target=self._run, name="audit-worker", daemon=True)
        self._thread.start()

    # ---- ingest's side ------------------------------------------------------------------------------
    def held(self) -> int:
        """Batches accepted and waiting for (or in) their audit: they hold learner-queue room too."""
        with self._cond:
            return len(self._waiting) + len(self._running)

    def room(self, in_flight: int) -> bool:
        """Could `in_flight` more batches (the ones ingest is verifying) all be queued here right now?"""
        return self.held() + in_flight < self.capacity

    def held_ids(self) -> set[bytes]:
        """Ids of the batches held here (a checkpoint counts them as pending: not trained yet)."""
        with self._cond:
            return set(self._waiting) | set(self._running)

    def submit(self, item) -> None:
        """Queue an acked batch for its audit (its room was reserved at admit, so this never waits)."""
        with self._cond:
            self._waiting[item.batch_id] = item
            self.stats["queued"] += 1
            self.stats["max_held"] = max(self.stats["max_held"], len(self._waiting) + len(self._running))
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is waiting or running (tests, tools, shutdown). True if idle."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._waiting and not self._running, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; what still waits stays in the journal (a --resume audits it)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # ---- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting or self._stop)
                if self._stop:
                    return
                batch_id, item = self._waiting.popitem(last=False)
                self._running[batch_id] = item
            try:
                self._audit(item)
            except Exception as exc:  # booking failed (deliver/drop): say so, keep the thread serving
                self.stats["errors"] += 1
                self.out(f"warning: audit worker: batch {batch_id.hex()[:12]} not booked ({exc!r})")
            finally:
                with self._cond:
                    self._running.pop(batch_id, None)
                    self._cond.notify_all()

    def _audit(self, item) -> None:
        try:
            with self._stream():
                self.auditor.audit_shadow(item.signer_key, item.batch_id, item.version, item.groups,
                                          current_version=self.current_version(), engine_dtype=item.engine_dtype,
                                          engine_kind=item.engine_kind, stage="audit")
        except ProtocolError as exc:
            if exc.code is RejectCode.LOGPROB_MISMATCH:
                strike = getattr(exc, "strike", True)
            else:  # STALE_VERSION: older than any version we keep; the learner could only drop it unread
                strike = False
            self.stats["dropped"] += 1
            self.drop(item, exc.code, strike)
            return
        except Exception as exc:  # ours (a failed forward pass): train it unaudited, say so, blame nobody
            self.stats["errors"] += 1
            self.out(f"warning: the audit of batch {item.batch_id.hex()[:12]} failed on our side ({exc!r}); "
                     "it is trained unaudited")
        else:
            self.stats["passed"] += 1
        for g in item.groups:  # audited here: the learner's hook must not audit it again
            g.audit = False
        self.deliver(item)

    def _stream(self):
        """A CUDA stream of the audit's own when it runs on a GPU (overlaps the learner's default stream)."""
        device = self.auditor.device
        if device.type != "cuda":
            return contextlib.nullcontext()
        import torch

        if getattr(self, "_cuda_stream", None) is None:
            self._cuda_stream = torch.cuda.Stream(device=device)
        return torch.cuda.stream(self._cuda_stream)

    def status(self) -> dict:
        with self._cond:
            held = len(self._waiting) + len(self._running)
        return {**self.stats, "held": held, "capacity": self.capacity}
