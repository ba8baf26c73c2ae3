"""Audits off the critical path (coordinator/trust/audit_worker.py): ingest acks a batch after the cheap checks and
its shadow-model audit runs afterwards on the audit worker; a batch reaches the learner's queue only once its
audit passed, a failed one is never trained, and a full audit queue refuses (RATE_LIMITED, retryable) rather
than dropping anything. Real keys, task board, journal, ingest and worker; the auditor is `GatedAuditor`,
whose verdicts the test scripts and whose audits wait on a gate the test opens (ordering by events, no clocks).
"""

from __future__ import annotations

import threading

import pytest
import torch

from asyncrl import tasks
from asyncrl.coordinator.checkpoint import untrained_ids
from asyncrl.coordinator.ingest.ingest import Ingest
from asyncrl.coordinator.ingest.journal import IngestJournal
from asyncrl.coordinator.leasing.taskboard import TaskBoard
from asyncrl.coordinator.trust.access import AccessControl, AccessPolicy
from asyncrl.models import tinymodel
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity

from tests.coordinator.ingest.test_ingest_commit import ALICE, COORD, SAMPLING, Clock, sealed

MALLORY = Identity.from_seed(bytes(range(2, 34)))
GATE_GUARD_S = 60.0  # only a hang guard: a gate still closed this long means the test already failed


class GatedAuditor:
    """Routes every batch to the shadow path (as an older claimed version is) and holds each audit until
    the test opens `gate`; batches signed by a key in `liars` fail it (LOGPROB_MISMATCH, struck)."""

    enabled = True
    device = torch.device("cpu")

    def __init__(self, liars=()):
        self.liars = {k.public_key for k in liars}
        self.gate = threading.Event()
        self.started = threading.Event()
        self.audited: list[bytes] = []
        self.gate_timed_out = False
        self.on_verdict = None  # the ingest's audit_verdict, as Auditor.attach wires it

    def route(self, signer, batch_id, version, groups, **_) -> str:
        return "queued"

    def audit_shadow(self, signer, batch_id, version, groups, **_) -> str:
        self.started.set()
        if not self.gate.wait(GATE_GUARD_S):
            self.gate_timed_out = True
        self.audited.append(batch_id)
        if signer in self.liars:
            err = ProtocolError(RejectCode.LOGPROB_MISMATCH, "made-up logprobs")
            err.strike = True
            raise err
        self.on_verdict(batch_id, signer, None, "audit")  # a pass is booked by the auditor, as Auditor._judge does
        return "passed"


@pytest.fixture(scope="module")
def tokenizer():
    return tinymodel.build_tokenizer()


def make(tokenizer, tmp_path, auditor, *, audit_queue=16, access=None):
    board = TaskBoard(tasks.get_task("repeat", 0), lease_timeout_s=60, max_leases_per_client=8, clock=Clock())
    journal = IngestJournal(tmp_path / "journal")
    ingest = Ingest(identity_public_key=COORD.public_key, run_id="r", board=board, tokenizer=tokenizer, vocab_size=64,
                    current_version=lambda: 0, max_batch_bytes=1 << 20, window_s=300, sampling=SAMPLING,
                    journal=journal, auditor=auditor, audit_queue=audit_queue, access=access)
    auditor.on_verdict = ingest.audit_verdict
    return ingest, board, journal


def drain(ingest) -> list:
    """Everything in the learner's queue now, taken and booked as trained as the learner loop does."""
    with ingest.queue.mutex:
        groups = sum(len(item.groups) for item in ingest.queue.queue)
    if not groups:
        return []
    items = ingest.take(groups, max_wait_s=GATE_GUARD_S, min_groups=groups, stop=threading.Event())
    ingest.board.mark_trained(sum(len(item.groups) for item in items))  # as the learner loop books a step
    return items


