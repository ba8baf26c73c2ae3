"""Work sized to the machine (client/lease_sizing.py, coordinator/leasing/leasing.py), real processes over loopback.

One coordinator whose leases live at most LIFE_S (renewals included). Three volunteers slowed by
the fault double's slow-prompt:S (tests/fault_volunteer.py: S seconds per leased prompt on top of generation, so
the figures below hold whatever this machine's speed — conditions, not luck):
  * `fixed` (--fixed-lease-size) asks for 8 prompts every time: 8 x 1 s > LIFE_S, so each lease dies
    before it is done and its groups are lost;
  * `sized` measures itself on a one-prompt lease, then asks for what fits half the budget: nothing lost
    to lease expiry, nothing rejected, none of its batches dropped as stale;
  * `hopeless` needs 8 s for a single prompt: after its first lease it is refused TOO_SLOW and stops.
The in-flight room (24) and `--new-key-share 1.0` keep fairness and back-pressure from shrinking the
fixed lease: only sizing differs between `fixed` and `sized`.
"""

from __future__ import annotations

import json
import signal

import pytest

from asyncrl.protocol.errors import RejectCode
from asyncrl.runlog import read_events

from tests.conftest import wait_for
from tests.harness import start_coordinator, start_volunteer

pytestmark = pytest.mark.integration
LIFE_S = 6.0


def _status(root, name) -> dict:
    try:
        return json.loads((root / name / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _events(run, kind):
    return read_events(run, kind)


def test_a_slowed_volunteer_takes_smaller_leases_and_loses_nothing_where_a_fixed_lease_dies(procs, tmp_path):
    run = tmp_path / "run"
    join = start_coordinator(procs, run, timeout=120, lease_timeout_s=3, lease_max_s=LIFE_S, prompts_per_lease=8,
                             max_inflight_groups=24, new_key_share=1.0, groups_per_step=2, min_groups=1,
                             max_wait_s=1).join

    def volunteer(name, slow_s, **opts):
        return start_volunteer(procs, join, tmp_path / name, name=name, fault=f"slow-prompt:{slow_s}", quiet=True,
                               prompts_per_batch=8, **opts)

    sized = volunteer("sized", 1.0)
    fixed = volunteer("fixed", 1.0, fixed_lease_size=True)
    hopeless = volunteer("hopeless", 8.0)
    assert hopeless.wait(300) != 0, hopeless.log_path.read_text()[-3000:]  # stops on its own: refused
    h = _status(tmp_path, "hopeless")
    assert h["refused"] == RejectCode.TOO_SLOW.value and h["lease_sizes"] == [1], h
    assert h["seconds_per_prompt"] > LIFE_S and h["batches_sent"] == 0
    wait_for(lambda: _status(tmp_path, "fixed").get("leases_lost", 0) >= 8, 300,
             "the fixed-size volunteer's first lease lost (it outlived the lease's life)")
    wait_for(lambda: _status(tmp_path, "sized").get("batches_acked", 0) >= 3, 300, "three batches from `sized`")
    for p in (sized, fixed):
        procs.signal(p, signal.SIGINT)
    for p in (sized, fixed):
        p.wait(120)
    s, f = _status(tmp_path, "sized"), _status(tmp_path, "fixed")
    assert s["lease_sizes"][0] == 1 and 1 <= max(s["lease_sizes"]) < 8, s["lease_sizes"]  # measured, then sized
    assert s["seconds_per_prompt"] >= 1.0  # the injected second per prompt, at least
    assert s["batches_rejected"] == {} and s["leases_lost"] == 0 and s["leases_abandoned"] == 0, s
    assert set(f["lease_sizes"]) == {8} and f["leases_lost"] >= 8 and f["batches_acked"] == 0, f
    sized_ids = {e["batch_id"] for e in _events(run, "batch") if e["client"] == "sized"}
    dropped = {b for e in _events(run, "dropped") for b in e["batch_ids"]}
    assert len(sized_ids) >= 3 and not (sized_ids & dropped)  # none of its batches dropped as stale
