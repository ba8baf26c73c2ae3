"""LeaseDesk in-process (no network): sealed LeaseRequest bytes in, LeaseGrant bytes or a reject code out;
back-pressure bounds in-flight work; access control runs before and after the signature."""

from __future__ import annotations

import pytest

from asyncrl.coordinator.leasing.leasing import LeaseDesk, LeasePolicy
from asyncrl.coordinator.leasing.taskboard import TaskBoard
from asyncrl.coordinator.trust.access import AccessControl, AccessPolicy
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
    """Ask as a real volunteer does: from its own peer id (a copy from another peer is charged to that peer)."""
    from asyncrl.protocol.identity import peer_id_from_public_key

    own = peer_id_from_public_key(data[4:36])
    return messages.decode(desk.handle(data, peer=own), messages.LeaseGrant, max_bytes=1 << 20)


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
    access.on_reject(RejectCode.MALFORMED, signer=mallory.public_key)
    with pytest.raises(ProtocolError) as exc:
        desk.handle(request(mallory, coordinator, 2), peer="p")
    assert exc.value.code == RejectCode.NOT_ALLOWED
    assert board.counts()["outstanding"] == 0


# ---- fair share and the waiting line (FairShare) ---------------------------------------------------


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def fair_desk(tokenizer, *, inflight=16, per_lease=4, clock=None):
    coordinator = Identity.generate()
    access = AccessControl(AccessPolicy(identity_rate_per_s=0, new_identity_rate_per_s=0))  # rates: not under test
    board = TaskBoard(open_source("repeat", seed=1), lease_timeout_s=60, max_leases_per_client=inflight)
    ingest = QueueDepth()
    desk = LeaseDesk(LeasePolicy(run_id=RUN, group_size=4, prompts_per_lease=per_lease, max_inflight_groups=inflight,
                                 window_s=300), audience=coordinator.public_key, board=board, ingest=ingest,
                     access=access, tokenizer=tokenizer, current_version=lambda: 7, clock=clock or Clock())
    return desk, coordinator, board, access


def held(board, key: bytes) -> int:
    return board.held_by_client().get(key, 0)


def test_a_crowd_of_fresh_hoarding_keys_cannot_starve_volunteers_with_a_record(tokenizer):
    clock = Clock()
    desk, coordinator, board, access = fair_desk(tokenizer, inflight=16, clock=clock)
    alice, bob = Identity.generate(), Identity.generate()
    for v in (alice, bob):
        access.record_accepted(v.public_key)  # a record of accepted batches
        grant(desk, request(v, coordinator, 1))  # active
    clock.t += 2  # the desk re-counts who is active
    crowd = [Identity.generate() for _ in range(60)]
    for k in crowd:  # they lease and never deliver
        grant(desk, request(k, coordinator, 4))
    clock.t += 2
    for k in crowd:
        grant(desk, request(k, coordinator, 4))
    hoarded = sum(held(board, k.public_key) for k in crowd)
    assert hoarded <= 16 * 0.25  # new_key_share of max_inflight_groups, all of them together
    for _ in range(3):  # alice and bob keep getting work: up to their share of the rest
        for v in (alice, bob):
            grant(desk, request(v, coordinator, 4))
    assert held(board, alice.public_key) >= 4 and held(board, bob.public_key) >= 4
    assert board.counts()["outstanding"] <= 16


def test_one_fast_volunteer_cannot_take_every_lease(tokenizer):
    clock = Clock()
    desk, coordinator, board, access = fair_desk(tokenizer, inflight=16, per_lease=4, clock=clock)
    vols = [Identity.generate() for _ in range(4)]
    for v in vols:
        access.record_accepted(v.public_key)
        grant(desk, request(v, coordinator, 1))
    clock.t += 2
    fast = vols[0]
    for _ in range(10):  # asks again and again before the others come back
        grant(desk, request(fast, coordinator, 4))
    assert held(board, fast.public_key) == 16 // 4  # its share: max_inflight / proven volunteers active
    for v in vols[1:]:
        assert len(grant(desk, request(v, coordinator, 4)).leases) == 3  # 1 held + 3 = its share of 4


def test_at_the_start_of_a_run_fresh_keys_share_all_of_the_room(tokenizer):
    desk, coordinator, board, _ = fair_desk(tokenizer, inflight=16)
    alice, bob = Identity.generate(), Identity.generate()
    assert len(grant(desk, request(alice, coordinator, 4)).leases) == 4  # nobody has a record yet
    assert len(grant(desk, request(bob, coordinator, 4)).leases) == 4


