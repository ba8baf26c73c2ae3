"""A volunteer that joins a finished run is told by the handshake (and with --follow waits for the next);
one the version gate refuses never starts. The coordinator side is a small scripted node. (Exiting at the
run's end with real processes, receipts matching the summary: tests/integration/test_sync_and_stale.py.)"""

from __future__ import annotations

import pytest

from asyncrl.client import session
from asyncrl.client.session import JoinCheckFailed, RunFinished
from asyncrl.client.worker import Volunteer, VolunteerConfig
from asyncrl.protocol import envelope, handshake
from asyncrl.protocol.identity import Identity

COORD = Identity.from_seed(bytes(range(32)))


class InfoNode:
    """Answers the handshake from a script of CoordinatorInfo fields, one per call (the last repeats)."""

    def __init__(self, *answers: dict):
        self.answers, self.calls = list(answers), 0

    def call(self, peer, name, request, **kw):
        fields = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        return handshake.encode(handshake.CoordinatorInfo(
            run_id=fields.get("run_id", "r1"), asyncrl_version=handshake.package_version(),
            protocol=handshake.PROTOCOL_VERSION, schema=handshake.SCHEMA_VERSION, time=envelope.clock(),
            window_s=300.0, finished=fields.get("finished", False), refused=fields.get("refused", ""),
            detail=fields.get("detail", "")))


def volunteer(tmp_path, node, **cfg) -> Volunteer:
    vol = Volunteer(VolunteerConfig(address=f"/ip4/127.0.0.1/tcp/1/p2p/{COORD.peer_id}", data_dir=tmp_path,
                                    display="quiet", **cfg))
    vol.node = node
    return vol


def test_joining_a_finished_run_is_told_at_once(tmp_path):
    with pytest.raises(RunFinished):
        volunteer(tmp_path, InfoNode({"finished": True}))._handshake()


def test_follow_waits_for_the_next_run(tmp_path, monkeypatch):
    monkeypatch.setattr(session, "FOLLOW_FIRST_WAIT_S", 0.01)
    monkeypatch.setattr("asyncrl.swarm.bootstrap.rejoin", lambda node, maddrs: True)
    node = InfoNode({"finished": True}, {"finished": True}, {"run_id": "r2"})
    hs = volunteer(tmp_path, node, follow=True)._handshake()
    assert hs.info.run_id == "r2" and not hs.info.finished and node.calls == 3


def test_a_refused_version_stops_before_any_work(tmp_path):
    with pytest.raises(JoinCheckFailed) as err:
        volunteer(tmp_path, InfoNode({"refused": "UNSUPPORTED_VERSION", "detail": "upgrade"}))._handshake()
    assert err.value.check.id == "versions" and err.value.check.code == "UNSUPPORTED_VERSION"
