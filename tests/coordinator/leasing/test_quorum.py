"""--wait-for-volunteers N (coordinator/leasing/quorum.py): distinct keys are counted, nothing is leased before N are
in, and under --sync a volunteer that waited is live in the first round, so that round waits for its batch."""

from __future__ import annotations

import threading

from asyncrl.coordinator.ingest.ingest import Ingest
from asyncrl.coordinator.leasing.leasing import LeaseDesk, LeasePolicy
from asyncrl.coordinator.leasing.quorum import VolunteerQuorum
from asyncrl.coordinator.leasing.sync_round import SyncRound
from asyncrl.coordinator.leasing.taskboard import TaskBoard
from asyncrl.coordinator.operator.admin import format_status
from asyncrl.coordinator.trust.access import AccessControl, AccessPolicy
from asyncrl.models import tinymodel
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity, fingerprint
from asyncrl.tasks.sources import open_source

from .test_sync_round import StopAfter, deliver

RUN = "quorum-test"


class EventLog:
    """Collects what the quorum reports (RunLog.write-shaped)."""

    def __init__(self):
        self.events: list[tuple[str, dict]] = []

    def __call__(self, event: str, **fields) -> None:
        self.events.append((event, fields))

    def kinds(self) -> list[str]:
        return [e for e, _ in self.events]


def test_the_quorum_counts_distinct_keys_and_opens_once():
    log = EventLog()
    q = VolunteerQuorum(2, on_event=log)
    q.start()
    alice, bob, carol = b"a" * 32, b"b" * 32, b"c" * 32
    assert q.status() == {"needed": 2, "joined": 0}
    assert not q.admit(alice, "alice")
    assert not q.admit(alice, "alice-again")  # the same key under another name counts once
    assert q.status() == {"needed": 2, "joined": 1}
    assert q.admit(bob, "bob") and q.ready.is_set() and q.status() is None
    assert q.admit(carol, "carol")  # open for good
    assert log.kinds() == ["waiting_for_volunteers", "volunteer_in", "volunteer_in", "volunteers_ready"]
    assert log.events[1][1]["fingerprint"] == fingerprint(alice) and log.events[-1][1]["names"] == ["alice", "bob"]


def test_zero_waits_for_nobody_and_a_stop_ends_the_wait():
    log = EventLog()
    q = VolunteerQuorum(0, on_event=log)
    q.start()
    assert q.status() is None and q.wait(threading.Event()) and log.events == []
    stop = threading.Event()
    stop.set()
    assert VolunteerQuorum(1).wait(stop, poll_s=0.001) is False


def _desk(*, sync: bool, needed: int):
    coordinator = Identity.generate()
    board = TaskBoard(open_source("repeat", seed=1), lease_timeout_s=60, max_leases_per_client=8)
    ingest = Ingest(identity_public_key=coordinator.public_key, run_id=RUN, board=board, tokenizer=None,
                    vocab_size=64, current_version=lambda: 0, max_batch_bytes=1 << 20, window_s=300.0,
                    sampling=messages.SamplingParams(temperature=1.0, max_new_tokens=8))
    rnd = SyncRound(ingest, board, live_s=60.0) if sync else None
    desk = LeaseDesk(LeasePolicy(run_id=RUN, group_size=2, prompts_per_lease=2, max_inflight_groups=16, window_s=300),
                     audience=coordinator.public_key, board=board, ingest=ingest,
                     access=AccessControl(AccessPolicy()), tokenizer=tinymodel.build_tokenizer(),
                     current_version=lambda: 0, sync_round=rnd, quorum=VolunteerQuorum(needed))
    return desk, coordinator, board, ingest, rnd


def _grant(desk, coordinator, volunteer: Identity, name: str) -> messages.LeaseGrant:
    payload = messages.encode(messages.LeaseRequest(run_id=RUN, max_prompts=2, adapter_version=0, client_name=name))
    sealed = envelope.seal(volunteer, "lease_request", payload, audience=coordinator.public_key)
    return messages.decode(desk.handle(sealed, peer=volunteer.peer_id), messages.LeaseGrant, max_bytes=1 << 20)


def _ask(desk, coordinator, volunteer: Identity, name: str) -> tuple:
    return _grant(desk, coordinator, volunteer, name).leases


def test_no_lease_is_granted_until_the_quorum_is_in():
    desk, coordinator, board, ingest, _ = _desk(sync=False, needed=2)
    alice, bob = Identity.generate(), Identity.generate()
    waiting = _grant(desk, coordinator, alice, "alice")
    assert waiting.leases == () and waiting.retry_after_s == desk.policy.idle_retry_s  # asks again soon
    assert _ask(desk, coordinator, alice, "alice") == ()  # asking twice does not make a quorum
    assert board.counts()["leased"] == 0
    assert len(_ask(desk, coordinator, bob, "bob")) == 2  # the second key opens it
    assert len(_ask(desk, coordinator, alice, "alice")) == 2
    assert desk.quorum.status() is None


def test_under_sync_the_first_round_waits_for_the_volunteer_that_waited():
    desk, coordinator, board, ingest, rnd = _desk(sync=True, needed=2)
    alice, bob = Identity.generate(), Identity.generate()
    assert _ask(desk, coordinator, alice, "alice") == ()  # waiting: refused, but seen
    bob_leases = _ask(desk, coordinator, bob, "bob")
    assert len(bob_leases) == 2
    deliver(ingest, board, bob.public_key, bob_leases, 0)
    assert rnd.take(0, StopAfter(20), poll_s=0.005) == []  # alice is live and owes this round's batch
    alice_leases = _ask(desk, coordinator, alice, "alice")
    assert len(alice_leases) == 2
    deliver(ingest, board, alice.public_key, alice_leases, 0)
    got = rnd.take(0, StopAfter(1000), poll_s=0.005)
    assert {x.signer for x in got} == {fingerprint(alice.public_key), fingerprint(bob.public_key)}


def test_status_shows_the_wait():
    snap = {"run": {"run_id": "r", "model": "tiny", "fingerprint": "f", "uptime_s": 3.0, "join_command": "j",
                    "max_steps": 6, "dashboard_url": None},
            "learner": {"version": 0, "steps": 0, "waiting_for_volunteers": {"needed": 2, "joined": 1}},
            "stats": {"publishes": [], "throughput": {"rollouts_per_s": 0.0, "steps_per_min": 0.0}},
            "leases": {}, "volunteers": [], "time": 3.0}
    assert "waiting for 1/2 volunteers" in format_status(snap)
    snap["learner"]["waiting_for_volunteers"] = None
    assert "waiting" not in format_status(snap)