def test_a_submit_is_acked_without_waiting_for_its_audit(tokenizer, tmp_path):
    auditor = GatedAuditor()
    ingest, board, journal = make(tokenizer, tmp_path, auditor)
    try:
        ack = ingest.handle(sealed(ingest, tokenizer, board.lease(ALICE.public_key, 1)))
        # The ack is back while the audit is still held at its gate (the gate opens only below): the submit
        # did not wait for it. Nothing of the batch is trainable yet; it is durable and counted as pending.
        assert ack.accepted and not auditor.gate.is_set() and not auditor.audited
        assert auditor.started.wait(GATE_GUARD_S)  # the worker has it in hand, behind the gate
        assert drain(ingest) == [] and ingest.awaiting_audit() == {ack.batch_id}
        assert ack.batch_id in untrained_ids(ingest)  # a checkpoint now counts it as not trained
        entry = [e for e in journal.entries() if e.batch_id == ack.batch_id]
        assert entry and all(g.audit for g in entry[0].groups)  # a --resume would audit it before training it
        assert [v["audit"] for v in ingest.verdicts if v["code"] == "ACCEPTED"] == ["queued"]

        auditor.gate.set()
        assert ingest.audits.wait_idle(GATE_GUARD_S)
        trained = drain(ingest)
        assert [b.batch_id for b in trained] == [ack.batch_id] and not any(g.audit for g in trained[0].groups)
        assert [v["code"] for v in ingest.verdicts] == ["ACCEPTED", "AUDIT_PASSED"] and not auditor.gate_timed_out
        assert ingest.awaiting_audit() == set() and board.balanced(ingest.queued_groups)
    finally:
        auditor.gate.set()
        ingest.close()


def test_a_batch_that_fails_its_audit_is_never_trained(tokenizer, tmp_path):
    auditor = GatedAuditor(liars=[MALLORY])
    access = AccessControl(AccessPolicy(max_strikes=3))
    ingest, board, journal = make(tokenizer, tmp_path, auditor, access=access)
    try:
        liar = ingest.handle(sealed(ingest, tokenizer, board.lease(MALLORY.public_key, 1), who=MALLORY))
        honest = ingest.handle(sealed(ingest, tokenizer, board.lease(ALICE.public_key, 1)))
        assert liar.accepted and honest.accepted  # the audit's verdict comes after the ack
        auditor.gate.set()
        assert ingest.audits.wait_idle(GATE_GUARD_S)
        trained = drain(ingest)
        assert [b.batch_id for b in trained] == [honest.batch_id]  # the liar's batch never reaches the learner
        assert {e.batch_id for e in journal.entries()} == {honest.batch_id}  # nor a --resume
        codes = {v["batch_id"]: v["code"] for v in ingest.verdicts if v["stage"] == "audit"}
        assert codes == {liar.batch_id.hex(): "LOGPROB_MISMATCH", honest.batch_id.hex(): "AUDIT_PASSED"}
        assert access.strikes(MALLORY.public_key) == 1 and access.strikes(ALICE.public_key) == 0  # struck as today
        assert board.counts()["dropped"] == 1 and board.balanced(ingest.queued_groups)
    finally:
        auditor.gate.set()
        ingest.close()


def test_a_full_audit_queue_refuses_and_loses_nothing(tokenizer, tmp_path):
    auditor = GatedAuditor()
    ingest, board, journal = make(tokenizer, tmp_path, auditor, audit_queue=2)
    try:
        batches = [sealed(ingest, tokenizer, board.lease(ALICE.public_key, 1)) for _ in range(3)]
        first, second = ingest.handle(batches[0]), ingest.handle(batches[1])
        assert first.accepted and second.accepted
        refused = ingest.handle(batches[2])  # two held, their audits at the gate: no room for a third
        assert not refused.accepted and refused.code == RejectCode.RATE_LIMITED.value  # retryable: it stays spooled
        assert len(journal) == 2 and board.counts()["dropped"] == 0

        auditor.gate.set()
        assert ingest.audits.wait_idle(GATE_GUARD_S)
        again = ingest.handle(batches[2])  # the volunteer's retry of the very same bytes (its nonce was not spent)
        assert again.accepted
        assert ingest.audits.wait_idle(GATE_GUARD_S)
        trained = {b.batch_id for b in drain(ingest)}
        assert trained == {first.batch_id, second.batch_id, again.batch_id}  # every honest batch trained once
        assert board.balanced(ingest.queued_groups) and ingest.audits.status()["max_held"] == 2
    finally:
        auditor.gate.set()
        ingest.close()
