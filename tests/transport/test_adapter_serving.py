"""adapter_serving + swarm_fetch without a network: handlers called directly, the store's long poll,
the upload pacing arithmetic, and which provider a fetcher asks for each chunk."""

from __future__ import annotations

import asyncio
import struct
import threading

import pytest

from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.swarm.fetch import ProviderView, SwarmFetcher
from asyncrl.swarm.rate import TokenBucket
from asyncrl.swarm.serving import AdapterServer, AdapterStore, chunk_request, manifest_request


class TamperingProvider(AdapterServer):
    def outgoing_chunk(self, version, index, data):
        return b"X" + data[1:]


def store_with(version=3, chunks=(b"aa", b"bb", None), keyframe=True) -> AdapterStore:
    store = AdapterStore(keep=4)
    held = store.begin(version, b"manifest", len(chunks), is_keyframe=keyframe)
    for i, c in enumerate(chunks):
        if c is not None:
            store.put_chunk(version, i, c)
    assert held.complete == all(c is not None for c in chunks)
    return store


def test_serves_held_chunks_and_refuses_the_rest():
    server = AdapterServer(None, "r", store_with())
    assert asyncio.run(server._chunk(chunk_request(3, 1), "p")) == b"bb"
    assert asyncio.run(server._manifest(manifest_request(3), "p")) == b"manifest"
    for request in (chunk_request(3, 2), chunk_request(4, 0), chunk_request(3, 9)):
        with pytest.raises(ProtocolError) as exc:
            asyncio.run(server._chunk(request, "p"))
        assert exc.value.code == RejectCode.STALE_VERSION
    with pytest.raises(ProtocolError) as exc:
        asyncio.run(server._chunk(b"\x00" * 5, "p"))
    assert exc.value.code == RejectCode.MALFORMED
    assert server.stats.chunks_sent == 1 and server.stats.refused == 3
    assert server.stats.bytes_by_version[3] == len(b"bb") + len(b"manifest")


def test_a_long_poll_is_answered_when_the_chunk_arrives():
    store = store_with()
    hinted = []
    store.on_unknown_version = hinted.append
    server = AdapterServer(None, "r", store)

    async def scenario():
        waiting = asyncio.ensure_future(server._chunk(chunk_request(3, 2, wait_s=5.0), "p"))
        await asyncio.sleep(0.05)
        threading.Thread(target=store.put_chunk, args=(3, 2, b"cc")).start()  # another thread delivers it
        got = await waiting
        with pytest.raises(ProtocolError):  # nobody delivers this one: refused after the wait
            await server._chunk(chunk_request(9, 0, wait_s=0.05), "p")
        return got

    assert asyncio.run(scenario()) == b"cc"
    assert hinted == [9]  # a version newer than anything held: the follower is told to look now


def test_a_tampering_subclass_changes_only_what_goes_out():
    server = TamperingProvider(None, "r", store_with())
    assert asyncio.run(server._chunk(chunk_request(3, 0), "p")) == b"Xa"
    assert store_with().get(3).chunks[0] == b"aa"


def test_token_bucket_paces_to_the_rate_after_the_burst():
    bucket = TokenBucket(1000, burst=1000, now=0.0)  # one second of credit
    assert bucket.reserve(1000, now=0.0) == 0.0  # the saved-up second
    assert bucket.reserve(500, now=0.0) == pytest.approx(0.5)
    assert bucket.reserve(500, now=0.0) == pytest.approx(1.0)  # concurrent senders queue up
    assert bucket.reserve(100, now=10.0) == 0.0  # idle time refills, up to the burst


def test_prune_keeps_the_chain_from_the_newest_keyframe():
    store = AdapterStore(keep=3)
    for v in range(8):
        store.begin(v, b"m", 1, is_keyframe=v in (0, 5))
        store.put_chunk(v, 0, b"x")
        store.prune()
    assert store.complete_versions() == [5, 6, 7]
    store.begin(8, b"m", 1, is_keyframe=False)
    store.put_chunk(8, 0, b"x")
    store.prune()
    assert store.complete_versions() == [6, 7, 8]  # chain longer than `keep`: the newest `keep` stay


class PlanOnlyNode:
    """The fetcher's plan needs only the local peer id."""

    peer_id = "me"


def fetcher() -> SwarmFetcher:
    return SwarmFetcher(PlanOnlyNode(), run_id="r", coordinator_peer_id="coord", store=AdapterStore())


def test_plan_prefers_holders_then_the_seeder_then_the_coordinator():
    f = fetcher()
    view = ProviderView(seeders=("a", "b", "me"), holders={7: ("h1", "h2")})
    for i in range(4):
        plan = f.plan(7, i, view)
        assert {p for p, _ in plan[:2]} == {"h1", "h2"} and plan[-1] == ("coord", 0.0)
    firsts = {f.plan(7, i, view)[0][0] for i in range(4)}
    assert firsts == {"h1", "h2"}  # requests spread over the holders
    # Nobody holds v8 yet: chunk i's seeder is seeders[(i + 8) % 3], long-polled; our own turn goes
    # straight to the coordinator.
    plans = [[(p, w > 0) for p, w in f.plan(8, i, view)] for i in range(3)]
    assert plans == [[("coord", False)], [("a", True), ("coord", False)], [("b", True), ("coord", False)]]