def test_empty_grants_carry_a_retry_after_that_grows_with_the_place_in_line(tokenizer):
    clock = Clock()
    desk, coordinator, board, access = fair_desk(tokenizer, inflight=4, per_lease=4, clock=clock)
    worker = Identity.generate()
    assert grant(desk, request(worker, coordinator, 4)).retry_after_s == 0.0  # work: no wait
    line = [Identity.generate() for _ in range(5)]
    access.record_accepted(line[3].public_key)  # a record: to the front of the line at once
    retries = [grant(desk, request(k, coordinator, 4)) for k in line]
    assert all(g.leases == () for g in retries)
    assert [g.retry_after_s for g in retries] == [2.0, 4.0, 6.0, 2.0, 10.0]  # idle_retry_s x (1 + place)
    clock.t += 2
    again = {i: grant(desk, request(line[i], coordinator, 4)).retry_after_s for i in (3, 0, 4)}
    assert again == {3: 2.0, 0: 4.0, 4: 10.0}  # the volunteer with a record first, the others keep their order
    wide = fair_desk(tokenizer, inflight=4)
    desk2, coord2, _, _ = wide
    grant(desk2, request(worker, coord2, 4))
    tail = [grant(desk2, request(Identity.generate(), coord2, 4)).retry_after_s for _ in range(40)]
    assert max(tail) == 30.0  # max_idle_retry_s


def test_a_long_line_of_idle_volunteers_asks_rarely(tokenizer):
    """Simulated minute of 32 idle volunteers that obey retry_after_s: few requests each, bounded in total."""
    clock = Clock()
    desk, coordinator, board, _ = fair_desk(tokenizer, inflight=4, clock=clock)
    grant(desk, request(Identity.generate(), coordinator, 4))  # the room is taken
    idle = [Identity.generate() for _ in range(32)]
    due = {i: clock.t for i in range(len(idle))}
    asked = 0
    end = clock.t + 60.0
    while clock.t < end:
        for i, t in due.items():
            if t <= clock.t:
                asked += 1
                due[i] = clock.t + grant(desk, request(idle[i], coordinator, 4)).retry_after_s
        clock.t += 0.25
    per_volunteer_per_min = asked / len(idle)
    assert per_volunteer_per_min <= 6.0, per_volunteer_per_min


def test_a_pausing_volunteer_returns_its_leases_and_they_go_to_someone_else_at_once(tokenizer):
    desk, coordinator, board, ingest = make_desk(tokenizer)
    alice, bob = Identity.generate(), Identity.generate()
    held = grant(desk, request(alice, coordinator, 3)).leases

    def give_back(who: Identity) -> bytes:
        back = messages.LeaseRequest(run_id=RUN, max_prompts=0, adapter_version=7, client_name="x",
                                     release=tuple(l.lease_id for l in held[1:]) + ("not-a-lease",))
        return envelope.seal(who, "lease_request", messages.encode(back), audience=coordinator.public_key)

    assert grant(desk, give_back(bob)).leases == ()  # bob cannot return alice's leases
    assert board.counts()["returned"] == 0
    assert grant(desk, give_back(alice)).leases == ()
    c = board.counts()
    assert (c["returned"], c["expired"], c["outstanding"]) == (2, 0, 1)
    again = grant(desk, request(bob, coordinator, 2)).leases
    assert {l.prompt_id for l in again} == {l.prompt_id for l in held[1:]}  # first in line, not after a timeout
    assert board.balanced(queued_groups=0)


def test_copies_of_a_lease_request_never_put_leases_on_its_key_before_or_after_a_restart(tokenizer):
    """mallory replays copies of alice's lease requests from her own peers, before alice has any accepted batch
    and again after a coordinator restart: alice's slots stay hers (the copies lease for their sender only, and
    cannot renew or release hers), every copy acts at most once, and the replay guard outlives the restart."""
    from asyncrl.protocol.identity import peer_id_from_public_key

    desk, coordinator, board, _ = make_desk(tokenizer, inflight=64, per_lease=8)
    alice = Identity.generate()
    own = peer_id_from_public_key(alice.public_key)
    sealed = request(alice, coordinator, 8)
    codes = []
    for i in range(8):  # copies of one request from 8 peer ids: one acts (for its sender), the rest are replays
        try:
            desk.handle(sealed, peer=f"mallory-{i}")
            codes.append("OK")
        except ProtocolError as exc:
            codes.append(exc.code.value)
    assert codes == ["OK"] + ["NONCE_REUSED"] * 7, codes
    assert alice.public_key not in board.held_by_client()  # nothing on her key
    mine = grant(desk, request(alice, coordinator, 8))
    assert len(mine.leases) == 8  # all of her slots
    ids = [l.lease_id for l in mine.leases]
    renew = messages.LeaseRequest(run_id=RUN, max_prompts=0, adapter_version=7, client_name="alice", release=tuple(ids))
    copy = envelope.seal(alice, "lease_request", messages.encode(renew), audience=coordinator.public_key)
    desk.handle(copy, peer="mallory-9")  # a copy of her release, sent by someone else: her leases stay out
    assert board.held_by_client()[alice.public_key] == 8

    # A coordinator restart: the lease desk's guard comes back from lease_replay.bin (TrustState).
    saved = desk.state_bytes()
    restarted, _, board2, _ = make_desk(tokenizer, inflight=64, per_lease=8)
    restarted.audience = coordinator.public_key
    restarted.load_state(saved)
    for peer in ("mallory-0", "mallory-10", own):
        with pytest.raises(ProtocolError) as exc:
            restarted.handle(sealed, peer=peer)
        assert exc.value.code is RejectCode.NONCE_REUSED
    assert board2.counts()["leased"] == 0


