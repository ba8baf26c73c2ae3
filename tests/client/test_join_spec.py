"""Join spec: whose key a volunteer trusts when it bootstraps from the coordinator or from any peer."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncrl.protocol.identity import Identity
from asyncrl.swarm.bootstrap import join_spec
from asyncrl.swarm.transport import BadAddress

COORD = Identity.from_seed(bytes(range(32)))
PEER = Identity.from_seed(bytes(range(1, 33)))


def test_the_address_names_the_coordinator_by_default():
    spec = join_spec(f"/ip4/127.0.0.1/tcp/4001/p2p/{COORD.peer_id}")
    assert spec.coordinator_peer_id == COORD.peer_id and spec.coordinator_key == COORD.public_key
    assert spec.coordinator_is_bootstrap


def test_any_peer_bootstraps_when_the_coordinator_is_named():
    spec = join_spec(f"/ip4/198.51.100.7/tcp/4001/p2p/{PEER.peer_id}", COORD.peer_id)
    assert spec.bootstrap == (f"/ip4/198.51.100.7/tcp/4001/p2p/{PEER.peer_id}",)
    assert spec.coordinator_key == COORD.public_key and not spec.coordinator_is_bootstrap


@pytest.mark.parametrize("address, coordinator", [
    ("not-a-multiaddr", None),
    ("/ip4/127.0.0.1/tcp/4001", None),  # no /p2p/: no trust anchor
    (f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER.peer_id}", "not-a-peer-id"),
    (f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER.peer_id}", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"),  # RSA-style
])
def test_bad_join_specs_are_refused(address, coordinator):
    with pytest.raises(BadAddress):
        join_spec(address, coordinator)


def test_cli_refuses_a_bad_coordinator_with_one_line():
    r = subprocess.run([sys.executable, "-m", "asyncrl.client.cli", "join", f"/ip4/127.0.0.1/tcp/9/p2p/{PEER.peer_id}",
                        "--coordinator", "bogus"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_several_bootstrap_addresses_any_one_suffices(free_port):
    import socket

    from asyncrl.swarm.transport import TransportError, check_reachable, parse_join_address

    dead = f"/ip4/127.0.0.1/tcp/{free_port}/p2p/{PEER.peer_id}"
    with socket.socket() as listener:  # something that answers, second in the list
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        live = f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}/p2p/{PEER.peer_id}"
        spec = join_spec([dead, live], COORD.peer_id)
        assert spec.bootstrap == (dead, live) and spec.coordinator_peer_id == COORD.peer_id
        check_reachable([parse_join_address(a) for a in spec.bootstrap])  # one answers: enough
    with pytest.raises(TransportError):
        check_reachable([parse_join_address(dead)])


def test_several_addresses_of_different_peers_need_the_coordinator_named():
    a = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER.peer_id}"
    b = f"/ip4/127.0.0.1/tcp/4002/p2p/{COORD.peer_id}"
    with pytest.raises(BadAddress):
        join_spec([a, b])
    both = join_spec([f"/ip4/127.0.0.1/tcp/4001/p2p/{COORD.peer_id}", f"/ip6/::1/tcp/4001/p2p/{COORD.peer_id}"])
    assert both.coordinator_peer_id == COORD.peer_id and len(both.bootstrap) == 2


def test_coordinator_initial_peers_must_name_a_peer():
    from asyncrl.coordinator.config import ConfigError, CoordinatorConfig

    CoordinatorConfig(initial_peers=(f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER.peer_id}",)).validate()
    for bad in ("/ip4/127.0.0.1/tcp/4001", "garbage"):
        with pytest.raises(ConfigError):
            CoordinatorConfig(initial_peers=(bad,)).validate()
    r = subprocess.run([sys.executable, "-m", "asyncrl.coordinator.cli", "run", "--initial-peers", "/ip4/1.2.3.4/tcp/1",
                        "--run-dir", "/nonexistent/never-created"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
