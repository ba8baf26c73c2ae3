"""The coordinator's handshake answer: back-compat, the gate, run state and the NAT dial-back."""

from __future__ import annotations

import asyncio
import socket

from asyncrl.coordinator.handshake import GatePolicy, HandshakeDesk
from asyncrl.coordinator.run_end import RunEnd
from asyncrl.protocol import handshake


def desk(gate=GatePolicy(), finished=False) -> HandshakeDesk:
    return HandshakeDesk(run_id="r1", gate=gate, window_s=300.0, max_staleness=4, lease_timeout_s=60.0,
                         pointer=lambda: b"sealed-pointer", finished=lambda: finished)


def ask(d: HandshakeDesk, request: handshake.InfoRequest | bytes, addr: str = "/ip4/127.0.0.1/tcp/5"):
    raw = request if isinstance(request, bytes) else handshake.encode(request)
    answer = asyncio.run(d.handle(raw, "peer", addr))
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
        info = ask(desk(), handshake.InfoRequest(dial_back_ports=ports))
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
