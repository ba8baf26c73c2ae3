"""A volunteer SIGKILLed while holding leases: they expire, its prompts go to the other volunteer, training
continues, and the task board's books balance (every leased prompt trained, re-leased or dropped)."""

from __future__ import annotations

import json
import signal

import pytest

from asyncrl.protocol import messages
from asyncrl.runlog import read_events

from tests.conftest import wait_for, wait_for_join
from tests.harness import with_fault

pytestmark = pytest.mark.integration


def _events(run, kind):
    return read_events(run, kind)


def test_killed_volunteers_prompts_are_released_and_trained(procs, tmp_path):
    run = tmp_path / "run"
    coord = procs.start("coordinator", ["-m", "asyncrl.coordinator.cli", "run", "--model", "tiny", "--no-dashboard",
                                        "--run-dir", str(run), "--max-steps", "0", "--threads", "1",
                                        "--groups-per-step", "2", "--min-groups", "1", "--max-wait-s", "1",
                                        "--prompts-per-lease", "2", "--group-size", "8", "--lease-timeout-s", "15",
                                        "--max-staleness", "-1"])
    join = wait_for_join(run, 180)
    args = ["-m", "asyncrl.client.cli", "join", join, "--threads", "1", "--prompts-per-batch", "2",
            "--fixed-lease-size"]  # the victim holds two leases from its first grant on (no one-prompt probe)
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    (victim_dir / "HOLD_UPLOADS").write_text("its batches stay unsent until it is killed\n")
    # works on, uploads nothing (tests/fault_volunteer.py): its leases die with it
    victim_args = [*args, "--name", "victim", "--data-dir", str(victim_dir)]
    victim = procs.start("victim", with_fault(victim_args, "hold-uploads"))
    wait_for(lambda: any((victim_dir / "outbox").glob("*.payload")), 240, "the victim to finish generating")
    procs.signal(victim, signal.SIGKILL)
    victim.wait(10)
    spooled = [p.read_bytes() for p in (victim_dir / "outbox").glob("*.payload")]  # payloads: sealed at upload
    lost = {g.prompt_id for b in spooled for g in messages.decode_rollout_batch(b, max_bytes=1 << 20).groups}
    assert len(lost) == 2 * len(spooled) >= 2  # two prompts per batch, each batch unsent

    procs.start("survivor", [*args, "--name", "survivor", "--data-dir", str(tmp_path / "survivor")])

    def lost_prompts_trained() -> bool:  # answered by the survivor, and that batch went through a step
        trained = {i for e in _events(run, "step") for i in e["batch_ids"]}
        answered = {p: e for e in _events(run, "batch") for p in e["prompt_ids"]}
        return all(p in answered and answered[p]["client"] == "survivor" and answered[p]["batch_id"] in trained
                   for p in lost)

    wait_for(lost_prompts_trained, 400, "the killed volunteer's prompts to be re-leased and trained")
    wait_for(lambda: len(_events(run, "step")) >= 4, 200, "training to go on")
    coord.send_signal(signal.SIGTERM)  # the operator stops it: final checkpoint + summary
    assert coord.wait(120) == 0, coord.log_path.read_text()[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    leases = summary["leases"]
    assert leases["expired"] >= 2 and leases["released"] >= 2, leases
    assert summary["leases_balanced"], leases