def test_a_proven_volunteer_is_never_put_behind_a_crowd_of_fresh_waiters(tokenizer):
    """23 fresh keys wait for room; alice (accepted batches) finds none either, again and again (each grant
    takes her out of the line): each time she is told to come back after idle_retry_s, not after the crowd."""
    clock = Clock()
    desk, coordinator, board, access = fair_desk(tokenizer, inflight=4, per_lease=4, clock=clock)
    alice = Identity.generate()
    access.record_accepted(alice.public_key)
    grant(desk, request(Identity.generate(), coordinator, 4))  # the room is taken
    crowd = [Identity.generate() for _ in range(23)]
    waits = []
    for round_ in range(4):
        for k in crowd:
            grant(desk, request(k, coordinator, 4))
        waits.append(grant(desk, request(alice, coordinator, 4)).retry_after_s)
        desk.fair.granted(alice.public_key)  # she got work meanwhile: out of the line, joins anew next time
        clock.t += 0.3 * (round_ + 1)  # before and after the desk re-counts
    assert waits == [desk.policy.idle_retry_s] * 4, waits
    grant(desk, request(alice, coordinator, 4))  # waiting now
    clock.t += 2  # re-counted
    crowd_waits = [grant(desk, request(k, coordinator, 4)).retry_after_s for k in crowd]
    assert min(crowd_waits) > desk.policy.idle_retry_s  # the fresh keys are behind her


def test_the_lease_replay_guard_is_written_with_the_trust_state_and_loaded_at_start(tokenizer, tmp_path):
    """What a restart reads back (coordinator/trust/trust_state.py): lease_replay.bin refuses a copy after the
    restart."""
    from asyncrl.coordinator.ingest.ingest import Ingest
    from asyncrl.coordinator.trust.trust_state import TrustState

    def hub(desk, board):
        ingest = Ingest(identity_public_key=desk.audience, run_id=RUN, board=board, tokenizer=None, vocab_size=64,
                        current_version=lambda: 0, max_batch_bytes=1 << 20, window_s=300.0)
        return TrustState(tmp_path, ingest=ingest, lease_desk=desk, out=lambda *_: None)

    desk, coordinator, board, _ = make_desk(tokenizer)
    alice = Identity.generate()
    sealed = request(alice, coordinator, 2)
    assert len(grant(desk, sealed).leases) == 2
    hub(desk, board).write()
    restarted, _, board2, _ = make_desk(tokenizer)
    restarted.audience = coordinator.public_key
    hub(restarted, board2).load()
    with pytest.raises(ProtocolError) as exc:
        grant(restarted, sealed)
    assert exc.value.code is RejectCode.NONCE_REUSED and board2.counts()["leased"] == 0


def test_a_reward_that_raised_on_a_volunteer_reaches_the_operator_with_the_returned_leases(tokenizer):
    desk, coordinator, board, ingest = make_desk(tokenizer)
    seen = []
    desk.on_reward_error = lambda client, error, leases: seen.append((client, error, leases))
    alice = Identity.generate()
    held = grant(desk, request(alice, coordinator, 2)).leases
    back = messages.LeaseRequest(run_id=RUN, max_prompts=0, adapter_version=7, client_name="alice",
                                 release=tuple(l.lease_id for l in held),
                                 reward_error="reward 'acc' failed: TypeError: acc() missing 1 required argument")
    assert grant(desk, envelope.seal(alice, "lease_request", messages.encode(back),
                                     audience=coordinator.public_key)).leases == ()
    assert seen == [("alice", "reward 'acc' failed: TypeError: acc() missing 1 required argument", len(held))]
    assert board.counts()["returned"] == len(held)  # the prompts go to someone else now, not at expiry
    quiet = grant(desk, request(alice, coordinator, 1))  # an ordinary request reports nothing
    assert quiet.leases and len(seen) == 1
