"""The coordinator's handshake answer: back-compat, the gate, run state and the NAT dial-back."""

from __future__ import annotations

import asyncio
import socket

from asyncrl.coordinator.leasing.handshake import GatePolicy, HandshakeDesk
from asyncrl.coordinator.run_end import RunEnd
from asyncrl.protocol import handshake


class Announced:
    """What the daemon's peer store says each peer's node announces (the service asks p2pd)."""

    def __init__(self, ports: dict[str, set[int]] | None = None):
        self.ports = ports or {}

    async def __call__(self, peer: str) -> set[int]:
        return set(self.ports.get(peer, ()))


def desk(gate=GatePolicy(), finished=False, announced=None, clock=None) -> HandshakeDesk:
    return HandshakeDesk(run_id="r1", gate=gate, window_s=300.0, max_staleness=4, lease_timeout_s=60.0,
                         pointer=lambda: b"sealed-pointer", finished=lambda: finished,
                         announced_ports=announced or Announced(), clock=clock)


def ask(d: HandshakeDesk, request: handshake.InfoRequest | bytes, addr: str = "/ip4/127.0.0.1/tcp/5", peer="peer"):
    raw = request if isinstance(request, bytes) else handshake.encode(request)
    answer = asyncio.run(d.handle(raw, peer, addr))
    return answer if isinstance(request, bytes) else handshake.decode_info(answer)


def test_empty_request_gets_the_bare_run_id_and_a_request_gets_the_info():
    assert ask(desk(), b"") == b"r1"  # what asyncrl 0.1 volunteers send
    info = ask(desk(finished=True), handshake.InfoRequest(client_version=handshake.package_version()))
    assert (info.run_id, info.refused, info.finished, info.pointer, info.max_staleness) == ("r1", "", True,
                                                                                          b"sealed-pointer", 4)


def test_the_gate_refuses_before_any_work():
    info = ask(desk(GatePolicy(refused_client_versions=("0.1.7",))), handshake.InfoRequest(client_version="0.1.7"))
    assert info.refused == "UNSUPPORTED_VERSION" and info.detail
    info = ask(desk(), handshake.InfoRequest(client_version="0.2.0", schema=1))
    assert info.refused == "UNSUPPORTED_VERSION"


def test_dial_back_reports_only_ports_that_accept_a_connection():
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: refused
        ports = (listening.getsockname()[1], closed.getsockname()[1])
        info = ask(desk(announced=Announced({"peer": set(ports)})), handshake.InfoRequest(dial_back_ports=ports))
    assert info.reachable_ports == (ports[0],) and info.observed_addr == "/ip4/127.0.0.1/tcp/5"
    info = ask(desk(), handshake.InfoRequest(dial_back_ports=ports), addr="/p2p-circuit/p2p/x")
    assert info.reachable_ports == ()  # a relayed caller has no address to dial


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_run_end_lingers_until_every_live_volunteer_was_told(tmp_path):
    import threading

    clock = Clock()
    end = RunEnd(tmp_path, active_window_s=60.0, clock=clock)
    end.seen("alice")
    end.seen("bob")
    clock.t = 10.0
    end.finish("max_steps")
    end.told("alice")
    assert not end.linger(0.0, threading.Event())  # bob does not know yet
    end.told("bob")
    assert end.linger(5.0, threading.Event())
    gone = RunEnd(tmp_path, active_window_s=60.0, clock=clock)
    gone.seen("carol")
    clock.t = 100.0  # carol was last seen 90 s ago: not live, nobody to wait for
    gone.finish("finish requested")
    assert gone.linger(5.0, threading.Event())


def test_dial_back_tries_only_the_ports_the_caller_announces_or_connects_from():
    with socket.socket() as announced, socket.socket() as other:
        for sock in (announced, other):
            sock.bind(("127.0.0.1", 0))
            sock.listen()
        a, o = announced.getsockname()[1], other.getsockname()[1]
        d = desk(announced=Announced({"peer": {a}}))
        info = ask(d, handshake.InfoRequest(dial_back_ports=(a, o)))
        assert info.reachable_ports == (a,) and d.counters["ports_not_announced"] == 1  # `other` was never dialled
        seen_from = ask(desk(), handshake.InfoRequest(dial_back_ports=(o,)), addr=f"/ip4/127.0.0.1/tcp/{o}")
        assert seen_from.reachable_ports == (o,)  # the port it connects from is its own too


def test_each_peer_has_its_own_handshake_and_dial_back_budget():
    """A flooder spends its own allowance: its handshakes are refused RATE_LIMITED and its dial-backs stop, while
    an honest doctor's handshake is answered and its dial-back still made."""
    import pytest

    from asyncrl.coordinator.leasing import handshake as desk_module
    from asyncrl.protocol.errors import ProtocolError, RejectCode

    clock = Clock()
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        d = desk(announced=Announced({"flooder": {port}, "doctor": {port}}), clock=clock)
        for _ in range(desk_module.INFO_PER_PEER_BURST):
            d.admit("flooder")
        with pytest.raises(ProtocolError) as exc:
            d.admit("flooder")
        assert exc.value.code is RejectCode.RATE_LIMITED
        d.admit("doctor")  # someone else's handshake is not held back
        dialled = [ask(d, handshake.InfoRequest(dial_back_ports=(port,)), peer="flooder").reachable_ports
                   for _ in range(desk_module.DIAL_BACKS_PER_PEER_BURST + 3)]
        assert dialled == [(port,)] * desk_module.DIAL_BACKS_PER_PEER_BURST + [()] * 3
        assert ask(d, handshake.InfoRequest(dial_back_ports=(port,)), peer="doctor").reachable_ports == (port,)
        clock.t += desk_module.DIAL_BACK_PEER_EVERY_S  # the flooder's allowance refills slowly
        assert ask(d, handshake.InfoRequest(dial_back_ports=(port,)), peer="flooder").reachable_ports == (port,)
        d.admit("flooder")
