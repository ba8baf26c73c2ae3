"""Ingest: turn signed rollout-batch bytes into verified `TrainGroup`s, or a reject code.

Checks, cheapest first (each failure is a `ProtocolError` with a stable `RejectCode`):
[transport, before the body is read: stream caps, byte budget, deadlines (swarm/inbound.py), peer banned /
over its rate (NOT_ALLOWED, RATE_LIMITED), frame size cap (PAYLOAD_TOO_LARGE)] -> header key banned or not
on the allowlist (NOT_ALLOWED; costs nothing, changes nothing) -> envelope size, signature, audience,
timestamp window -> identity rate + quota (a copy sent by another peer than the signer's own is charged to
that peer: coordinator/trust/access.py) and learner queue room (RATE_LIMITED, before the nonce is spent so the
same bytes can be retried) -> nonce replay (NONCE_REUSED) -> batch id seen before (DUPLICATE_BATCH; the
ack is repeated so a client whose ack was lost can delete its spooled copy — also when its retry reused
the nonce) or being verified right now (RATE_LIMITED) -> strict decode + shape/range validation -> run id
-> sampling params as leased -> adapter version one we published (not ahead, not a superseded one:
FUTURE_VERSION) -> every lease known and held by the signer -> finish reasons derived from the tokens and the published
stop set (protocol.messages.derive_finish_reason; a claim that differs, or tokens after a stop token, is
MALFORMED) -> rewards recomputed from the completions (REWARD_MISMATCH; a completion our verifier cannot
score drops its group, UNSCORABLE, no blame) -> generation audit *routing* (coordinator/trust/audit.py `route`:
not sampled, deferred to the learner's own forward pass, or queued for a shadow-model pass on the
AuditWorker, coordinator/trust/audit_worker.py). No audit runs inside a submit: its verdict comes after the ack.
Only rejects raised after the signature verified are charged to the signer (client stats, strikes in
coordinator/trust/access.py); earlier ones, and copies sent by another peer, are charged to the transport peer.

Commit, in this order, so an ack always means "durable here" and nothing is half-done: journal the
batch (coordinator/ingest/journal.py; a batch queued for its audit is journalled with its groups' audit flag, so
a --resume audits it before training it) -> complete *all* its leases or none (a lease that expired
mid-batch refuses the batch and changes nothing) -> queue it for the learner, or for its audit first
(the AuditWorker hands it to the learner's queue if it passes, drops it if not; room in both was reserved
before the nonce;
should the put still fail, the leases are reopened and the journal entry removed) -> remember its id
(`seen`) -> a coordinator-signed receipt (coordinator/ingest/receipts.py; a retried accepted batch gets the same
receipt again) -> ack. A failed journal write therefore leaves nothing behind: no `seen` id whose
DUPLICATE_BATCH ack would make a volunteer delete a batch that is nowhere.
Back-pressure invariant: ingest never blocks the P2P loop; when the learner's queue or the audit queue
is full (held + queued + in flight >= its size) the batch is refused with RATE_LIMITED before its nonce
is spent and stays in the volunteer's outbox for a later retry — nothing is dropped silently.

Memory is bounded over a run of any length (coordinator/ingest/ingest_books.py): per-key stats in an LRU table,
scalars only in the accepted log, a bucketed reward trace, seen ids capped and persisted incrementally.
Its lock and books are its own: other modules read and change them through methods that take the lock
(`books`, `snapshot`/`restore_books` for checkpoints, `requeue` for a journal replay, `unqueue_groups` and
`accepted_count` for the --sync round, `trust_view` and `load_seen` for trust_state.py).

Size: the checks and the commit are one ordered pipeline whose order is the invariant (cheapest check
first, the nonce spent only after room is reserved, journal before ack); split across files, that order
would be invisible. Its books, journal and receipts are their own modules.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

import msgspec
import numpy as np

from asyncrl import tasks
from asyncrl.protocol import envelope, limits, messages
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import fingerprint, peer_id_from_public_key
from asyncrl.tasks.sources import encode_prompt

from ..learner.learner import TrainGroup, sampling_knobs
from ..leasing.taskboard import LeaseRejected, TaskBoard, lease_holder
from ..trust.access import IDENTITY_STRIKES, IDENTITY_SUSPICIONS
from .episodes import is_episode_lease, rescore_episode_group
from .ingest_books import AcceptedRecord, ClientStats, ClientTable, RewardTrace, SeenIds

__all__ = ["Ingest", "AcceptedBatch", "ClientStats", "IngestBooks", "IngestSnapshot", "TrustView", "REWARD_TOLERANCE"]

REWARD_TOLERANCE = 1e-6
ACCEPTED_LOG = 4096  # newest accepted-batch records kept for the learner loop's `batch` events
RETRYABLE = (RejectCode.RATE_LIMITED, RejectCode.INTERNAL)
SIGNERS_LIES = IDENTITY_STRIKES | IDENTITY_SUSPICIONS  # booked against the signer whoever delivered them


def _foreign(signer: bytes, peer: str) -> bool:
    """True when `peer` is known and is not the signer's own peer id (a volunteer's peer id is its key)."""
    return bool(peer) and peer != peer_id_from_public_key(signer)


@dataclass
class AcceptedBatch:
    batch_id: bytes
    client: str
    groups: list[TrainGroup]
    reward_mean: float
    version: int
    received_at: float
    signer: str = ""  # the volunteer's key fingerprint (names are self-chosen; --sync counts keys)
    prompt_ids: tuple[str, ...] = ()  # the leased prompts its groups answer (journal replay settles them)
    signer_key: bytes = b""  # the raw key (a journal replay re-registers a pending train-time audit)
    engine_dtype: str = ""   # what the batch said its engine computed in (the audit's tolerance) ...
    engine_kind: str = ""    # ... and which engine (the audit learns a tolerance per kind x dtype)


@dataclass(frozen=True)
class IngestBooks:
    """Ingest's books at one instant (`Ingest.books`): copies, read without ingest's lock."""
    accepted_total: int  # batches ever accepted
    queued_groups: int  # accepted, not yet taken by the learner
    unscorable_groups: int  # dropped because our reward check could not finish (no blame)
    reward_first: float  # mean batch reward over the first / last 10 % of accepted batches
    reward_last: float
    clients: list[dict]  # each known key's ClientStats as a dict, least recently seen first


@dataclass(frozen=True)
class IngestSnapshot:
    """What a checkpoint keeps of ingest (`Ingest.snapshot`): copied under the lock, encoded outside it."""
    replay: tuple  # envelope.ReplayGuard.snapshot(): nonces stay single-use across a --resume
    clients: list[dict]  # ClientTable.rows(): each key's stats, least recently seen first

    def replay_bytes(self) -> bytes:
        """The replay guard as `Ingest.restore_books` reads it back (msgpack)."""
        return envelope.ReplayGuard.encode_snapshot(self.replay)


@dataclass(frozen=True)
class TrustView:
    """What trust.json shows of ingest (`Ingest.trust_view`): copies, read at one instant."""
    clients: dict[str, dict]  # fingerprint -> name, accepted, rejected by code, resent (the most recently seen)
    verdicts: list[dict]  # recent outcomes, newest last
    books: dict  # sizes of the bounded books and how much each forgot, groups dropped as unscorable


@dataclass
class _Verified:
    opened: envelope.Opened
    batch: messages.RolloutBatch
    leases: list
    groups: list[TrainGroup]
    prompt_ids: tuple[str, ...]  # of the groups kept
    unscorable: int              # groups dropped because our reward check could not finish
    audit: str


class Ingest:
    def __init__(self, *, identity_public_key: bytes, run_id: str, board: TaskBoard, tokenizer, vocab_size: int,
                 current_version, max_batch_bytes: int, window_s: float, queue_groups: int = 256, journal=None,
                 access=None, auditor=None, sampling: messages.SamplingParams | None = None, is_published=None,
                 stop_token_ids: tuple[int, ...] = (), context_limit: int | None = None, receipts=None,
                 seen_path=None, audit_queue: int = 16,
                 max_seen_ids: int = 2_000_000, max_clients: int = 10_000, replay_entries: int = 200_000):
        self.audience = identity_public_key
        self.run_id = run_id
        self.board = board
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # ids the tokenizer has: the embedding rows past it decode to "" and no honest engine samples them
        self.vocab_limit = len(tokenizer) if tokenizer is not None else None
        self.current_version = current_version  # callable -> int (the learner's version)
        # callable(version) -> bool: could a volunteer hold it? (coordinator/publisher.py: not ahead of the
        # newest published one, not one superseded before publication). Default: not ahead of current.
        self.is_published = is_published or (lambda v: v <= self.current_version())
        self.max_batch_bytes = max_batch_bytes
        self.window_s = window_s
        self.replay = envelope.ReplayGuard(window_s=window_s, max_entries=replay_entries)
        self.seen = SeenIds(max_seen_ids, seen_path)
        self.queue: queue.Queue[AcceptedBatch] = queue.Queue(maxsize=queue_groups)
        self.clients = ClientTable(max_clients)
        self.lock = threading.Lock()
        self.accepted_log: deque[AcceptedRecord] = deque(maxlen=ACCEPTED_LOG)
        self.accepted_total = 0  # records ever appended (the next record's seq)
        self.rewards = RewardTrace()
        self.queued_groups = 0  # groups accepted but not yet taken by the learner
        self.unscorable_groups = 0  # groups dropped because our reward check could not finish (no blame)
        self.journal = journal  # IngestJournal or None (then an ack is only as durable as this process)
        self.access = access    # coordinator.trust.access.AccessControl or None (open, unlimited)
        self.auditor = auditor  # coordinator.trust.audit.Auditor or None (no generation audit)
        self.sampling = sampling  # what leases promise; a batch claiming other sampling params is MALFORMED
        self.stop_token_ids = tuple(stop_token_ids)  # the pinned stop set (models/pinning.py); () = not checked
        self.context_limit = context_limit  # the model's context: a completion may also end there ("length")
        self.receipts = receipts  # coordinator.ingest.receipts.ReceiptDesk or None (acks carry no receipt)
        self.verdicts: deque[dict] = deque(maxlen=1024)  # recent outcomes, newest last (trust.json, tests)
        self._reserved = 0  # queue slots held by batches being verified (room is checked before the nonce)
        # Lets `exact` rewards be re-scored without decoding most completions (tasks/rewards.py).
        self.bounds = tasks.PrintableTable(tokenizer, vocab_size) if tokenizer is not None else None
        if self.bounds is not None and self.bounds.table is None:
            self.bounds = None
        self._inflight: set[bytes] = set()  # batch ids being verified (a concurrent copy waits its turn)
        self.audits = None  # coordinator/trust/audit_worker.py: shadow-model audits after the ack
        if auditor is not None and auditor.enabled:
            from ..trust.audit_worker import AuditWorker

            self.audits = AuditWorker(auditor, capacity=audit_queue, current_version=lambda: self.current_version(),
                                      deliver=self._audited, drop=self._audit_failed)

    def note_client(self, signer: bytes, name: str = "") -> None:
        """A volunteer asked for work: remember its chosen name and when it was last seen."""
        with self.lock:
            self._client(signer, name)

    def note_canary(self, signer: bytes, report: messages.CanaryReport) -> None:
        """A volunteer's canary result for the version it loaded (the swarm table shows the last one). A failed
        canary is its engine's problem, not cheating: it is recorded and shown, never struck."""
        with self.lock:
            self._client(signer).note_canary(report)

    def queued(self) -> int:
        """Groups accepted and not yet taken by the learner."""
        with self.lock:
            return self.queued_groups

    def books(self) -> IngestBooks:
        """One consistent read of the books: the run summary, the contributors table, the dashboard."""
        with self.lock:
            return IngestBooks(accepted_total=self.accepted_total, queued_groups=self.queued_groups,
                               unscorable_groups=self.unscorable_groups,
                               reward_first=self.rewards.mean_of(first=True),
                               reward_last=self.rewards.mean_of(first=False),
                               clients=[asdict(st) for st in self.clients.values()])

    def snapshot(self) -> IngestSnapshot:
        """The replay guard and the client stats at one instant (a checkpoint's; encode it outside the lock)."""
        with self.lock:
            return IngestSnapshot(self.replay.snapshot(), self.clients.rows())

    def trust_view(self, max_listed: int) -> TrustView:
        """The `max_listed` most recently seen clients, recent verdicts and the books' sizes (trust.json)."""
        with self.lock:
            recent = list(self.clients.items())[-max_listed:]
            clients = {fp: {"name": st.name, "accepted": st.accepted, "rejected": dict(st.rejected),
                            "resent": st.resent} for fp, st in recent}
            books = {"clients_tracked": len(self.clients), "clients_forgotten": self.clients.forgotten,
                     "seen_ids": len(self.seen), "seen_forgotten": self.seen.forgotten,
                     "unscorable_groups": self.unscorable_groups}
            return TrustView(clients, list(self.verdicts), books)

    def accepted_count(self) -> int:
        """Batches ever accepted: the seq the next accepted-batch record gets (`accepted_since`)."""
        with self.lock:
            return self.accepted_total

    def unqueue_groups(self, n: int) -> None:
        """`n` queued groups left the books: taken for training, or dropped before it."""
        with self.lock:
            self.queued_groups -= n

    def clients_known(self) -> int:
        """How many volunteer keys the books hold (bounded: coordinator/ingest/ingest_books.py ClientTable)."""
        with self.lock:
            return len(self.clients)

    def accepted_since(self, seq: int) -> list[AcceptedRecord]:
        """Accepted-batch records numbered >= seq that are still kept (the newest ACCEPTED_LOG)."""
        with self.lock:
            return [r for r in self.accepted_log if r.seq >= seq]

    def log_accepted(self, item: AcceptedBatch) -> AcceptedRecord:
        """Book an accepted batch (call with `lock` held): scalars only, the groups stay with the queue."""
        rec = AcceptedRecord(self.accepted_total, item.batch_id, item.client, item.signer, item.version,
                             item.reward_mean, len(item.groups), tuple(item.prompt_ids), item.received_at)
        self.accepted_log.append(rec)
        self.accepted_total += 1
        self.rewards.add(item.reward_mean)
        return rec

    def _client(self, signer: bytes, name: str = "") -> ClientStats:
        st = self.clients.touch(fingerprint(signer), name[:limits.MAX_NAME_CHARS])
        st.last_seen = time.time()
        return st

    def handle(self, data: bytes, peer: str = "") -> messages.Ack:
        """Verify one sealed rollout batch; never raises, always answers an Ack."""
        reserved: list[bytes] = []
        try:
            return self._handle(data, peer, reserved)
        finally:
            if reserved:
                with self.lock:
                    self._reserved -= 1
                    self._inflight.discard(reserved[0])

    def _handle(self, data: bytes, peer: str, reserved: list) -> messages.Ack:
        try:
            return self._verify_and_commit(data, peer, reserved)
        except ProtocolError as exc:
            signer = getattr(exc, "signer", None)  # set only once the signature verified
            by_sender = getattr(exc, "charge_peer", False) or (signer is not None and exc.code not in SIGNERS_LIES
                                                              and _foreign(signer, peer))
            if by_sender:
                signer = None  # a copy sent by someone else: the sending peer answers for it, not the signer
            if signer is not None:
                with self.lock:
                    st = self._client(signer)
                    if exc.code is RejectCode.DUPLICATE_BATCH:
                        st.resent += 1
                    else:
                        st.rejected[exc.code.value] = st.rejected.get(exc.code.value, 0) + 1
            if self.access is not None:
                self.access.on_reject(exc.code, signer=signer, peer=peer, strike=getattr(exc, "strike", True))
            batch_id = getattr(exc, "batch_id", b"")
            if not by_sender:  # a refused copy from another peer is no verdict on the signer's batch (it is
                self._verdict(batch_id, signer, exc.code.value, "ingest")  # counted on that peer: access.py)
            accepted = exc.code is RejectCode.DUPLICATE_BATCH  # the client may delete its copy
            receipt = (self.receipts.lookup(batch_id, signer)  # only to its owner, from her own peer (receipts.py)
                       if accepted and signer is not None and self.receipts is not None else b"")
            return messages.Ack(batch_id=batch_id, accepted=accepted, code=exc.code.value,
                                detail=exc.detail[:limits.MAX_DETAIL_CHARS], receipt=receipt)

    def _receipt(self, signer: bytes, batch_id: bytes, batch, groups) -> bytes:
        """The signed receipt for an accepted batch (coordinator/ingest/receipts.py); b"" if it cannot be written:
        the batch stays accepted (it is journalled and queued), only its proof is missing."""
        if self.receipts is None:
            return b""
        try:
            return self.receipts.issue(signer, batch_id, adapter_version=batch.adapter_version, groups=len(groups),
                                       completions=sum(len(g.completions) for g in groups),
                                       tokens=sum(len(c) for g in groups for c in g.completions))
        except OSError:
            return b""

    def _verify_and_commit(self, data: bytes, peer: str, reserved: list) -> messages.Ack:
        data = bytes(data)
        if (self.access is not None and envelope.HEADER_BYTES < len(data) <= self.max_batch_bytes
                and data[:4] == envelope.MAGIC):
            self.access.check_signer(data[4:36])  # the header key, before spending a signature check
        opened = envelope.open_envelope(data, max_bytes=self.max_batch_bytes, expected_kind="rollout_batch",
                                        expected_audience=self.audience, window_s=self.window_s)
        try:
            self._admit(opened, peer, reserved)
            batch = self._decode(opened)
            held, holder = [], self._holder(opened.signer, peer, batch)
            try:
                leases = self._leases(opened, batch, holder)
                held = self.board.hold([l.lease_id for l in leases], holder)  # no expiry under our checks
                verified = self._verify_leased(opened, batch, leases)
                return self._commit(verified, peer)
            except ProtocolError as exc:
                if exc.code not in RETRYABLE:
                    # A refused batch is never re-sent (client/delivery.py): end its leases now instead of
                    # pinning the prompts (and the back-pressure room) until they expire. Only the signer's
                    # own outstanding leases are touched.
                    self.board.abandon([g.lease_id for g in batch.groups], holder)
                raise
            finally:
                self.board.unhold(held)
        except ProtocolError as exc:
            exc.signer = opened.signer  # from here on the signer is accountable (unless charge_peer)
            if not hasattr(exc, "batch_id"):
                exc.batch_id = opened.payload_id
            raise

    def _admit(self, opened: envelope.Opened, peer: str, reserved: list) -> None:
        batch_id = opened.payload_id
        if self.access is not None:
            self.access.admit_identity(opened.signer, peer)  # before the nonce is spent: a retry of these bytes works
        with self.lock:
            held = self.audits.held() if self.audits is not None else 0  # accepted, waiting for their audit
            if self.queue.qsize() + held + self._reserved >= self.queue.maxsize:
                raise ProtocolError(RejectCode.RATE_LIMITED, "learner queue full; retry later")
            if self.audits is not None and not self.audits.room(self._reserved):  # whether or not this one is audited
                raise ProtocolError(RejectCode.RATE_LIMITED, "audit queue full; retry later")
            try:
                self.replay.check_and_remember(opened.signer, opened.nonce, opened.timestamp)
            except ProtocolError as exc:
                if exc.code is RejectCode.NONCE_REUSED and batch_id in self.seen:  # a lost ack's retry
                    raise ProtocolError(RejectCode.DUPLICATE_BATCH, "already accepted") from None
                raise
            if batch_id in self.seen:
                raise ProtocolError(RejectCode.DUPLICATE_BATCH, "already accepted")
            if batch_id in self._inflight:
                raise ProtocolError(RejectCode.RATE_LIMITED, "this batch is being verified; retry later")
            self._reserved += 1
            self._inflight.add(batch_id)
            reserved.append(batch_id)

    def _decode(self, opened: envelope.Opened) -> messages.RolloutBatch:
        batch = messages.decode_rollout_batch(opened.payload, max_bytes=self.max_batch_bytes,
                                              vocab_size=self.vocab_size)
        if batch.run_id != self.run_id:
            raise ProtocolError(RejectCode.WRONG_RUN, f"batch is for run {batch.run_id!r}")
        return batch

    def _holder(self, signer: bytes, peer: str, batch: messages.RolloutBatch) -> bytes:
        """Whose leases the batch answers (coordinator/leasing/taskboard.py `lease_holder`): those granted to requests
        its sender made for the signer when it holds them, else the signer's own (a copy of her batch from
        another peer is her work, trained as hers; coordinator/trust/access.py charges and refuses such copies)."""
        holder = lease_holder(signer, peer)
        if holder != signer and batch.groups:
            try:
                self.board.peek(batch.groups[0].lease_id, holder)
            except LeaseRejected:
                return signer
        return holder

    def _leases(self, opened: envelope.Opened, batch: messages.RolloutBatch, holder: bytes) -> list:
        if self.sampling is not None and batch.sampling != self.sampling:
            raise ProtocolError(RejectCode.MALFORMED, "sampling parameters differ from the leased ones")
        if not self.is_published(batch.adapter_version):
            raise ProtocolError(RejectCode.FUTURE_VERSION, f"version {batch.adapter_version} was not published")
        leases = []
        for group in batch.groups:
            try:
                lease = self.board.peek(group.lease_id, holder)
            except LeaseRejected as exc:
                raise ProtocolError(RejectCode.UNKNOWN_LEASE, str(exc)) from None
            if lease.prompt.prompt_id != group.prompt_id:
                raise ProtocolError(RejectCode.UNKNOWN_LEASE, "prompt id does not match the lease")
            leases.append(lease)
        if len({l.lease_id for l in leases}) != len(leases):
            raise ProtocolError(RejectCode.MALFORMED, "the same lease answered twice in one batch")
        return leases

    def _verify_leased(self, opened: envelope.Opened, batch, leases) -> _Verified:
        groups, prompt_ids, unscorable = [], [], 0
        with tasks.scoring_for(opened.signer):  # the signer's fair share of the verifier pool
            for group, lease in zip(batch.groups, leases):
                try:
                    groups.append(rescore_group(self.tokenizer, group, lease, batch, self.bounds, vocab_limit=self.vocab_limit,
                                                 stop_token_ids=self.stop_token_ids,
                                                 context_limit=self.context_limit))
                except (tasks.Unscorable, tasks.RewardError):
                    unscorable += 1  # our verifier (or our reward function) could not finish: drop the group,
                    continue         # blame nobody
                prompt_ids.append(group.prompt_id)
        audit = "off"
        if self.auditor is not None and groups:  # after the (cheaper) reward check; before the leases settle
            streak = self.access.valid_streak(opened.signer) if self.access is not None else 0
            audit = self.auditor.route(opened.signer, opened.payload_id, batch.adapter_version, groups,
                                       valid_streak=streak, current_version=self.current_version(),
                                       engine_dtype=batch.engine_dtype, engine_kind=batch.engine_kind)
            if audit == "queued" and self.audits is None:  # no worker (an auditor switched on later): audit here
                audit = self.auditor.audit_shadow(opened.signer, opened.payload_id, batch.adapter_version, groups,
                                                  current_version=self.current_version(),
                                                  engine_dtype=batch.engine_dtype, engine_kind=batch.engine_kind,
                                                  stage="ingest")
        return _Verified(opened, batch, leases, groups, tuple(prompt_ids), unscorable, audit)

    def _commit(self, v: _Verified, peer: str) -> messages.Ack:
        """Journal -> all leases -> queue -> seen -> ack (see the module docstring)."""
        batch_id, signer = v.opened.payload_id, v.opened.signer
        item = None
        if v.groups:
            rewards = [r for g in v.groups for r in g.rewards]
            item = AcceptedBatch(batch_id, v.batch.client_name, v.groups, float(np.mean(rewards)),
                                 v.batch.adapter_version, time.time(), signer=fingerprint(signer),
                                 prompt_ids=v.prompt_ids, signer_key=signer, engine_dtype=v.batch.engine_dtype,
                                 engine_kind=v.batch.engine_kind)
            if v.audit == "queued":  # journalled flagged: after a crash the learner's hook audits it first
                for g in item.groups:
                    g.batch_id, g.audit = batch_id, True
            if self.journal is not None:
                try:
                    self.journal.put(item)  # durable before anything else changes
                except OSError as exc:  # nothing changed yet: the volunteer retries the same batch later
                    raise ProtocolError(RejectCode.INTERNAL, f"could not journal the batch: {exc}") from None
        try:
            kept = set(v.prompt_ids)
            unscored = [l for l in v.leases if l.prompt.prompt_id not in kept]
            settled = self.board.complete_all([l.lease_id for l in v.leases], v.leases[0].client if v.leases else signer,
                                              unscored={l.lease_id for l in unscored})
        except LeaseRejected as exc:  # one expired between peek and now: refuse the whole batch, unchanged
            if item is not None and self.journal is not None:
                self.journal.remove(batch_id)
            raise ProtocolError(RejectCode.UNKNOWN_LEASE, str(exc)) from None
        if item is not None:
            with self.lock:
                self.queued_groups += len(item.groups)
            try:
                if v.audit == "queued":
                    self.audits.submit(item)  # room reserved at admit: never waits, never drops
                else:
                    self.queue.put_nowait(item)
            except queue.Full:  # cannot happen with the reservation; if it does, undo everything
                self.unqueue_groups(len(item.groups))
                self.board.reopen(settled)
                if self.journal is not None:
                    self.journal.remove(batch_id)
                raise ProtocolError(RejectCode.RATE_LIMITED, "learner queue full; retry later") from None
        if v.unscorable:
            self.board.mark_dropped(v.unscorable)
            if unscored:
                self.board.note_unscorable([l.prompt for l in unscored], unscored[0].client)  # poison (taskboard.py)
        with self.lock:
            self.seen.add(batch_id)
            self.unscorable_groups += v.unscorable
            st = self._client(signer, v.batch.client_name)
            st.accepted += 1
            st.last_version = v.batch.adapter_version
            if item is not None:
                self.log_accepted(item)
        if self.access is not None:
            self.access.record_accepted(signer, peer)
        if v.unscorable:
            self._verdict(batch_id, signer, RejectCode.UNSCORABLE.value, "ingest", groups=v.unscorable)
        self._verdict(batch_id, signer, "ACCEPTED", "ingest", audit=v.audit)
        detail = f"{v.unscorable} group(s) could not be scored here and were dropped (not your fault)" \
            if v.unscorable else ""
        receipt = self._receipt(signer, batch_id, v.batch, v.groups)  # issued and logged whoever delivered it...
        return messages.Ack(batch_id=batch_id, accepted=True, detail=detail,
                            receipt=b"" if _foreign(signer, peer) else receipt)  # ...handed only to its owner

    # ---- trust bookkeeping (coordinator/trust/: access.py, audit.py, trust_state.py) ----
    def _verdict(self, batch_id: bytes, signer: bytes | None, code: str, stage: str, **extra) -> None:
        with self.lock:
            self.verdicts.append({"batch_id": batch_id.hex(), "client": fingerprint(signer) if signer else None,
                                  "code": code, "stage": stage, "t": time.time(), **extra})

    def audit_verdict(self, batch_id: bytes, signer: bytes, code: RejectCode | None, stage: str,
                      *, strike: bool = True) -> None:
        """The auditor's outcome for a batch. A failure at train time comes after the ack: the batch is
        dropped before its gradient and counted as rejected; its signer is struck only when `strike`
        (coordinator/trust/audit.py decides: a first suspicion quarantines, it does not strike)."""
        if code is None:
            self._verdict(batch_id, signer or None, "AUDIT_PASSED", stage)
            return
        if stage != "ingest" and signer:
            with self.lock:
                st = self._client(signer)
                st.accepted = max(0, st.accepted - 1)
                st.rejected[code.value] = st.rejected.get(code.value, 0) + 1
            if self.access is not None:
                self.access.on_reject(code, signer=signer, strike=strike)
        self._verdict(batch_id, signer or None, code.value, stage)

    def _audited(self, item: AcceptedBatch) -> None:
        """AuditWorker: the batch passed (or could not be checked through no fault of its sender): to the
        learner. Its room there was reserved at admit (held + queued + in flight <= the queue's size), so this
        does not wait; were it ever full, the audit thread would wait for the learner, never drop the batch."""
        self.queue.put(item)

    def _audit_failed(self, item: AcceptedBatch, code: RejectCode, strike: bool) -> None:
        """AuditWorker: the batch failed its audit after its ack; it is never trained. Its groups count as
        dropped (the board's books balance), its journal entry goes (a --resume must not audit, strike or
        train it again), and the signer is judged as for a train-time failure."""
        self.unqueue_groups(len(item.groups))
        self.board.mark_dropped(len(item.groups))
        if self.journal is not None:
            self.journal.remove(item.batch_id)
        self.audit_verdict(item.batch_id, item.signer_key, code, "audit", strike=strike)

    def awaiting_audit(self) -> set[bytes]:
        """Ids of accepted batches still waiting for their audit (not in the learner's queue yet)."""
        return self.audits.held_ids() if self.audits is not None else set()

    def close(self) -> None:
        """Stop the audit worker (what it still holds is journalled: a --resume audits it)."""
        if self.audits is not None:
            self.audits.close()

    def state_bytes(self) -> bytes:
        """The replay guard (msgpack, no pickle): nonces stay single-use across restarts. Accepted batch
        ids are persisted incrementally instead (`save_seen`). Encoded outside the lock."""
        with self.lock:
            snapshot = self.replay.snapshot()
        return msgspec.msgpack.encode({"version": 2, "replay": envelope.ReplayGuard.encode_snapshot(snapshot)})

    def save_seen(self) -> int:
        """Append the ids accepted since the last call to the seen-ids file (outside the lock)."""
        with self.lock:
            new = self.seen.take_unsaved()
        self.seen.append(new)
        return len(new)

    def load_state(self, data: bytes) -> None:
        """Merge a `state_bytes()` snapshot into the live state (union: never forgets what it holds).
        Reads version 1 (with the seen ids inline) too."""
        try:
            state = msgspec.msgpack.decode(data, type=dict[str, int | bytes | list[bytes]])
            if state.get("version") not in (1, 2):
                raise ValueError("unknown state version")
            guard = envelope.ReplayGuard.from_bytes(state["replay"])
            seen = [bytes(b) for b in state.get("seen", ()) if len(b) == 32]
        except ProtocolError:
            raise
        except Exception as exc:
            raise ProtocolError(RejectCode.MALFORMED, f"ingest state: {exc}") from None
        with self.lock:
            self.replay.merge(guard)
            self.seen.update(seen)

    def load_seen(self) -> int:
        """Merge the accepted ids in the seen-ids file (<run_dir>/seen_ids.log); returns how many were new."""
        with self.lock:
            return self.seen.load()

    def restore_books(self, replay: bytes, clients: list[dict], seen_ids) -> None:
        """A checkpoint's replay guard and client stats replace ours; seen = the seen-ids file + `seen_ids`."""
        guard = envelope.ReplayGuard.from_bytes(replay)
        stats = [ClientStats.from_row(c) for c in clients]
        with self.lock:
            self.replay = guard
            self.clients.replace(stats)
            self.seen.load()  # every id accepted before the crash
            self.seen.update(seen_ids)

    def requeue(self, item: AcceptedBatch) -> None:
        """A journalled batch back on the learner's queue (--resume): booked as seen and as queued."""
        self.queue.put_nowait(item)
        with self.lock:
            self.seen.add(item.batch_id)
            self.queued_groups += len(item.groups)

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
            self.unqueue_groups(len(item.groups))
        return got