def test_a_banned_provider_is_not_asked():
    f = fetcher()
    f._skip("h1", 600)
    plan = f.plan(7, 0, ProviderView(seeders=(), holders={7: ("h1", "h2")}))
    assert [p for p, _ in plan] == ["h2", "coord"]
    assert f.banned == ["h1"]


def test_requests_keep_the_old_wire_format_without_a_wait():
    assert chunk_request(5, 2) == struct.pack(">QI", 5, 2) and manifest_request(5) == struct.pack(">Q", 5)


class NobodyHoldsItNetwork:
    """Transport seam: every peer and the coordinator answer 'not held' (the coordinator restarted and
    publishes other versions now)."""

    peer_id = "me"

    async def acall(self, peer, name, request, *, max_response_bytes):
        raise ProtocolError(RejectCode.STALE_VERSION, "chunk not held")


def test_a_fetch_is_abandoned_when_the_coordinator_no_longer_holds_the_version():
    from asyncrl.protocol import codec, messages

    store = AdapterStore()
    f = SwarmFetcher(NobodyHoldsItNetwork(), run_id="r", coordinator_peer_id="coord", store=store, fetch_timeout_s=600)
    chunks = [b"a" * 10, b"b" * 10]
    manifest = messages.AdapterManifest(
        run_id="r", version=6, parent_version=None, keyframe_version=6, base_model="m", base_revision="x",
        lora=messages.LoraSpec(r=1, alpha=1.0, dropout=0.0, target_modules=("q",)), codec=codec.KEYFRAME_CODEC,
        tensors=(messages.TensorSpec("t", "bf16", (10,)),), raw_bytes=20, compressed_bytes=20, chunk_bytes=10,
        chunk_hashes=codec.chunk_hashes(chunks), created_at=0.0)
    with pytest.raises(ProtocolError) as exc:  # at once, not after fetch_timeout_s
        asyncio.run(asyncio.wait_for(f._payload(manifest, b"manifest"), 30))
    assert exc.value.code == RejectCode.STALE_VERSION
    assert store.get(6) is None  # the partial copy is gone


class RefusingSeederNetwork:
    """Transport seam: seeder "a" answers every long poll "not held" at once (it never holds the poll); the
    coordinator serves every chunk. Counts the requests each peer got."""

    peer_id = "me"

    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks
        self.asked: dict[str, int] = {}

    async def acall(self, peer, name, request, *, max_response_bytes):
        self.asked[peer] = self.asked.get(peer, 0) + 1
        if peer == "a":
            raise ProtocolError(RejectCode.STALE_VERSION, "chunk not held")
        version, index = struct.unpack(">QI", request[:12])
        return self.chunks[index]


def test_a_seeder_that_refuses_long_polls_at_once_is_backed_off_and_demoted():
    """Without back-off each chunk's fetch polled such a seeder in a tight loop for SEEDER_PATIENCE_S (~190
    requests a second); now its quick refusals, counted per seeder over all chunks, demote it after a few."""
    from asyncrl.protocol import codec, messages
    from asyncrl.swarm import fetch

    chunks = [bytes([i]) * 10 for i in range(8)]
    net = RefusingSeederNetwork(chunks)
    f = SwarmFetcher(net, run_id="r", coordinator_peer_id="coord", store=AdapterStore(), fetch_timeout_s=600)
    f.view = lambda: ProviderView(seeders=("a",), holders={})  # every chunk's seeder is "a"
    manifest = messages.AdapterManifest(
        run_id="r", version=6, parent_version=None, keyframe_version=6, base_model="m", base_revision="x",
        lora=messages.LoraSpec(r=1, alpha=1.0, dropout=0.0, target_modules=("q",)), codec=codec.KEYFRAME_CODEC,
        tensors=(messages.TensorSpec("t", "bf16", (40,)),), raw_bytes=80, compressed_bytes=80, chunk_bytes=10,
        chunk_hashes=codec.chunk_hashes(chunks), created_at=0.0)
    payload = asyncio.run(asyncio.wait_for(f._payload(manifest, b"manifest"), 120))
    assert payload == b"".join(chunks)
    assert f.stats.seeders_demoted == 1 and f.stats.chunks_from_coordinator == len(chunks)
    # every chunk asked it at most once after the demotion's count was reached (the requests already in flight)
    assert net.asked["a"] <= fetch.QUICK_REFUSALS_TO_DEMOTE + len(chunks), net.asked
