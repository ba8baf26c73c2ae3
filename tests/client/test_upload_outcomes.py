"""What each upload answer does to a spooled batch (client/delivery.py `flush`), against a scripted
coordinator that opens every envelope for real: a fresh seal per attempt (so an outage of any length
never makes a batch EXPIRED), a too-large batch split or quarantined instead of blocking the line, busy
answers keeping the batch, final refusals deleting it (counted), a coordinator bug not blocking the rest."""

from __future__ import annotations

import time

import numpy as np
import pytest

from asyncrl.client.delivery import MAX_INTERNAL_RETRIES
from asyncrl.client.worker import Volunteer, VolunteerConfig
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity

COORDINATOR = Identity.from_seed(bytes(range(32)))


class ScriptedCoordinator:
    """Stands in for the SwarmNode: opens each sealed batch as the coordinator would (signature, audience,
    timestamp window) and answers what `answer(batch, opened)` says; a ProtocolError is a transport refusal."""

    def __init__(self, answer, window_s: float = 5.0):
        self.answer = answer
        self.window_s = window_s
        self.seen: list[envelope.Opened] = []

    def call(self, peer_id, name, request, *, max_response_bytes, timeout=30.0):
        opened = envelope.open_envelope(request, max_bytes=1 << 30, expected_kind="rollout_batch",
                                        expected_audience=COORDINATOR.public_key, window_s=self.window_s)
        self.seen.append(opened)
        batch = messages.decode(opened.payload, messages.RolloutBatch, max_bytes=1 << 30)
        code = self.answer(batch, opened, request)
        if isinstance(code, ProtocolError):
            raise code
        return messages.encode(messages.Ack(batch_id=opened.payload_id, accepted=code in (None, "DUPLICATE_BATCH"),
                                            code=code))


def group(i: int, tokens: int = 8) -> messages.RolloutGroup:
    comp = messages.Completion(np.arange(tokens, dtype="<i4").tobytes(), np.full(tokens, -1.0, "<f4").tobytes(), 0.5,
                               "length")
    return messages.RolloutGroup(f"lease-{i}", f"p-{i}", np.arange(4, dtype="<i4").tobytes(), (comp,) * 4)


def batch(n_groups: int, first: int = 0, tokens: int = 8) -> messages.RolloutBatch:
    return messages.RolloutBatch(run_id="r", adapter_version=0, client_name="v", sampling=messages.SamplingParams(),
                                 groups=tuple(group(first + i, tokens) for i in range(n_groups)), generated_at=1.0)


@pytest.fixture
def volunteer(tmp_path):
    addr = f"/ip4/127.0.0.1/tcp/1/p2p/{COORDINATOR.peer_id}"
    v = Volunteer(VolunteerConfig(address=addr, data_dir=tmp_path / "v", display="quiet"))
    v.run_id = "r"
    return v


def spool(v: Volunteer, b: messages.RolloutBatch) -> bytes:
    ids = v._spool(b)
    assert len(ids) == 1
    return ids[0]


def test_every_attempt_is_sealed_afresh_so_an_outage_never_expires_a_batch(volunteer):
    v = volunteer
    bid = spool(v, batch(1))
    import os

    old = time.time() - 3600  # spooled an hour ago, far outside the coordinator's 5 s window
    os.utime(v.outbox.path / f"{bid.hex()}.payload", (old, old))
    down = ScriptedCoordinator(lambda b, o, r: ProtocolError(RejectCode.RATE_LIMITED, "busy"))
    v.node = down
    v.flush()
    assert v.outbox.pending() == [bid] and v.status.batches_deferred == {"RATE_LIMITED": 1}
    up = ScriptedCoordinator(lambda b, o, r: None)
    v.node = up
    v.flush()
    assert v.outbox.pending() == [] and v.status.batches_acked == 1
    assert down.seen[0].nonce != up.seen[0].nonce and abs(up.seen[0].timestamp - time.time()) < 5
    assert up.seen[0].payload_id == bid  # same batch id: the coordinator's dedupe is unchanged


