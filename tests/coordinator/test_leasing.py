"""LeaseDesk in-process (no network): sealed LeaseRequest bytes in, LeaseGrant bytes or a reject code out;
back-pressure bounds in-flight work; access control runs before and after the signature."""

from __future__ import annotations

import pytest

from asyncrl.coordinator.access import AccessControl, AccessPolicy
from asyncrl.coordinator.leasing import LeaseDesk, LeasePolicy
from asyncrl.coordinator.taskboard import TaskBoard
from asyncrl.models import tinymodel
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity
from asyncrl.tasks.sources import open_source

RUN = "desk-test"


class QueueDepth:
    """The two things the desk asks of ingest: how much is queued, and what sampling leases promise."""

    def __init__(self):
        self.groups = 0
        self.sampling = messages.SamplingParams(temperature=1.0, max_new_tokens=8)
        self.names: dict[bytes, str] = {}

    def queued(self) -> int:
        return self.groups

    def note_client(self, signer: bytes, name: str = "") -> None:
        self.names[signer] = name


@pytest.fixture(scope="module")
def tokenizer():
    return tinymodel.build_tokenizer()


def make_desk(tokenizer, *, inflight=6, per_lease=4, access=None):
    coordinator = Identity.generate()
    board = TaskBoard(open_source("repeat", seed=1), lease_timeout_s=60, max_leases_per_client=8)
    ingest = QueueDepth()
    desk = LeaseDesk(LeasePolicy(run_id=RUN, group_size=4, prompts_per_lease=per_lease, max_inflight_groups=inflight,
                                 window_s=300), audience=coordinator.public_key, board=board, ingest=ingest,
                     access=access or AccessControl(AccessPolicy()), tokenizer=tokenizer, current_version=lambda: 7)
    return desk, coordinator, board, ingest


def request(volunteer: Identity, coordinator: Identity, want: int, *, run=RUN, name="alice") -> bytes:
    payload = messages.encode(messages.LeaseRequest(run_id=run, max_prompts=want, adapter_version=7, client_name=name))
    return envelope.seal(volunteer, "lease_request", payload, audience=coordinator.public_key)


def grant(desk, data: bytes) -> messages.LeaseGrant:
    return messages.decode(desk.handle(data, peer="p"), messages.LeaseGrant, max_bytes=1 << 20)


def test_grants_carry_the_prompt_tokens_sampling_and_version(tokenizer):
    desk, coordinator, board, ingest = make_desk(tokenizer)
    alice = Identity.generate()
    g = grant(desk, request(alice, coordinator, 3))
    assert g.run_id == RUN and g.current_version == 7 and len(g.leases) == 3
    for lease in g.leases:
        assert lease.group_size == 4 and lease.sampling == ingest.sampling
        ids = list(memoryview(lease.prompt_token_ids).cast("i"))
        assert tokenizer.decode(ids) == lease.prompt
    assert board.counts()["outstanding"] == 3 and ingest.names[alice.public_key] == "alice"


def test_back_pressure_counts_queued_and_outstanding_groups(tokenizer):
    desk, coordinator, board, ingest = make_desk(tokenizer, inflight=6, per_lease=4)
    alice, bob = Identity.generate(), Identity.generate()
    assert len(grant(desk, request(alice, coordinator, 4)).leases) == 4  # capped per lease
    ingest.groups = 1
    assert len(grant(desk, request(bob, coordinator, 4)).leases) == 1  # 6 - 4 outstanding - 1 queued
    assert grant(desk, request(bob, coordinator, 4)).leases == ()  # full: an empty grant, not an error
    assert desk.room() == 0


def test_wrong_audience_run_and_garbage_are_refused_with_their_codes(tokenizer):
    desk, coordinator, _, _ = make_desk(tokenizer)
    alice, other = Identity.generate(), Identity.generate()
    with pytest.raises(ProtocolError) as exc:
        desk.handle(request(alice, other, 2), peer="p")  # sealed for another coordinator
    assert exc.value.code == RejectCode.WRONG_AUDIENCE
    with pytest.raises(ProtocolError) as exc:
        desk.handle(request(alice, coordinator, 2, run="other-run"), peer="p")
    assert exc.value.code == RejectCode.WRONG_RUN
    with pytest.raises(ProtocolError) as exc:
        desk.handle(b"\x00" * 200, peer="p")
    assert exc.value.code == RejectCode.MALFORMED


def test_a_banned_key_is_refused_before_anything_is_leased(tokenizer):
    access = AccessControl(AccessPolicy(max_strikes=1))
    desk, coordinator, board, _ = make_desk(tokenizer, access=access)
    mallory = Identity.generate()
    access.on_reject(RejectCode.REWARD_MISMATCH, signer=mallory.public_key)
    with pytest.raises(ProtocolError) as exc:
        desk.handle(request(mallory, coordinator, 2), peer="p")
    assert exc.value.code == RejectCode.NOT_ALLOWED
    assert board.counts()["outstanding"] == 0
