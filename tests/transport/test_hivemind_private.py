"""swarm/hivemind_private.py is the only place that reaches into hivemind's private API; a hivemind upgrade that
moves one of those names fails here, not in a volunteer's first NAT dial."""

from __future__ import annotations

import importlib.metadata
import inspect

from asyncrl.swarm import hivemind_private


def test_the_pinned_hivemind_is_the_one_the_private_names_were_checked_against():
    assert importlib.metadata.version("hivemind") == hivemind_private.HIVEMIND_VERSION_CHECKED


def test_every_private_name_used_still_exists_with_the_shape_we_call():
    from hivemind.p2p import p2p_daemon
    from hivemind.p2p.p2p_daemon_bindings import control, p2pclient

    assert callable(p2p_daemon.P2P._make_process_args)
    assert "_client" in inspect.getsource(p2p_daemon.P2P)  # P2P keeps its control client there
    assert list(inspect.signature(p2pclient.Client.connect).parameters)[1:3] == ["peer_id", "maddrs"]
    listen = inspect.signature(control.ControlClient.listen)
    assert list(listen.parameters) == ["self"]
    assert "_handler" in inspect.getsource(control.ControlClient) and "listen_maddr" in inspect.getsource(
        control.ControlClient)


def test_patches_apply_once_and_keep_hivemind_s_own_arguments():
    from hivemind.p2p import p2p_daemon

    hivemind_private.apply_patches()
    patched = p2p_daemon.P2P._make_process_args
    hivemind_private.apply_patches()
    assert p2p_daemon.P2P._make_process_args is patched  # idempotent: not wrapped twice
    args = p2p_daemon.P2P._make_process_args(autoRelay=True, trustedRelays=["/ip4/1.2.3.4/tcp/1/p2p/x"])
    assert "-relayDiscovery=0" in args and "-autoRelay=1" in args
    plain = p2p_daemon.P2P._make_process_args(autoRelay=True)
    assert not any(a.startswith("-relayDiscovery") for a in plain)
