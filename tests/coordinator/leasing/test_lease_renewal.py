"""Lease renewal: a volunteer still working extends its leases (TaskBoard.renew via a LeaseRequest with
`renew`), up to lease_max_s after the grant; someone else's or an expired lease answers 0 s left."""

from __future__ import annotations

from asyncrl.coordinator.leasing.leasing import LeaseDesk, LeasePolicy
from asyncrl.coordinator.leasing.taskboard import LeaseRejected, TaskBoard
from asyncrl.coordinator.trust.access import AccessControl, AccessPolicy
from asyncrl.models import tinymodel
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity
from asyncrl.tasks.sources import open_source

ALICE, BOB = b"a" * 32, b"b" * 32
RUN = "renew-test"


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def make_board(clock, timeout=10.0, max_s=35.0):
    return TaskBoard(open_source("repeat", seed=3), lease_timeout_s=timeout, max_leases_per_client=8,
                     lease_max_s=max_s, clock=clock)


def test_renewed_lease_outlives_its_timeout_and_is_accepted():
    clock = FakeClock()
    b = make_board(clock)
    (lease,) = b.lease(ALICE, 1)
    for _ in range(3):  # 24 s of work, renewed every 8 s: never expires
        clock.t += 8
        left = b.renew([lease.lease_id], ALICE)
        assert left[lease.lease_id] == 10.0
    b.complete(lease.lease_id, ALICE)
    c = b.counts()
    assert (c["expired"], c["completed"], c["renewals"]) == (0, 1, 3)
    assert b.balanced(queued_groups=1)


def test_renewals_stop_at_lease_max_s_and_the_prompt_goes_back():
    clock = FakeClock()
    b = make_board(clock, timeout=10.0, max_s=35.0)
    (lease,) = b.lease(ALICE, 1)
    clock.t += 9
    assert b.renew([lease.lease_id], ALICE)[lease.lease_id] == 10.0
    clock.t += 9
    assert b.renew([lease.lease_id], ALICE)[lease.lease_id] == 10.0
    clock.t += 9  # 27 s after the grant: capped at granted_at + 35
    assert b.renew([lease.lease_id], ALICE)[lease.lease_id] == 8.0
    clock.t += 8.5
    assert b.renew([lease.lease_id], ALICE)[lease.lease_id] == 0.0  # gone: expired at the cap
    try:
        b.complete(lease.lease_id, ALICE)
        raise AssertionError("a lease past lease_max_s was accepted")
    except LeaseRejected:
        pass
    assert [l.prompt.prompt_id for l in b.lease(BOB, 1)] == [lease.prompt.prompt_id]
    assert b.counts()["expired"] == 1 and b.counts()["released"] == 1


def test_only_the_holder_renews_and_unknown_ids_answer_zero():
    clock = FakeClock()
    b = make_board(clock)
    (lease,) = b.lease(ALICE, 1)
    assert b.renew([lease.lease_id, "no-such-lease"], BOB) == {lease.lease_id: 0.0, "no-such-lease": 0.0}
    clock.t += 11  # BOB's renewal did not extend ALICE's lease
    assert b.renew([lease.lease_id], ALICE) == {lease.lease_id: 0.0}
    assert b.counts()["renewals"] == 0 and b.counts()["expired"] == 1


def test_renewal_only_request_through_the_desk_grants_nothing():
    tokenizer = tinymodel.build_tokenizer()
    coordinator, volunteer = Identity.generate(), Identity.generate()
    clock = FakeClock()
    board = make_board(clock, timeout=10.0, max_s=100.0)

    class Ingest:
        sampling = messages.SamplingParams(temperature=1.0, max_new_tokens=8)

        def queued(self):
            return 0

        def note_client(self, signer, name=""):
            pass

    desk = LeaseDesk(LeasePolicy(run_id=RUN, group_size=4, prompts_per_lease=2, max_inflight_groups=8, window_s=300),
                     audience=coordinator.public_key, board=board, ingest=Ingest(),
                     access=AccessControl(AccessPolicy()), tokenizer=tokenizer, current_version=lambda: 0)

    def ask(want, renew=()):
        req = messages.LeaseRequest(run_id=RUN, max_prompts=want, adapter_version=0, client_name="v", renew=renew)
        sealed = envelope.seal(volunteer, "lease_request", messages.encode(req), audience=coordinator.public_key)
        return messages.decode(desk.handle(sealed, peer="p"), messages.LeaseGrant, max_bytes=1 << 20)

    first = ask(2)
    ids = tuple(l.lease_id for l in first.leases)
    assert len(ids) == 2
    clock.t += 7
    again = ask(0, ids)
    assert again.leases == () and {r.lease_id: r.expires_in_s for r in again.renewed} == {i: 10.0 for i in ids}
    assert board.counts()["leased"] == 2 and board.counts()["renewals"] == 2
