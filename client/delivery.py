"""Delivery: a finished batch from the outbox to the coordinator's ack (a mixin of the hub's `Volunteer`).

Owns the upload side of the volunteer: `_spool` writes a RolloutBatch payload to the outbox (split by groups
when it would exceed the coordinator's cap), `flush` uploads every spooled batch oldest first, each sealed
afresh (a fresh timestamp and nonce at every attempt), and `_settle` applies what the answer means for the
spooled copy (the table below, docs/client.md). An ack's coordinator-signed receipt is verified and kept in
the ledger (client/ledger.py) before the batch leaves the outbox. The pipeline's Uploader thread
(client/pipeline.py) runs `flush` when `_kick_uploads` wakes it and backs off by `_upload_failed`.

What an upload's answer does to the spooled batch: acked or duplicate -> deleted; busy / clock / deadline
(RETRY_LATER) -> kept, the flush stops and retries later; INTERNAL / UNSCORABLE (RETRY_BATCH) -> kept at the
back of the line, quarantined after MAX_INTERNAL_RETRIES; too large (SPLIT) -> split by groups, or
quarantined when it is one group; a coordinator that cannot take it at all (QUARANTINE: not admitted, other
run, other schema) -> quarantined; anything else (FINAL_REJECTS) -> deleted and counted.

It reads the hub's `outbox`, `ledger`, `node`, `identity`, `coordinator_peer_id`, `coordinator_key`,
`run_id`, `status`, `display`, `max_batch_bytes` (also learned here from a PAYLOAD_TOO_LARGE), and tells the
lease calls when a batch's leases were acked (`_measured`, client/lease_sizing.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from asyncrl.protocol import envelope, messages, receipts
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.swarm import streams
from asyncrl.swarm.streams import stream_name
from asyncrl.swarm.transport import TransportError

SEAL_OVERHEAD = 256  # envelope header + body framing around a payload (bytes, generous)
MAX_INTERNAL_RETRIES = 5  # a batch the coordinator keeps failing on (INTERNAL) is quarantined after this


def _codes(*codes: RejectCode) -> frozenset[str]:
    return frozenset(c.value for c in codes)


# What an upload's answer does to the spooled batch. Sealing happens at upload, so EXPIRED / NONCE_REUSED
# only mean "try again with a fresh seal" (a clock off by more than the window: say so, keep the batch).
RETRY_LATER = _codes(RejectCode.RATE_LIMITED, RejectCode.EXPIRED, RejectCode.NONCE_REUSED,
                     RejectCode.DEADLINE_EXCEEDED)  # keep it; stop this flush; back off
RETRY_BATCH = _codes(RejectCode.INTERNAL, RejectCode.UNSCORABLE)  # keep it at the back of the line; go on
QUARANTINE = _codes(RejectCode.NOT_ALLOWED, RejectCode.UNSUPPORTED_VERSION, RejectCode.WRONG_RUN,
                    RejectCode.WRONG_AUDIENCE)  # the coordinator could not judge it: set aside, never deleted
SPLIT = _codes(RejectCode.PAYLOAD_TOO_LARGE)  # split by groups and re-spool; one group: quarantine
# Everything else (STALE_VERSION, UNKNOWN_LEASE, REWARD_MISMATCH, ...) means the coordinator read the batch
# and refused it for good: the spooled copy is deleted and the code counted.
FINAL_REJECTS = frozenset(c.value for c in RejectCode) - RETRY_LATER - RETRY_BATCH - QUARANTINE - SPLIT - \
    _codes(RejectCode.DUPLICATE_BATCH)


@dataclass
class PendingAck:
    """A spooled batch's leases: when they were granted, how many prompts were tried (the sizer's sample)."""
    prompts: int
    granted_at: float
    measured: bool = False


class Delivery:
    def _kick_uploads(self) -> None:
        if self._uploader is not None:
            self._uploader.kick()
        else:
            self.flush()

    def _upload_failed(self, exc: Exception | None) -> float:
        """The uploader's back-off: a flush the coordinator deferred (None) or one that could not reach it."""
        if isinstance(exc, TransportError):
            return self._reconnect_wait(self._upload_retry, exc)
        if exc is not None:
            self.display.event("warning", f"upload failed: {exc.__class__.__name__}: {str(exc)[:300]}")
        return self._upload_retry.after_failure(exc)

    def _reconnect_wait(self, retry, exc: Exception) -> float:
        """How long to wait after `exc` (a TransportError) by its class (client/pacing.py ReconnectBackoff: a
        coordinator that answers but does not serve the stream yet is starting, and is retried within seconds),
        said on the display."""
        wait = retry.after_failure(exc)
        what = ("coordinator starting (it answers but serves no such stream yet)" if retry.last_class == "starting"
                else "coordinator unreachable")
        self.display.event("warning", f"{what} ({exc}); retrying in {wait:.1f}s", reconnect=retry.last_class)
        return wait

    def _spool(self, batch: messages.RolloutBatch) -> list[bytes]:
        """Write `batch` to the outbox (split by groups if it would exceed the coordinator's cap)."""
        payload = messages.encode(batch)
        cap = self.max_batch_bytes
        if cap and len(payload) + SEAL_OVERHEAD > cap and len(batch.groups) > 1:
            half = len(batch.groups) // 2
            self.status.batches_split += 1
            return (self._spool(msgspec.structs.replace(batch, groups=batch.groups[:half]))
                    + self._spool(msgspec.structs.replace(batch, groups=batch.groups[half:])))
        batch_id = self.outbox.put(payload)
        self.display.event("spooled", f"[{self.name}] batch {batch_id.hex()[:12]} spooled", batch_id=batch_id.hex(),
                           groups=len(batch.groups))
        return [batch_id]

    def flush(self) -> bool:
        """Upload every spooled batch, oldest first, each sealed afresh; stop early when the coordinator
        says "later" (busy, clock) and raise TransportError when it cannot be reached. True when it got
        through the outbox. One flush at a time (the uploader thread, or the engine thread at start and end)."""
        with self._flush_lock:
            sent = self.status.batches_sent
            try:
                for batch_id in self.outbox.pending():
                    payload = self.outbox.read(batch_id)
                    if payload is None:
                        continue
                    if not self._upload(batch_id, payload):
                        return False
                self._upload_retry.reset()
                return True
            finally:
                if self.status.batches_sent != sent and self._uploader is not None:
                    self._write_status()  # the engine thread writes it too, but may be waiting for work

    def _upload(self, batch_id: bytes, payload: bytes) -> bool:
        """One upload attempt; False = stop this flush (retry later)."""
        sealed = envelope.seal(self.identity, "rollout_batch", payload, audience=self.coordinator_key)
        try:
            raw = self.node.call(self.coordinator_peer_id, stream_name(self.run_id, streams.SUBMIT), sealed,
                                 max_response_bytes=64 * 1024)
            ack = messages.decode(raw, messages.Ack, max_bytes=64 * 1024)
            code, detail, receipt = (None if ack.accepted and ack.code is None else ack.code or "?"), ack.detail, \
                ack.receipt
            if ack.accepted and ack.code == RejectCode.DUPLICATE_BATCH.value:
                code = None  # the coordinator already has it (a lost ack's retry)
        except ProtocolError as exc:  # refused by the transport before ingest: too large, busy, banned peer
            code, detail, receipt = exc.code.value, exc.detail, b""
        self.status.batches_sent += 1
        return self._settle(batch_id, payload, code, detail, receipt)

    def _settle(self, batch_id: bytes, payload: bytes, code: str | None, detail: str, receipt: bytes = b"") -> bool:
        short = batch_id.hex()[:12]
        self._settled.set()
        if code is None:
            self.status.batches_acked += 1
            self._keep_receipt(batch_id, receipt)  # on disk before the batch leaves the outbox
            self.outbox.remove(batch_id)
            pending = self._awaiting_ack.pop(batch_id, None)
            if pending is not None and not pending.measured:  # the first part of a (split) batch to be acked
                pending.measured = True
                self._measured(pending.prompts, pending.granted_at)
            self._internal_failures.pop(batch_id, None)
            self.display.event("acked", f"[{self.name}] batch {short} acked", batch_id=batch_id.hex())
            return True
        if code in RETRY_LATER:
            self._count_code("batches_deferred", code)
            hint = " (is this machine's clock right?)" if code == RejectCode.EXPIRED.value else ""
            self.display.event("deferred", f"[{self.name}] batch {short} kept for later: {code} {detail}{hint}",
                               code=code, batch_id=batch_id.hex())
            return False
        if code in RETRY_BATCH:
            self._count_code("batches_deferred", code)
            failures = self._internal_failures[batch_id] = self._internal_failures.get(batch_id, 0) + 1
            if failures < MAX_INTERNAL_RETRIES:
                self.outbox.requeue(batch_id)  # the others go first
                return True
            code = f"{code}x{failures}"
        elif code in SPLIT:
            if self._split_spooled(batch_id, payload):
                return True
        if code == RejectCode.RUN_FINISHED.value:
            self.status.run_finished = True  # what is still spooled can no longer be trained: dropped, counted
        if code in FINAL_REJECTS:
            self._count_code("batches_rejected", code)
            self.outbox.remove(batch_id)
            self.display.event("rejected", f"[{self.name}] batch {short} rejected: {code} {detail}", code=code,
                               batch_id=batch_id.hex())
            return True
        where = self.outbox.quarantine(batch_id, code, detail)
        self._internal_failures.pop(batch_id, None)
        self.status.batches_quarantined += 1
        self.display.event("warning", f"[{self.name}] batch {short} quarantined in {where.parent} ({code} {detail}); "
                           "the coordinator cannot take it as it is", code=code, batch_id=batch_id.hex())
        return code != RejectCode.NOT_ALLOWED.value  # not admitted: the next batch would fare no better

    def _split_spooled(self, batch_id: bytes, payload: bytes) -> bool:
        """A spooled batch over the coordinator's cap: re-spool its groups as smaller batches (written
        before the original is removed, so a crash in between leaves duplicates, never a loss — the
        coordinator dedupes nothing here: it never accepted the big one). False when it is one group."""
        try:
            batch = messages.decode(payload, messages.RolloutBatch, max_bytes=len(payload))
        except ProtocolError:
            return False
        if len(batch.groups) < 2:
            return False
        half = len(batch.groups) // 2
        self.max_batch_bytes = min(self.max_batch_bytes or len(payload), len(payload))  # what we now know
        for part in (batch.groups[:half], batch.groups[half:]):
            self._spool(msgspec.structs.replace(batch, groups=part))
        self.outbox.remove(batch_id)
        self.status.batches_split += 1
        self.display.event("warning", f"[{self.name}] batch {batch_id.hex()[:12]} too large for the coordinator; "
                           "split in two", code=RejectCode.PAYLOAD_TOO_LARGE.value)
        return True

    def _keep_receipt(self, batch_id: bytes, sealed: bytes) -> None:
        if not sealed:
            self.status.receipts_missing += 1
            return
        try:
            receipt = receipts.open_receipt(sealed, coordinator_key=self.coordinator_key,
                                            volunteer_key=self.identity.public_key)
            if receipt.batch_id != batch_id or receipt.run_id != self.run_id:
                raise ProtocolError(RejectCode.MALFORMED, "receipt for another batch")
        except ProtocolError as exc:
            self.status.receipts_invalid += 1
            self.display.event("warning", f"receipt for batch {batch_id.hex()[:12]} not kept: {exc}",
                               code=exc.code.value)
            return
        if self.ledger.append(sealed):
            self.status.receipts += 1

