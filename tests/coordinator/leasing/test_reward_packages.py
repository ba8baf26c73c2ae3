"""Reward packages checked before work: the handshake names each reward's package and version; a volunteer
that lacks one (or has another version) refuses itself with the install line, tells the coordinator, and the
coordinator answers REWARD_PACKAGE_MISSING and shows it to the operator — no lease asked for, no strike.
The swarm path (a real volunteer process refused) is in tests/integration/test_trl_doc_rewards.py."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl import tasks
from asyncrl.client import checks
from asyncrl.coordinator.leasing.handshake import GatePolicy, HandshakeDesk
from asyncrl.protocol import handshake

from tests.conftest import REPO

PKG = REPO / "tests" / "trl_doc_rewards"
NEEDED = (handshake.RewardPackage(reward="trl_reference", package="trl-doc-rewards", version="1.17.0"),)


def desk(refusals: list) -> HandshakeDesk:
    return HandshakeDesk(run_id="r1", gate=GatePolicy(), window_s=300.0, max_staleness=4, lease_timeout_s=60.0,
                         pointer=lambda: b"p", finished=lambda: False, reward_packages=NEEDED,
                         on_refusal=refusals.append)


def ask(d, request):
    return handshake.decode_info(asyncio.run(d.handle(handshake.encode(request), "12D3KooWpeer", "/ip4/1.2.3.4/tcp/5")))


def test_the_handshake_names_the_packages_and_refuses_a_volunteer_that_lacks_one():
    refusals = []
    info = ask(desk(refusals), handshake.InfoRequest(client_version=handshake.package_version()))
    assert info.refused == "" and info.reward_packages == NEEDED and refusals == []
    info = ask(desk(refusals), handshake.InfoRequest(client_version=handshake.package_version(),
                                                     missing_rewards=("trl_reference",)))
    assert info.refused == "REWARD_PACKAGE_MISSING"
    assert "pip install 'trl-doc-rewards==1.17.0'" in info.detail
    assert [r["code"] for r in refusals] == ["REWARD_PACKAGE_MISSING"] and refusals[0]["peer"] == "12D3KooWpeer"


def test_the_answer_fits_its_bound_with_every_package_and_a_full_pointer():
    big = tuple(handshake.RewardPackage(reward="r" * 64, package="p" * 64, version="v" * 64)
                for _ in range(handshake.MAX_REWARD_PACKAGES))
    info = handshake.CoordinatorInfo(run_id="r" * 256, asyncrl_version="v" * 256, protocol=1, schema=2, time=0.0,
                                     window_s=1.0, detail="d" * 2048, pointer=b"x" * 8192, reward_packages=big)
    assert len(handshake.encode(info)) <= handshake.MAX_INFO_BYTES
    req = handshake.InfoRequest(client_version="v" * 256, dial_back_ports=(1, 2, 3, 4),
                                missing_rewards=("m" * 64,) * handshake.MAX_MISSING_REWARDS)
    assert handshake.decode_request(handshake.encode(req)) == req  # within MAX_INFO_REQUEST_BYTES


def test_the_volunteer_side_check_finds_what_is_missing_or_at_another_version(monkeypatch):
    info = handshake.CoordinatorInfo(run_id="r", asyncrl_version="0", protocol=1, schema=2, time=0.0, window_s=1.0,
                                     reward_packages=NEEDED)
    hs = checks.Handshake(info, 0.0, 0.0)
    monkeypatch.delitem(tasks.REWARDS, "trl_reference", raising=False)
    row = checks.reward_packages_check(hs)  # this interpreter does not have the package on its path
    assert (row.status, row.code) == (checks.FAIL, "REWARD_PACKAGE_MISSING")
    assert row.fix == "pip install 'trl-doc-rewards==1.17.0'" and "not installed" in row.detail
    monkeypatch.syspath_prepend(str(PKG))
    assert checks.reward_packages_check(hs).status == checks.PASS
    other = checks.Handshake(handshake.CoordinatorInfo(
        run_id="r", asyncrl_version="0", protocol=1, schema=2, time=0.0, window_s=1.0,
        reward_packages=(handshake.RewardPackage(reward="trl_reference", package="trl-doc-rewards", version="1.18.0"),)),
        0.0, 0.0)
    row = checks.reward_packages_check(other)
    assert row.status == checks.FAIL and "trl-doc-rewards 1.17.0" in row.detail  # ours, at another version


def test_the_coordinator_lists_only_entry_point_rewards_of_its_task(monkeypatch):
    from asyncrl.coordinator.config import CoordinatorConfig
    from asyncrl.coordinator.service import task_reward_packages
    from asyncrl.tasks.prompt import Prompt

    monkeypatch.syspath_prepend(str(PKG))

    class Source:
        records = [Prompt("a", "q", "", "trl_reference+0.5*math"), Prompt("b", "q", "", "exact")]

    got = task_reward_packages(Source(), CoordinatorConfig(task_reward="math"))
    assert got == NEEDED
