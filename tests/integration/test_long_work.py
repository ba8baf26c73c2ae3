"""Long work does not break the swarm (issue 14): a slow honest volunteer whose every work outlasts the
lease timeout keeps its leases by renewing them, and every batch it sends is accepted; a volunteer whose
engine context is too small for any prompt abandons those leases and stays alive, while the prompts expire
back to the queue and are trained from the other volunteer. In the same swarm a polite volunteer
(`--only-when-idle`, issue 17) paused by `asyncrl-client pause` in the middle of a lease returns the
prompts it has not started (they are not left to expire) and, resumed, works again. The lease books
balance."""

from __future__ import annotations

import json
import signal

import pytest

from asyncrl.client import cli as client_cli

from tests.conftest import wait_for
from tests.harness import start_coordinator, start_volunteer

pytestmark = pytest.mark.integration

SLOW_S = 5.0       # each work of the slow volunteer takes this much longer than its generation...
TIMEOUT_S = 2.0    # ...which is more than twice the lease timeout


def _status(path):
    try:
        return json.loads((path / "status.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def test_slow_honest_groups_renew_and_too_long_prompts_cost_only_their_lease(procs, tmp_path):
    run = tmp_path / "run"
    started = start_coordinator(procs, run, groups_per_step=2, min_groups=1, max_wait_s=1, prompts_per_lease=2,
                                group_size=4, lease_timeout_s=TIMEOUT_S, max_staleness=-1,
                                # room for carol's whole 2-prompt lease beside the others' (fair share)
                                max_inflight_groups=8, new_key_share=1.0)
    coord, join = started.proc, started.join

    def volunteer(name, data, **opts):
        return start_volunteer(procs, join, data, name=name, prompts_per_batch=2, json_logs=True, **opts)

    slow_dir, small_dir = tmp_path / "slow", tmp_path / "small"
    slow = volunteer("slow", slow_dir, fault=f"slow-generate:{SLOW_S}", max_batches=3)
    # an engine context of 8 tokens: no prompt + max_new_tokens fits, every lease is too long for it
    small = volunteer("small", small_dir, max_model_len=8)

    # polite: only the pause command counts (no user, any CPU load); 4 s per prompt leaves time to pause mid-lease
    carol_dir = tmp_path / "carol"
    carol = volunteer("carol", carol_dir, fault="slow-prompt:4", fixed_lease_size=True, only_when_idle=True,
                      user_idle_s=0, idle_max_cpu=1.0)
    wait_for(lambda: (_status(carol_dir) or {}).get("lease_progress") == [0, 2], 300, "carol on her lease's first prompt")
    assert client_cli.main(["pause", "--data-dir", str(carol_dir)]) == 0  # in-process: no interpreter start-up to wait for
    wait_for(lambda: (_status(carol_dir) or {}).get("state") == "paused", 120, "carol paused")
    paused = _status(carol_dir)
    assert paused["leases_returned"] == 1, paused  # the prompt she had not started: handed back, not left to expire
    assert client_cli.main(["resume", "--data-dir", str(carol_dir)]) == 0
    wait_for(lambda: (_status(carol_dir) or {}).get("batches_acked", 0) > paused["batches_acked"], 300, "carol again")
    carol.send_signal(signal.SIGTERM)
    assert carol.wait(60) == 0, carol.log_path.read_text()[-3000:]
    ca = _status(carol_dir)
    assert ca["batches_rejected"] == {} and ca["leases_lost"] == 0 and ca["paused_s"] > 0, ca

    wait_for(lambda: (_status(small_dir) or {}).get("leases_too_long", 0) >= 4, 300,
             "the small-context volunteer to skip leases")
    assert slow.wait(400) == 0, slow.log_path.read_text()[-3000:]
    st = _status(slow_dir)
    assert st["batches_acked"] == 3 and st["batches_rejected"] == {}, st
    assert st["lease_renewals"] >= 3 and st["leases_lost"] == 0 and st["leases_abandoned"] == 0, st
    assert small.poll() is None, small.log_path.read_text()[-3000:]  # alive, still asking for work
    sm = _status(small_dir)
    assert sm["batches_sent"] == 0 and sm["engine_errors"] == 0 and sm["leases_abandoned"] == sm["leases_too_long"], sm

    small.send_signal(signal.SIGTERM)  # the operator stops it (Ctrl-C): it finishes and exits
    assert small.wait(60) == 0, small.log_path.read_text()[-3000:]
    coord.send_signal(signal.SIGTERM)
    assert coord.wait(120) == 0, coord.log_path.read_text()[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    leases = summary["leases"]
    assert summary["batches_by_client"].get("slow") == 3 and summary["rejected_by_client"] == {}, summary
    assert leases["returned"] == 1, leases  # carol's
    assert leases["renewals"] >= 3, leases
    assert leases["expired"] >= 4 and leases["released"] >= 1, leases  # the small volunteer's came back
    assert summary["leases_balanced"], leases