def test_an_expired_answer_keeps_the_batch(volunteer):
    v = volunteer
    bid = spool(v, batch(1))
    v.node = ScriptedCoordinator(lambda b, o, r: "EXPIRED")
    v.flush()
    assert v.outbox.pending() == [bid] and v.status.batches_deferred == {"EXPIRED": 1}


def test_a_too_large_batch_is_split_and_never_blocks_the_line(volunteer):
    v = volunteer
    cap = len(messages.encode(batch(2))) + 400  # two groups fit under the transport's cap, four do not

    def transport(b, opened, request):
        if len(request) > cap:
            return ProtocolError(RejectCode.PAYLOAD_TOO_LARGE, f"{len(request)} bytes > cap {cap}")
        return None

    big = spool(v, batch(4))
    after = spool(v, batch(1, first=10))
    v.node = coordinator = ScriptedCoordinator(transport)
    v.flush()  # a restart's first flush: never raises, never stops at the big one
    v.flush()  # the halves were spooled behind the others
    assert v.outbox.pending() == [] and v.status.batches_split == 1 and v.status.batches_quarantined == 0
    delivered = sorted(g.lease_id for o in coordinator.seen if len(o.payload) < cap
                       for g in messages.decode(o.payload, messages.RolloutBatch, max_bytes=1 << 30).groups)
    assert delivered == sorted([f"lease-{i}" for i in range(4)] + ["lease-10"])  # nothing lost
    assert big not in [o.payload_id for o in coordinator.seen if len(o.payload) < cap] and after


def test_a_single_group_over_the_cap_is_quarantined_not_deleted(volunteer):
    v = volunteer
    huge = spool(v, batch(1, tokens=4000))
    small = spool(v, batch(1, first=5))
    v.node = ScriptedCoordinator(lambda b, o, r: ProtocolError(RejectCode.PAYLOAD_TOO_LARGE, "cap") if len(r) > 20000
                                 else None)
    v.flush()
    assert v.outbox.pending() == [] and v.status.batches_acked == 1 and v.status.batches_quarantined == 1
    assert [n["batch_id"] for n in v.outbox.quarantined()] == [huge.hex()] and small
    assert (v.outbox.quarantine_path / f"{huge.hex()}.payload").exists()


def test_grants_tell_the_cap_so_batches_are_split_before_spooling(volunteer):
    v = volunteer
    v.max_batch_bytes = len(messages.encode(batch(2))) + 300
    ids = v._spool(batch(8))
    assert len(ids) == 4 and v.status.batches_split == 3
    assert all(len(v.outbox.read(b)) + 256 <= v.max_batch_bytes for b in ids)


def test_final_refusals_delete_and_count_a_coordinator_bug_does_not_block(volunteer):
    v = volunteer
    buggy = spool(v, batch(1, first=0))
    stale = spool(v, batch(1, first=1))
    fine = spool(v, batch(1, first=2))

    def answer(b, opened, request):
        return {"lease-0": "INTERNAL", "lease-1": "STALE_VERSION"}.get(b.groups[0].lease_id)

    v.node = ScriptedCoordinator(answer)
    v.flush()
    assert set(v.outbox.pending()) == {buggy} and v.status.batches_rejected == {"STALE_VERSION": 1}
    assert v.status.batches_acked == 1 and fine not in v.outbox.pending() and stale not in v.outbox.pending()
    for _ in range(MAX_INTERNAL_RETRIES):
        v.flush()
    assert v.outbox.pending() == [] and v.status.batches_quarantined == 1  # set aside, not deleted
    assert v.outbox.quarantined()[0]["batch_id"] == buggy.hex()


def test_not_admitted_quarantines_and_stops(volunteer):
    v = volunteer
    spool(v, batch(1))
    spool(v, batch(1, first=1))
    v.node = ScriptedCoordinator(lambda b, o, r: ProtocolError(RejectCode.NOT_ALLOWED, "banned"))
    v.flush()
    assert v.status.batches_quarantined == 1 and len(v.outbox.pending()) == 1  # the second waits
