"""swarm/hivemind_private.py is the only place that reaches into hivemind's private API; a hivemind upgrade that
moves one of those names fails here, not in a volunteer's first NAT dial."""

from __future__ import annotations

import importlib.metadata
import inspect
import multiprocessing
import os
import signal

import pytest

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


def _take_the_update_lock_and_die() -> None:
    from hivemind.utils.mpfuture import MPFuture

    MPFuture._update_lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)  # as a DHT process killed mid-message


def orphan_the_update_lock() -> None:
    """Leave hivemind's MPFuture update lock held by a dead process, the state a fresh-clone CI run hung in."""
    holder = multiprocessing.get_context("fork").Process(target=_take_the_update_lock_and_die)
    holder.start()
    holder.join(60)
    assert holder.exitcode == -signal.SIGKILL


def test_the_update_lock_a_killed_process_held_is_freed_and_the_next_dht_starts():
    import hivemind
    from hivemind.utils.mpfuture import MPFuture

    assert hasattr(MPFuture._update_lock, "acquire") and hasattr(MPFuture._update_lock, "release")
    assert not hivemind_private.free_orphaned_update_lock(wait_s=0.5)  # nothing to free: left alone
    orphan_the_update_lock()
    dht = hivemind.DHT(start=True, await_ready=False)
    try:
        with pytest.raises(TimeoutError):  # its "ready" cannot be sent while the dead process holds the lock
            dht.wait_until_ready(timeout=5)
        assert hivemind_private.free_orphaned_update_lock(wait_s=0.5)
        dht.wait_until_ready(timeout=120)  # the same DHT, unblocked
    finally:
        hivemind_private.free_orphaned_update_lock(wait_s=0.5)  # never leave this worker's next DHT hanging
        dht.shutdown()
    assert not hivemind_private.free_orphaned_update_lock(wait_s=0.5)


def test_a_node_whose_dht_process_was_killed_frees_the_lock_on_shutdown():
    from asyncrl.swarm.transport import SwarmNode

    node = SwarmNode()
    try:
        orphan_the_update_lock()  # the lock is held by a dead process, as if node's DHT had died holding it
        os.kill(node.dht.pid, signal.SIGKILL)
        node.dht.join(30)
    finally:
        node.shutdown()  # its DHT ended by a signal: the lock it may have held is freed
    try:
        assert not hivemind_private.free_orphaned_update_lock(wait_s=0.5)
        SwarmNode(start_timeout=120).shutdown()  # the next node starts
    finally:
        hivemind_private.free_orphaned_update_lock(wait_s=0.5)
