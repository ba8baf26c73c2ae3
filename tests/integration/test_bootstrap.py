"""Bootstrap like a hivemind citizen: a stock `hivemind-dht` node (hivemind's own CLI, no asyncrl code, no
record validator) is the only peer both the coordinator (`--initial-peers`) and a volunteer know. The
volunteer is given a dead address first: any one bootstrap address that answers suffices. It learns the
coordinator's peer id from the operator (`--coordinator`), never its address: libp2p finds the
coordinator through the stock node, and the volunteer trains with it.
"""

from __future__ import annotations

import json

import pytest

from asyncrl.protocol.identity import Identity

from tests.conftest import free_tcp_port, wait_for
from tests.harness import start_coordinator

pytestmark = pytest.mark.integration


def read_status(data_dir) -> dict:
    try:
        return json.loads((data_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def test_a_stock_hivemind_dht_node_is_the_only_bootstrap_peer_both_sides_know(procs, tmp_path):
    stock = Identity.generate()
    stock.write_libp2p_identity(tmp_path / "stock.identity")
    port = free_tcp_port()
    stock_addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{stock.peer_id}"
    # hivemind's own console script `hivemind-dht` is this module's main()
    dht = procs.start("hivemind-dht", ["-m", "hivemind.hivemind_cli.run_dht", "--host_maddrs",
                                       f"/ip4/127.0.0.1/tcp/{port}", "--identity_path", str(tmp_path / "stock.identity"),
                                       "--refresh_period", "5"])
    wait_for(lambda: dht.poll() is None and stock.peer_id in dht.log_path.read_text(), 120,
             "the stock hivemind-dht node to print its address")

    run = tmp_path / "run"
    join = start_coordinator(procs, run, timeout=240, checkpoint_every=0, initial_peers=stock_addr).join
    coordinator_peer = join.rsplit("/p2p/", 1)[1]  # the operator shares the peer id only

    dead = f"/ip4/127.0.0.1/tcp/{free_tcp_port()}/p2p/{Identity.generate().peer_id}"
    data = tmp_path / "volunteer"
    # two bootstrap addresses where volunteer_args takes one join address: this command line stays written out
    vol = procs.start("volunteer", ["-m", "asyncrl.client.cli", "join", dead, stock_addr, "--coordinator",
                                    coordinator_peer, "--data-dir", str(data), "--name", "vol", "--threads", "1",
                                    "--max-batches", "2", "--quiet", "--host", "127.0.0.1"])
    st = wait_for(lambda: (vol.poll() in (None, 0)) and read_status(data).get("batches_acked", 0) >= 2 and read_status(data),
                  300, "the volunteer to get two batches accepted")
    assert st["versions_loaded"], st
    assert st["batches_rejected"] == {}, st
    assert vol.wait(60) == 0, vol.log_path.read_text()[-2000:]
    assert dht.poll() is None  # the stock node stayed up and was the only peer both sides were given
