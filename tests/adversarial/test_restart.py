"""An attack whose defence must outlive a coordinator restart (issue 43, class 3), on a swarm of its own
(coordinator, alice, bob as processes) whose coordinator this module stops (SIGTERM: a final checkpoint) and
starts again with `--resume`, on the same port and key; alice and bob reconnect by themselves.

* **lease-request copies right after a restart**: lease requests signed by alice's key, as an observer on her
  path captures them (the test seals them with her key file while the coordinator is down, to stand in for that
  capture: a fresh capture she never delivered is the worst case, its nonce unspent), replayed from 3 peer ids
  of mallory's from the moment the coordinator is started again. access.bin keeps that alice delivers from her
  own peer, so every copy is refused and none leases on her key. After the restart window (until alice and bob
  each had a batch acked that they generated with a version the resumed coordinator published) the copies go on
  in every other window, interleaved with windows without them as in test_hostile.py's rows, for at least 6 pairs
  and until the windows without them counted MIN_ACKED acks: alice's and bob's acked batches per minute with the
  copies stay >= HONEST_RATIO of those without, and neither loses a batch. (Before the restart against after
  it cannot be interleaved, so that ratio would measure changes in the machine's load, not the attack.)

This module is its own xdist work unit (tests/conftest.py OWN_SWARM); its row goes to
tests/artifacts/adversarial_restart.json.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from asyncrl.protocol.errors import ProtocolError
from asyncrl.protocol.identity import Identity
from asyncrl.runlog import read_events

from tests.adversarial.swarm import (
    COORDINATOR_FLAGS,
    AttackRecord,
    Mallory,
    Swarm,
    own_rows,
    start_volunteers,
    wait_for,
)
from tests.adversarial.test_hostile import (
    PAUSE_S,
    assert_kept_pace,
    figures,
    honest_windows,
    load_average,
    sealed_request,
)
from tests.conftest import Procs, free_tcp_port, wait_for_join
from tests.harness import COORDINATOR

pytestmark = pytest.mark.integration

ARTIFACT_NAME = "adversarial_restart.json"
MIN_ACKED, MAX_PAIRS = 400, 18  # baseline acks to count before the ratio is read (test_hostile.honest_windows):
# quiet, alice and bob ack 350-750/min, so 6 pairs of 12 s count more than 400; beside two CPU hogs they acked
# ~30 per 12 s window, and a ratio of ~180 acks a phase (one window varying by ~25 %) read 0.75


@pytest.fixture(scope="module")
def restart_swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("adversarial-restart")
    procs = Procs(root)
    run = root / "run"
    args = [*COORDINATOR, "--model", "tiny", "--run-dir", str(run), "--port", str(free_tcp_port()),
            *COORDINATOR_FLAGS]
    coord = procs.start("coordinator", args)
    try:
        join = wait_for_join(run, 240, coord)
        honest = start_volunteers(procs, join, root, ("alice", "bob"), "--duty-cycle", "0.5")
        s = Swarm(root=root, run=run, join=join, coordinator_pid=coord.pid, honest=honest)
        s.procs, s.coordinator, s.args = procs, coord, args
        with own_rows(s, ARTIFACT_NAME, timeout=600):
            yield s
    finally:
        procs.reap()


def stop_coordinator(swarm: Swarm) -> None:
    """SIGTERM: it writes its final checkpoint and exits 0."""
    swarm.procs.signal(swarm.coordinator, signal.SIGTERM)
    assert swarm.coordinator.wait(180) == 0, swarm.coordinator.log_path.read_text()[-3000:]


def resume_coordinator(swarm: Swarm) -> None:
    swarm.coordinator = swarm.procs.start("coordinator-resumed", [*swarm.args, "--resume"])
    swarm.coordinator_pid = swarm.coordinator.pid


def back_on_the_resumed_lineage(swarm: Swarm, stopped_at: float) -> bool:
    """Whether every honest volunteer had a batch acked that it generated with a version the resumed coordinator
    published: the end of the restart window. Acks alone come sooner: a volunteer's batches of the version it
    held before the restart are acked and then dropped as too stale, in a burst (its outbox, then new work on
    that version until it fetched a newer one), so a window opened then measures the restart, not the attack."""
    resumed = [e["version"] for e in read_events(swarm.run, "resume") if e["t"] > stopped_at]
    if not resumed:
        return False
    fresh = {e["client"] for e in read_events(swarm.run, "batch") if e["t"] > stopped_at and e["version"] >= resumed[0]}
    return set(swarm.honest) <= fresh


@pytest.mark.timeout(1500)  # its own swarm's start, a coordinator restart and 12-36 windows of 12 s (MAX_PAIRS)
def test_copies_of_her_lease_requests_after_a_restart_never_lease_on_her_key(restart_swarm):
    swarm = restart_swarm
    mallory = Mallory(swarm)
    rec = swarm.results["lease-request copies after a restart"] = AttackRecord(
        "lease-request copies after a restart",
        "lease requests signed by alice's key (what an observer on her path captures, never delivered), replayed "
        "from 3 peer ids of mallory's from the moment the coordinator is started again with --resume",
        note="access.bin keeps that her requests come from her own peer: every copy is refused, none leases on her "
             "key; measured after the restart window (until alice and bob each had a batch acked that they generated "
             "with a version the resumed coordinator published)")
    try:
        rejected0 = swarm.honest_rejections()
        alice = Identity.load(swarm.honest["alice"] / "identity.key")
        senders = [mallory.new_node() for _ in range(3)]
        replayed: list[str] = []

        def replay_round():
            for sealed in captured:
                for node in senders:
                    try:
                        mallory.call("lease", sealed, node)
                        replayed.append("GRANTED")
                    except ProtocolError as exc:
                        replayed.append(exc.code.value)
                    except Exception:  # noqa: BLE001, S110 - the coordinator is down or starting: nothing answered
                        pass

        stopped_at = time.time()
        stop_coordinator(swarm)
        # captured just before the restart (the worst case: fresh, within the timestamp window, nonces unspent);
        # a round is 6 calls, as in test_hostile.py's copies row
        captured = [sealed_request(swarm, alice, 8) for _ in range(2)]
        resume_coordinator(swarm)
        stop = threading.Event()

        def replay_while_restarting():
            while not stop.is_set():
                replay_round()
                stop.wait(PAUSE_S)

        replayer = threading.Thread(target=replay_while_restarting, name="replay", daemon=True)
        replayer.start()  # from the moment it is started again
        try:
            wait_for(lambda: back_on_the_resumed_lineage(swarm, stopped_at), 600,
                     "alice and bob to have a batch acked that they generated with a version the resumed coordinator "
                     "published")  # the restart window ends
        finally:
            stop.set()
            replayer.join(120)
        back_at = time.time()
        # then the copies go on in every other window: interleaved with windows without them (the rows of
        # test_hostile.py), so a change in the machine's load hits both alike
        loads = [load_average()]
        w = honest_windows(swarm, replay_round, min_acked=MIN_ACKED, max_pairs=MAX_PAIRS)
        loads.append(load_average())
        serving = [e for e in read_events(swarm.run, "serving") if e["t"] > stopped_at]
        for c in replayed:
            rec.saw(c, rejected=c != "GRANTED")
        rec.note += f"; restart window {back_at - stopped_at:.0f} s"
        if serving:
            rec.note += f" (the resumed coordinator's handlers up {serving[0]['after_node_s']:.0f} s after its node)"
        rec.note += f"; {figures(w)} over {len(w['spans']) // 2} pairs of windows"
        rec.note += f"; load average {loads[0]} -> {loads[1]}"
        rec.honest_lost = swarm.honest_rejections() - rejected0
        assert "NOT_ALLOWED" in replayed, set(replayed)  # the copies reached the resumed coordinator's judgement
        assert "GRANTED" not in replayed, set(replayed)
        assert set(replayed) <= {"NOT_ALLOWED", "NONCE_REUSED", "EXPIRED", "RATE_LIMITED"}, set(replayed)
        assert_kept_pace(w)
        assert rec.honest_lost == 0, swarm.honest_view()
    finally:
        mallory.close()
