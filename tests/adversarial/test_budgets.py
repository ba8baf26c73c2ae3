"""mallory vs the inbound budgets (swarm/inbound.py, swarm/serving.py ServeBudget, protocol/messages.py caps):
many fresh peer ids holding stalled uploads, slow-drip streams, draining the coordinator's adapter uplink,
a signed msgpack list bomb and an oversized name. alice and bob keep contributing throughout."""

from __future__ import annotations

import threading

import msgspec
import pytest

from asyncrl.protocol import envelope, messages
from asyncrl.protocol.errors import ProtocolError
from asyncrl.protocol.identity import Identity

from tests.adversarial.swarm import (
    INBOUND_BYTES,
    MIN_UPLOAD_BPS,
    RUN_ID,
    MiB,
    wait_for,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def strangers(mallory):
    """Three fresh peer ids of mallory's (peer ids are free to mint)."""
    return [mallory.new_node() for _ in range(3)]


def test_many_peer_ids_cannot_hold_the_byte_budget(mallory, swarm, strangers, attack):
    per_stream, streams = 4 * MiB, 6
    rec = attack("many peer ids flooding", f"{len(strangers)} fresh peer ids each open {streams} uploads announcing "
                 f"{per_stream // MiB} MiB and stall", note=f"peers without accepted batches may hold "
                 f"{INBOUND_BYTES // 2 // MiB} MiB together; the admitted streams are cut at their deadline")
    rss0, acked0 = swarm.rss_bytes(), swarm.acked()
    results: dict[int, list[str]] = {}

    def flood(i, node):
        results[i] = mallory.stall("submit", per_stream, streams, node, timeout=90)

    threads = [threading.Thread(target=flood, args=(i, n)) for i, n in enumerate(strangers)]
    for t in threads:
        t.start()
    # While the flood holds what it can, the volunteers already contributing keep being accepted.
    wait_for(lambda: swarm.acked() >= acked0 + 3, 60, "alice and bob to be acked during the flood")
    for t in threads:
        t.join(120)
    codes = [c for r in results.values() for c in r]
    assert len(codes) == len(strangers) * streams and set(codes) <= {"RATE_LIMITED", "DEADLINE_EXCEEDED"}, codes
    admitted = codes.count("DEADLINE_EXCEEDED")
    assert admitted * per_stream <= INBOUND_BYTES // 2, codes  # never more than the strangers' share, all ids together
    assert codes.count("RATE_LIMITED") >= len(codes) - INBOUND_BYTES // 2 // per_stream
    for c in codes:
        rec.saw(c)
    assert swarm.rss_bytes() - rss0 < 64 * MiB


def test_slow_drip_and_stalled_headers_are_cut(mallory, swarm, strangers, attack):
    body = 1 * MiB
    deadline = 10 + body / MIN_UPLOAD_BPS
    rec = attack("slow-drip streams", f"uploads announcing {body // MiB} MiB sent at 1 KiB/s, and streams that send "
                 "half a frame header and stop", note=f"cut at their deadline (10 s + length / {MIN_UPLOAD_BPS // 1024} "
                 "KiB/s); nothing of theirs is kept")
    out: dict[str, list[str]] = {}
    stall = threading.Thread(target=lambda: out.update(
        stalled=mallory.stall("lease", 100, 4, strangers[1], partial_header=True, timeout=40)))
    stall.start()  # both kinds at once, from two peers
    drips = mallory.stall("submit", body, 4, strangers[0], drip_bps=1024, timeout=deadline + 30)
    stall.join(90)
    stalled = out.get("stalled")
    # The coordinator itself answered each one DEADLINE_EXCEEDED at its deadline (a hang-up would read CLOSED).
    assert drips == ["DEADLINE_EXCEEDED"] * 4 and stalled == ["DEADLINE_EXCEEDED"] * 4, (drips, stalled)
    for c in drips + stalled:
        rec.saw(c)


def test_a_signed_list_bomb_is_refused_from_its_header(mallory, swarm, attack):
    rec = attack("msgpack list bomb", "a correctly signed batch whose payload's schema field is a list of 2 million "
                 "empty lists (~2 MB that would become 2M Python objects)", note="coordinator RSS growth measured")
    ident = Identity.generate()
    mallory.lease(ident, 1)  # a key the coordinator has seen, so only the bomb is judged
    rss0 = swarm.rss_bytes()
    for where in ("schema", "groups"):
        raw = msgspec.to_builtins(mallory.batch([], 0))
        raw[where] = [[]] * 2_000_000
        code, _ = mallory.submit(mallory.seal(ident, msgspec.msgpack.encode(raw)))
        assert code == "MALFORMED", code
        rec.saw(code)
    grew = swarm.rss_bytes() - rss0
    assert grew < 32 * MiB, grew
    rec.note += f" (RSS growth {grew / MiB:.1f} MiB)"


def test_an_oversized_name_is_refused(mallory, swarm, attack):
    rec = attack("oversized free text", "a signed lease request whose client_name is 60 KB (it used to be kept and "
                 "written to trust.json on every save)")
    ident = Identity.generate()
    req = messages.LeaseRequest(run_id=RUN_ID, max_prompts=1, adapter_version=0, client_name="m" * 60_000)
    sealed = envelope.seal(ident, "lease_request", messages.encode(req), audience=swarm.coordinator_key)
    with pytest.raises(ProtocolError) as exc:
        mallory.call("lease", sealed)
    rec.saw(exc.value.code.value)
    assert exc.value.code.value == "MALFORMED"
    assert all(len(c.get("name", "")) <= 64 for c in swarm.trust()["clients"].values())
