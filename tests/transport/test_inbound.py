"""Inbound budgets (swarm/inbound.py) driven through the real per-stream coroutine (swarm/transport.py
`stream_handler`) with plain asyncio streams: deadlines, the global byte budget, stream caps, the
bounded executor; and the adapter server's byte-rate admission (swarm/serving.py ServeBudget)."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.swarm.inbound import BoundedExecutor, InboundGate, InboundLimits
from asyncrl.swarm.serving import ServeBudget
from asyncrl.swarm.transport import HEADER, LINGER_S, STATUS_OK, stream_handler


class PeerId:
    def __init__(self, peer: str):
        self.peer = peer

    def to_base58(self) -> str:
        return self.peer


class PeerInfo:  # what hivemind hands a stream handler: `.peer_id.to_base58()`
    def __init__(self, peer: str):
        self.peer_id = PeerId(peer)


class RecordingWriter:
    def __init__(self):
        self.data = bytearray()
        self.closed = False

    def write(self, b: bytes) -> None:
        self.data += b

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True

    def answer(self) -> tuple[int, bytes]:
        status = self.data[0]
        length = int.from_bytes(self.data[1:1 + HEADER], "big")
        return status, bytes(self.data[1 + HEADER:1 + HEADER + length])

    def code(self) -> str:
        status, body = self.answer()
        return "OK" if status == STATUS_OK else body.decode().partition(":")[0]


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(HEADER, "big") + body


async def echo(request: bytes, peer: str) -> bytes:
    return request[:4]


def test_a_request_is_answered_and_its_budget_returned():
    gate = InboundGate(InboundLimits())
    on_stream = stream_handler(gate, "t", echo, max_request_bytes=1 << 20)

    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(frame(b"hello"))
        reader.feed_eof()
        writer = RecordingWriter()
        await on_stream(PeerInfo("p"), reader, writer)
        return writer

    writer = asyncio.run(go())
    assert writer.answer() == (STATUS_OK, b"hell") and writer.closed
    assert gate.inflight_bytes == 0 and gate.streams == 0 and not gate.by_peer and not gate.bytes_by_peer
    assert gate.stats.latency_ms["t"]


def test_slow_header_and_slow_drip_body_are_cut():
    limits = InboundLimits(header_timeout_s=0.2, min_read_bps=1_000_000)
    gate = InboundGate(limits)
    on_stream = stream_handler(gate, "t", echo, max_request_bytes=1 << 20)

    async def go(first: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(first)  # and then nothing more: the sender stalls
        writer = RecordingWriter()
        t0 = time.monotonic()
        await on_stream(PeerInfo("dripper"), reader, writer)
        return writer, time.monotonic() - t0

    writer, took = asyncio.run(go(b"\x00\x00"))  # half a header
    assert writer.code() == RejectCode.DEADLINE_EXCEEDED.value
    writer, took = asyncio.run(go((500_000).to_bytes(HEADER, "big") + b"x" * 1000))  # 0.7 s allowed for the body
    assert writer.code() == RejectCode.DEADLINE_EXCEEDED.value
    assert gate.inflight_bytes == 0 and gate.streams == 0  # the slow-drip stream's reservation is back
    assert gate.stats.deadline_cut == 2
    assert took < 5.0


def test_global_byte_budget_and_per_peer_share_refuse_before_reading():
    gate = InboundGate(InboundLimits(max_inflight_bytes=1000, max_inflight_bytes_per_peer=600, untrusted_share=1.0))

    async def go():
        hold = asyncio.Event()

        async def slow(request, peer):
            await hold.wait()
            return b"done"

        on_stream = stream_handler(gate, "t", slow, max_request_bytes=10_000)

        def start(peer, n):
            reader = asyncio.StreamReader()
            reader.feed_data(frame(b"x" * n))
            reader.feed_eof()
            writer = RecordingWriter()
            return asyncio.ensure_future(on_stream(PeerInfo(peer), reader, writer)), writer

        a, wa = start("a", 500)
        await asyncio.sleep(0.05)
        b, wb = start("a", 200)  # a's share (600) would be exceeded
        c, wc = start("c", 400)  # fits the global budget (900 <= 1000)
        await asyncio.sleep(0.05)
        d, wd = start("d", 200)  # 1100 > 1000
        await asyncio.gather(b, d)
        assert gate.inflight_bytes == 900
        hold.set()
        await asyncio.gather(a, c)
        return wa, wb, wc, wd

    wa, wb, wc, wd = asyncio.run(go())
    assert (wa.code(), wb.code(), wc.code(), wd.code()) == ("OK", "RATE_LIMITED", "OK", "RATE_LIMITED")
    assert gate.inflight_bytes == 0 and gate.stats.bytes_refused == 2 and gate.stats.peak_inflight_bytes == 900


def test_stream_caps_per_peer_and_in_total():
    gate = InboundGate(InboundLimits(max_streams=3, max_streams_per_peer=2))
    with gate.stream("a"), gate.stream("a"):
        with pytest.raises(ProtocolError) as exc:
            with gate.stream("a"):
                pass
        assert exc.value.code is RejectCode.RATE_LIMITED
        with gate.stream("b"):
            with pytest.raises(ProtocolError):  # 3 open in total: even a fresh peer id waits
                with gate.stream("fresh"):
                    pass
    assert gate.streams == 0 and not gate.by_peer


def test_a_stream_refused_for_want_of_a_slot_drains_its_request_before_closing():
    """Closing a socket with the caller's request unread can make p2pd reset the stream before the caller read
    the refusal (CI 2026-12-03: 1 of 119 slot refusals unanswered): the refusal drains it first, at most
    max_lingering streams at once; beyond that the stream is closed at once (counted)."""
    gate = InboundGate(InboundLimits(max_streams=1, max_lingering=1))
    on_stream = stream_handler(gate, "t", echo, max_request_bytes=1 << 20)

    async def refused():
        reader = asyncio.StreamReader()
        reader.feed_data(frame(b"x" * 1000))  # the caller's request, still unread when we refuse
        writer = RecordingWriter()
        task = asyncio.ensure_future(on_stream(PeerInfo("late"), reader, writer))
        return task, reader, writer

    async def go():
        with gate.stream("holder"):  # the only slot is taken
            first, r1, w1 = await refused()
            await asyncio.sleep(0.05)
            second, r2, w2 = await refused()  # max_lingering = 1 is draining already
            await second
            assert w2.code() == "RATE_LIMITED" and w2.closed and len(r2._buffer) > 0  # closed at once, unread
            assert not first.done() and len(r1._buffer) == 0  # read and discarded, waiting for the caller's EOF
            r1.feed_eof()  # the caller read the refusal and hung up
            await first
            assert w1.code() == "RATE_LIMITED" and w1.closed
        return gate

    gate = asyncio.run(go())
    assert gate.lingering == 0 and gate.stats.unlingered == 1 and gate.stats.streams_refused == 2


def test_an_answered_stream_is_closed_only_after_the_caller_hung_up():
    """Closing our end first can make p2pd reset the stream while the answer still sits in the caller's receive
    buffer (the caller reads 0 bytes; docs/transport.md "Who closes first"): the handler waits for the caller's
    EOF, outside its stream slot and bounded (max_lingering streams, LINGER_S each)."""
    gate = InboundGate(InboundLimits(max_streams_per_peer=1, max_lingering=1))
    on_stream = stream_handler(gate, "t", echo, max_request_bytes=1 << 20)

    async def answered(peer: str):
        reader = asyncio.StreamReader()
        reader.feed_data(frame(b"hello"))  # the request; the caller keeps its end open while it reads the answer
        writer = RecordingWriter()
        task = asyncio.ensure_future(on_stream(PeerInfo(peer), reader, writer))
        for _ in range(100):
            if writer.data:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        return task, reader, writer

    async def go():
        first, r1, w1 = await answered("a")
        assert w1.answer() == (STATUS_OK, b"hell") and not w1.closed and not first.done()
        assert gate.streams == 0 and gate.lingering == 1  # its slot is free: "a"'s next request is not refused
        second, _, w2 = await answered("a")  # max_lingering = 1 is waiting already: closed at once (counted)
        await second
        assert w2.answer() == (STATUS_OK, b"hell") and w2.closed and gate.stats.unlingered == 1
        r1.feed_eof()  # the caller read its answer and hung up
        await first
        assert w1.closed and gate.lingering == 0
        t0 = time.monotonic()
        silent, _, w3 = await answered("b")  # a caller that never hangs up is closed after LINGER_S
        await silent
        return w3, time.monotonic() - t0

    w3, took = asyncio.run(go())
    assert w3.closed and LINGER_S - 0.5 < took < LINGER_S + 2


def test_bounded_executor_refuses_beyond_its_queue():
    ex = BoundedExecutor(workers=1, queue=1)

    async def go():
        import threading

        gate = threading.Event()
        first = asyncio.ensure_future(ex.run(gate.wait, 5))
        second = asyncio.ensure_future(ex.run(lambda: "queued"))
        await asyncio.sleep(0.05)
        with pytest.raises(ProtocolError) as exc:
            await ex.run(lambda: "third")
        assert exc.value.code is RejectCode.RATE_LIMITED
        gate.set()
        return await first, await second

    assert asyncio.run(go()) == (True, "queued")
    assert ex.pending == 0 and ex.stats.executor_refused == 1
    ex.shutdown()


def test_serve_budget_favours_trusted_peers_and_caps_strangers_together():
    budget = ServeBudget(trusted=lambda p: p == "volunteer", stranger_bps=1_000_000, stranger_peer_bps=500_000,
                         max_wait_s=0.5, burst_bytes=1_000_000)

    async def go():
        # 40 fresh peer ids asking for 100 kB each at once: 4 MB against a 1 MB burst + 1 MB/s
        got = await asyncio.gather(*(budget.charge(f"sybil-{i}", 100_000) for i in range(40)), return_exceptions=True)
        errors = [g for g in got if g is not None]
        assert all(isinstance(e, ProtocolError) and e.code is RejectCode.RATE_LIMITED for e in errors)
        refused = len(errors)
        t0 = time.monotonic()
        for _ in range(5):
            await budget.charge("volunteer", 1_000_000)  # unlimited trusted share: never refused nor delayed
        return refused, time.monotonic() - t0

    refused, trusted_wait = asyncio.run(go())
    assert refused == 25  # burst (10 requests) + at most 0.5 s of waiting (5): the shared rate held
    assert budget.bytes_strangers == 1_500_000
    assert trusted_wait < 0.1 and budget.bytes_trusted == 5_000_000


def test_peers_without_a_track_record_share_only_part_of_the_budget():
    gate = InboundGate(InboundLimits(max_inflight_bytes=1000, max_inflight_bytes_per_peer=400, untrusted_share=0.5),
                       trusted=lambda peer: peer.startswith("volunteer"))
    with gate.reserve("fresh-1", 300), gate.reserve("fresh-2", 200):
        with pytest.raises(ProtocolError) as exc:  # strangers together: 500 of 1000 already
            with gate.reserve("fresh-3", 1):
                pass
        assert exc.value.code is RejectCode.RATE_LIMITED
        with gate.reserve("volunteer-a", 400), gate.reserve("volunteer-b", 100):  # the rest is theirs
            assert gate.inflight_bytes == 1000
    assert gate.inflight_bytes == 0 and gate.untrusted_bytes == 0 and not gate.bytes_by_peer


def test_a_zero_byte_request_overlapping_another_of_the_same_peer_is_answered():
    """A peer's empty request that starts before and ends after its own non-empty one (any order of ending):
    each is answered by its handler, and the peer's books end empty (not INTERNAL from a KeyError)."""
    gate = InboundGate(InboundLimits())

    async def go():
        release_empty, release_full = asyncio.Event(), asyncio.Event()
        started = {"empty": asyncio.Event(), "full": asyncio.Event()}

        async def held(request, peer):
            which = "full" if request else "empty"
            started[which].set()
            await (release_full if request else release_empty).wait()
            return which.encode()

        on_stream = stream_handler(gate, "t", held, max_request_bytes=1 << 20)

        def start(body: bytes):
            reader = asyncio.StreamReader()
            reader.feed_data(frame(body))
            reader.feed_eof()
            writer = RecordingWriter()
            return asyncio.ensure_future(on_stream(PeerInfo("p"), reader, writer)), writer

        empty, w_empty = start(b"")
        await started["empty"].wait()
        full, w_full = start(b"x" * 100)
        await started["full"].wait()
        assert gate.bytes_by_peer == {"p": 100}
        release_full.set()  # the non-empty one ends first, then the empty one
        await full
        release_empty.set()
        await empty
        return w_empty, w_full

    w_empty, w_full = asyncio.run(go())
    assert w_empty.answer() == (STATUS_OK, b"empty") and w_full.answer() == (STATUS_OK, b"full")
    assert gate.inflight_bytes == 0 and gate.streams == 0 and not gate.bytes_by_peer and not gate.by_peer
