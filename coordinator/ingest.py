"""Ingest: turn signed rollout-batch bytes into verified `TrainGroup`s, or a reject code.

Checks, cheapest first (each failure is a `ProtocolError` with a stable `RejectCode`):
size cap (the transport refused larger frames before reading them) -> envelope signature, audience,
timestamp window -> nonce replay -> batch id seen before (DUPLICATE_BATCH; the ack is repeated so a
client whose ack was lost can delete its spooled copy) -> strict decode + shape/range validation ->
run id -> adapter version not from the future -> every lease known and held by the signer ->
rewards recomputed from the completions (REWARD_MISMATCH).
Accepted groups go onto a bounded queue the learner drains. Back-pressure invariant: ingest never
blocks the P2P loop; when the queue is full the batch is refused with RATE_LIMITED and stays in the
volunteer's outbox for a later retry — nothing is dropped silently.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from asyncrl.coordinator.learner import TrainGroup
from asyncrl.coordinator.taskboard import LeaseRejected, TaskBoard
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import fingerprint
from asyncrl import tasks

REWARD_TOLERANCE = 1e-6


@dataclass
class ClientStats:
    name: str
    fingerprint: str
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    last_version: int = -1
    last_seen: float = 0.0


@dataclass
class AcceptedBatch:
    batch_id: bytes
    client: str
    groups: list[TrainGroup]
    reward_mean: float
    version: int
    received_at: float


class Ingest:
    def __init__(self, *, identity_public_key: bytes, run_id: str, board: TaskBoard, tokenizer, vocab_size: int,
                 current_version, max_batch_bytes: int, window_s: float, queue_groups: int = 256):
        self.audience = identity_public_key
        self.run_id = run_id
        self.board = board
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.current_version = current_version  # callable -> int
        self.max_batch_bytes = max_batch_bytes
        self.window_s = window_s
        self.replay = envelope.ReplayGuard(window_s=window_s)
        self.seen: set[bytes] = set()
        self.queue: queue.Queue[AcceptedBatch] = queue.Queue(maxsize=queue_groups)
        self.clients: dict[str, ClientStats] = {}
        self.lock = threading.Lock()
        self.accepted_log: list[AcceptedBatch] = []
        self.queued_groups = 0  # groups accepted but not yet taken by the learner

    def _client(self, signer: bytes, name: str = "") -> ClientStats:
        fp = fingerprint(signer)
        stats = self.clients.get(fp)
        if stats is None:
            stats = self.clients[fp] = ClientStats(name=name or fp, fingerprint=fp)
        elif name:
            stats.name = name
        stats.last_seen = time.time()
        return stats

    def handle(self, data: bytes) -> messages.Ack:
        """Verify one sealed rollout batch; never raises, always answers an Ack."""
        signer = data[4:36] if len(data) >= 36 else b""
        try:
            batch_id, groups, batch = self._verify(data)
        except ProtocolError as exc:
            if signer and exc.code is not RejectCode.SIGNATURE_MISMATCH:
                with self.lock:
                    st = self._client(signer)
                    st.rejected[exc.code.value] = st.rejected.get(exc.code.value, 0) + 1
            batch_id = exc.batch_id if hasattr(exc, "batch_id") else b""
            accepted = exc.code is RejectCode.DUPLICATE_BATCH  # the client may delete its copy
            return messages.Ack(batch_id=batch_id, accepted=accepted, code=exc.code.value, detail=exc.detail)
        rewards = [r for g in groups for r in g.rewards]
        accepted = AcceptedBatch(batch_id, batch.client_name, groups, float(np.mean(rewards)),
                                 batch.adapter_version, time.time())
        try:
            self.queue.put_nowait(accepted)
        except queue.Full:
            with self.lock:
                self.seen.discard(batch_id)
            return messages.Ack(batch_id=batch_id, accepted=False, code=RejectCode.RATE_LIMITED.value,
                                detail="learner queue full; retry later")
        with self.lock:
            self.queued_groups += len(groups)
            st = self._client(signer, batch.client_name)
            st.accepted += 1
            st.last_version = batch.adapter_version
            self.accepted_log.append(accepted)
        return messages.Ack(batch_id=batch_id, accepted=True)

    def _verify(self, data: bytes):
        opened = envelope.open_envelope(data, max_bytes=self.max_batch_bytes, expected_kind="rollout_batch",
                                        expected_audience=self.audience, window_s=self.window_s)
        batch_id = opened.payload_id
        with self.lock:
            if batch_id in self.seen:
                err = ProtocolError(RejectCode.DUPLICATE_BATCH, "already accepted")
                err.batch_id = batch_id
                raise err
            self.replay.check_and_remember(opened.signer, opened.nonce, opened.timestamp)
        batch = messages.decode_rollout_batch(opened.payload, max_bytes=self.max_batch_bytes,
                                              vocab_size=self.vocab_size)
        if batch.run_id != self.run_id:
            raise ProtocolError(RejectCode.WRONG_RUN, f"batch is for run {batch.run_id!r}")
        if batch.adapter_version > self.current_version():
            raise ProtocolError(RejectCode.FUTURE_VERSION, f"version {batch.adapter_version} not published yet")
        leases = []
        for group in batch.groups:
            try:
                lease = self.board.peek(group.lease_id, opened.signer)
            except LeaseRejected as exc:
                raise ProtocolError(RejectCode.UNKNOWN_LEASE, str(exc)) from None
            if lease.prompt.prompt_id != group.prompt_id:
                raise ProtocolError(RejectCode.UNKNOWN_LEASE, "prompt id does not match the lease")
            leases.append(lease)
        groups = []
        for group, lease in zip(batch.groups, leases):
            prompt_ids = np.frombuffer(group.prompt_token_ids, dtype="<i4").tolist()
            expected_prompt = self.tokenizer(lease.prompt.text)["input_ids"]
            if prompt_ids != list(expected_prompt):
                raise ProtocolError(RejectCode.MALFORMED, "prompt tokens differ from the leased prompt")
            comps, lps, rewards = [], [], []
            for c in group.completions:
                toks = c.token_array().tolist()
                if len(toks) > batch.sampling.max_new_tokens:
                    raise ProtocolError(RejectCode.MALFORMED, "completion longer than max_new_tokens")
                text = self.tokenizer.decode(toks, skip_special_tokens=True)
                expected = tasks.score(lease.prompt.reward, text, lease.prompt.answer)
                if abs(expected - c.reward) > REWARD_TOLERANCE:
                    raise ProtocolError(RejectCode.REWARD_MISMATCH,
                                        f"claimed {c.reward:.4f}, recomputed {expected:.4f}")
                comps.append(toks)
                lps.append(c.logprob_array().astype(np.float32).tolist())
                rewards.append(expected)
            groups.append(TrainGroup(prompt_ids, comps, lps, rewards, batch.adapter_version,
                                     batch.sampling.temperature, batch.client_name))
        for group in batch.groups:
            try:
                self.board.complete(group.lease_id, opened.signer)
            except LeaseRejected as exc:  # expired between peek and now
                raise ProtocolError(RejectCode.UNKNOWN_LEASE, str(exc)) from None
        with self.lock:
            self.seen.add(batch_id)
        return batch_id, groups, batch

    def take(self, n_groups: int, *, max_wait_s: float, min_groups: int, stop: threading.Event) -> list[AcceptedBatch]:
        """Block until n_groups are queued, or max_wait_s passed with >= min_groups (or stop is set)."""
        got: list[AcceptedBatch] = []
        count = 0
        deadline = time.monotonic() + max_wait_s
        while count < n_groups and not stop.is_set():
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                if count >= min_groups:
                    break
                deadline = time.monotonic() + max_wait_s
                continue
            try:
                item = self.queue.get(timeout=min(timeout, 0.2))
            except queue.Empty:
                continue
            got.append(item)
            count += len(item.groups)
            with self.lock:
                self.queued_groups -= len(item.groups)
        return got
