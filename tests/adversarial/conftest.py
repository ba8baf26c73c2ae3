"""Fixtures: one swarm (coordinator + alice + bob, real processes) and one mallory for the whole package
(the nodes a test adds to her are shut down when that test ends).

`attack(name, description)` opens an AttackRecord for the table in docs/SECURITY.md and, when the test
ends, checks that alice's and bob's books show no rejected batch (the honest loss must stay 0).
"""

from __future__ import annotations

import time

import pytest

from tests.adversarial.swarm import (
    COORDINATOR_FLAGS,
    AttackRecord,
    Mallory,
    RssSampler,
    Swarm,
    read_json,
    start_volunteers,
    wait_for,
    write_artifact,
)
from tests.conftest import Procs, wait_for_join


@pytest.fixture(scope="package")  # torn down (processes reaped) after the suite
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("adversarial")
    procs = Procs(root)
    run = root / "run"
    banlist = root / "banlist.txt"
    banlist.write_text("# operator's ban list (re-read on change)\n")
    coord = procs.start("coordinator", ["-m", "asyncrl.coordinator.cli", "run", "--model", "tiny", "--run-dir",
                                        str(run), "--banlist", str(banlist), *COORDINATOR_FLAGS])
    try:
        join = wait_for_join(run, 240)
        honest = start_volunteers(procs, join, root, ("alice", "bob"), "--duty-cycle", "0.5")
        s = Swarm(root=root, run=run, join=join, coordinator_pid=coord.pid, honest=honest)
        s.banlist = banlist
        s.procs = procs  # tests that need another process of their own (a volunteer, a DDP learner)
        wait_for(lambda: all((read_json(d / "status.json") or {}).get("batches_acked", 0) >= 1
                             for d in honest.values()), 300, "alice and bob to get a batch accepted")
        s.start_view = s.honest_view()
        rss = RssSampler(s)
        yield s
        ended = time.time()  # the books as of after the last attack: trust.json is rewritten every few seconds
        wait_for(lambda: (run / "trust.json").stat().st_mtime > ended, 60, "trust.json written after the last attack")
        final = s.honest_view()
        write_artifact(s, {"honest_start": s.start_view, "honest_end": final, "trust": s.trust(),
                           "unanswered_streams": s.unanswered, **rss.stop()})
    finally:
        procs.reap()


@pytest.fixture(scope="package")  # torn down (processes reaped) after the suite
def package_mallory(swarm):
    m = Mallory(swarm)
    m.follow()
    yield m
    m.close()


@pytest.fixture
def mallory(package_mallory):
    """The package's mallory; the extra nodes (own DHT process and p2pd each) a test gave her are shut down
    when it ends. Kept until the package ended, they piled up: ~13 live DHT nodes a third of the way through
    the suite (CI run q2 of 2026-12-06), each serving the swarm's DHT and loading both cores."""
    before = len(package_mallory.extra_nodes)
    yield package_mallory
    package_mallory.close_extra_nodes(before)


@pytest.fixture
def attack(swarm):
    opened: list[AttackRecord] = []
    before = swarm.honest_rejections()

    def open_record(name: str, description: str, note: str = "") -> AttackRecord:
        rec = AttackRecord(name, description, note=note)
        swarm.results[name] = rec
        opened.append(rec)
        return rec

    yield open_record
    lost = swarm.honest_rejections() - before
    for rec in opened:
        rec.honest_lost = lost + rec.honest_extra
    assert lost == 0 and swarm.honest_rejections() == 0, swarm.honest_view()
