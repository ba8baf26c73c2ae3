"""Swarm transport with real processes on loopback: lab publisher + lab followers (bench/swarmlab.py),
each its own hivemind DHT and p2pd. The publisher is the real Publisher/codec/AdapterServer/pointer
record; followers are the real AdapterSync/SwarmFetcher/AdapterServer/presence beacon. Adversaries
come from tests/integration/swarm_peers.py. Tests assert digests and counters, never log text.
"""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests.conftest import REPO, wait_for
from tests.integration.lab import alive, events, held, published, serves, start_follower, start_publisher, status

pytestmark = pytest.mark.integration


def test_corrupted_chunk_from_a_malicious_peer_is_detected_and_fetched_elsewhere(procs, tmp_path):
    pub, ready = start_publisher(procs, tmp_path, "--versions", "1", "--chunk-bytes", "65536")
    v0 = published(pub, 0)
    mallory, mallory_dir = start_follower(procs, tmp_path, "mallory", ready["join"],
                                          module=("-m", "tests.integration.swarm_peers", "tamper"))
    held(mallory, 0)  # fetched honestly, from the coordinator; from now on it serves corrupted chunks
    mallory_id = wait_for(lambda: status(mallory_dir).get("peer_id"), 30, "mallory's status")
    serves(pub, mallory_id, 0)

    alice, alice_dir = start_follower(procs, tmp_path, "alice", ready["join"])
    got = held(alice, 0)
    assert got["digest"] == v0["digest"], "alice decoded something else than what was published"
    st = wait_for(lambda: status(alice_dir).get("held") == [0] and status(alice_dir), 30, "alice's status")
    assert st["fetch"]["hash_mismatches"] >= 1, st  # mallory was asked (it announced v0) and caught
    assert mallory_id in st["banned"], st
    assert st["fetch"]["bytes_by_provider"].get(ready["peer_id"], 0) > 0, st  # the rest came from elsewhere


def test_pointer_written_by_a_non_coordinator_peer_is_ignored(procs, tmp_path):
    pub, ready = start_publisher(procs, tmp_path, "--versions", "1", "--control", stdin=subprocess.PIPE)
    v0 = published(pub, 0)
    alice, alice_dir = start_follower(procs, tmp_path, "alice", ready["join"])
    held(alice, 0)
    alice_id = wait_for(lambda: status(alice_dir).get("peer_id"), 30, "alice's status")

    mallory = procs.start("mallory", ["-m", "tests.integration.swarm_peers", "mallory", ready["join"], "--run-id", "lab",
                                      "--coordinator", ready["peer_id"], "--push-to", alice_id], cwd=REPO)
    stored = wait_for(lambda: events(mallory, "stored"), 120, "mallory's forged store")[0]
    assert stored["control_accepted"] is True  # the DHT takes mallory's other writes...
    assert stored["forged_accepted"] is False  # ...but no validating node stores a pointer it signed
    pushed = wait_for(lambda: events(mallory, "pushed"), 60, "mallory's push")[0]
    assert pushed["code"] == "NOT_ALLOWED"  # alice's pointer handler refused the forged push too

    pub.stdin.write(b"publish\n")
    pub.stdin.flush()
    v1 = published(pub, 1)
    got = held(alice, 1)  # the forged v999 with its far-future expiration did not shadow the real pointer
    assert got["digest"] == v1["digest"]
    assert [e["version"] for e in events(alice, "held")] == [0, 1]
    assert v0["digest"] != v1["digest"]


def test_killing_a_provider_mid_transfer_still_completes(procs, tmp_path):
    pub, ready = start_publisher(procs, tmp_path, "--versions", "1", "--chunk-bytes", "16384")
    v0 = published(pub, 0)
    # A slow provider (100 kB/s upload cap) that holds v0: a late fetcher prefers it over the coordinator.
    provider, provider_dir = start_follower(procs, tmp_path, "provider", ready["join"], "--upload-bps", "100000")
    held(provider, 0)
    provider_id = wait_for(lambda: status(provider_dir).get("peer_id"), 30, "the provider's status")
    serves(pub, provider_id, 0)

    fetcher, fetcher_dir = start_follower(procs, tmp_path, "fetcher", ready["join"])
    wait_for(lambda: (alive(fetcher), status(fetcher_dir).get("fetch", {}).get("chunks_from_peers", 0) >= 5)[1], 120,
             "the fetcher to get chunks from the provider")
    assert not events(fetcher, "held"), "the transfer finished before the provider could be killed"
    procs.signal(provider, signal.SIGKILL)  # mid-transfer: its streams break, it never answers again

    got = held(fetcher, 0)
    assert got["digest"] == v0["digest"]
    st = wait_for(lambda: status(fetcher_dir).get("held") == [0] and status(fetcher_dir), 30, "the fetcher's status")
    assert st["fetch"]["chunks_from_peers"] >= 5, st
    assert st["fetch"]["chunks_from_coordinator"] >= 1, st  # the rest: elsewhere, after the provider vanished
    assert st["fetch"]["hash_mismatches"] == 0, st


def test_late_joiner_catches_up_from_the_latest_keyframe(procs, tmp_path):
    pub, ready = start_publisher(procs, tmp_path, "--versions", "25", "--keyframe-every", "10")
    last = published(pub, 24)  # keyframes at v0, v10, v20: the chain for v24 is v20 (keyframe) .. v24
    chain = [e for e in events(pub, "published") if 20 <= e["version"] <= 24]
    assert [e["codec"] for e in chain][0] == "planes-zstd-v1" and len(chain) == 5

    # The late joiner bootstraps from another volunteer's address; the coordinator is named separately.
    early, early_dir = start_follower(procs, tmp_path, "early", ready["join"])
    held(early, 24)
    early_addr = wait_for(lambda: status(early_dir).get("maddrs"), 30, "the early follower's address")[0]
    late, late_dir = start_follower(procs, tmp_path, "late", f"{early_addr}/p2p/{status(early_dir)['peer_id']}",
                                    "--coordinator", ready["peer_id"])
    got = held(late, 24)
    assert got["digest"] == last["digest"]
    assert [e["version"] for e in events(late, "held")] == [24]  # no stop at older versions
    st = wait_for(lambda: status(late_dir).get("held") == [24] and status(late_dir), 30, "the late joiner's status")
    fetch = st["fetch"]
    assert fetch["manifests_from_coordinator"] + fetch["manifests_from_peers"] == 5, fetch  # v20..v24 only
    assert fetch["bytes_from_coordinator"] + fetch["bytes_from_peers"] == sum(e["compressed_bytes"] for e in chain)