def rescore_group(tokenizer, group: messages.RolloutGroup, lease, batch: messages.RolloutBatch,
                  bounds=None, *, stop_token_ids: tuple[int, ...] = (), context_limit: int | None = None,
                  vocab_limit: int | None = None) -> TrainGroup:
    """One leased group, checked and re-scored: prompt tokens as leased, lengths within the lease, each
    finish_reason re-derived from the tokens and the pinned stop set (MALFORMED if the claim differs; with
    no stop set only a full-length "length" completion counts as truncated), every reward recomputed from
    the decoded completion (REWARD_MISMATCH otherwise) — or, with `bounds` (tasks.PrintableTable), without
    decoding when the reward cannot but be 0. bench/ingest.py times it. A multi-turn episode's group (its lease
    names an environment) is replayed instead: coordinator/ingest/episodes.py. A completion holding an id at or past
    `vocab_limit` (len(tokenizer)) is refused OUT_OF_VOCAB: both engines mask those ids (client/engine.py)."""
    if vocab_limit is not None:
        for i, c in enumerate(group.completions):
            ids = c.token_array()
            if len(ids) and int(ids.max()) >= vocab_limit:
                raise ProtocolError(RejectCode.OUT_OF_VOCAB, f"completion {i} holds token id {int(ids.max())}; the "
                                    f"tokenizer has {vocab_limit} ids (the model's padded rows are never sampled)")
    if is_episode_lease(lease):
        return rescore_episode_group(tokenizer, group, lease, batch, stop_token_ids=stop_token_ids)
    if any(c.env_mask for c in group.completions):  # tokens marked unsampled would escape the logprob audit
        raise ProtocolError(RejectCode.ENV_MISMATCH, "environment tokens in an answer to a lease without an environment")
    if lease.prompt_token_ids is not None:  # as granted: the same encode_prompt, done once at lease time
        if bytes(group.prompt_token_ids) != lease.prompt_token_ids:
            raise ProtocolError(RejectCode.MALFORMED, "prompt tokens differ from the leased prompt")
        prompt_ids = np.frombuffer(group.prompt_token_ids, dtype="<i4").tolist()
    else:
        prompt_ids = np.frombuffer(group.prompt_token_ids, dtype="<i4").tolist()
        if prompt_ids != list(encode_prompt(tokenizer, lease.prompt.text)):
            raise ProtocolError(RejectCode.MALFORMED, "prompt tokens differ from the leased prompt")
    reward, answer = lease.prompt.reward, lease.prompt.answer
    arrays = [c.token_array() for c in group.completions]
    if any(len(a) > batch.sampling.max_new_tokens for a in arrays):
        raise ProtocolError(RejectCode.MALFORMED, "completion longer than max_new_tokens")
    floors = bounds.lower_bounds(arrays) if bounds is not None else [0] * len(arrays)
    truncated = []
    if stop_token_ids:
        finishes = messages.derive_finish_reasons(arrays, stop_token_ids, max_new_tokens=batch.sampling.max_new_tokens,
                                                  prompt_len=len(prompt_ids), context_limit=context_limit)
        for c, finish in zip(group.completions, finishes):
            if finish != c.finish_reason:
                raise ProtocolError(RejectCode.MALFORMED, f"finish_reason {c.finish_reason!r}, the tokens say {finish!r}")
            truncated.append(finish == "length")
    else:  # no pinned stop set (in-process tests): only a full-length completion counts as truncated
        truncated = [len(a) == batch.sampling.max_new_tokens and c.finish_reason == "length"
                     for c, a in zip(group.completions, arrays)]
    hopeless = [bounds is not None and tasks.impossible(reward, floor, answer) for floor in floors]
    if any(hopeless):  # only `exact`, a simple reward scored one completion at a time: skip the hopeless ones
        rewards = [0.0 if h else tasks.score(reward, tokenizer.decode(a.tolist(), skip_special_tokens=True), answer)
                   for h, a in zip(hopeless, arrays)]
        per_reward = {reward: list(rewards)}
    else:  # the volunteer scored with this same call (client/rollout.py): one group, its texts, its ids
        comps = [a.tolist() for a in arrays]  # reward functions get TRL's completion_ids: lists of ints
        scored = tasks.score_group(lease.prompt, [tokenizer.decode(t, skip_special_tokens=True) for t in comps],
                                   comps, version=batch.adapter_version)
        rewards, per_reward = scored.rewards, scored.per_reward
    for c, expected in zip(group.completions, rewards):
        if abs(expected - c.reward) > REWARD_TOLERANCE:
            raise ProtocolError(RejectCode.REWARD_MISMATCH, f"claimed {c.reward:.4f}, recomputed {expected:.4f}")
    # The learner gets arrays (int32 ids, float32 logprobs: views of the verified payload), not 64 x 512 Python
    # ints and floats per batch — those lists were a third of ingest's time (docs/benchmarks.md).
    lps = [c.logprob_array() for c in group.completions]
    return TrainGroup(prompt_ids, arrays, lps, rewards, batch.adapter_version, batch.sampling.temperature,
                      batch.client_name, truncated=truncated, per_reward=per_reward, **sampling_knobs(batch.sampling))
