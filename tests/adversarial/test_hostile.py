"""Attacks that used to cost honest volunteers their throughput (issue 43), each measured on alice's and bob's
acked batches per minute: a baseline window, then the attack's window, in the same test (a ratio within one
test, so a loaded machine slows both alike). Each row asserts the ratio >= HONEST_RATIO, 0 honest batches
lost (the `attack` fixture) and 0 forged batches trained:

  * zero-byte requests overlapping other requests of the same peer (swarm/inbound.py): never INTERNAL;
  * Sybil keys reporting every leased prompt unscorable (coordinator/leasing/taskboard.py): nothing is retired;
  * a crowd of fresh keys waiting for room (coordinator/leasing/leasing.py FairShare): proven volunteers stay in front;
  * copies of a volunteer's lease requests from other peers (coordinator/leasing/leasing.py): never leases on her key;
  * her accepted payload re-sealed under another key (coordinator/ingest/receipts.py): no receipt of hers to a stranger;
  * unproven peers that fill seeder slots and serve nobody (swarm/seeder_service.py): dropped on measured service;
  * one peer flooding the handshake stream with dial-back requests (coordinator/leasing/handshake.py): answered at its
    own rate, and honest doctor checks are still dialled back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest

from asyncrl.client.lease_keeper import LeaseKeeper
from asyncrl.protocol import messages, receipts
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity
from asyncrl.runlog import read_events
from asyncrl.swarm import streams
from asyncrl.swarm.streams import stream_name

from tests.adversarial.swarm import RUN_ID, sealed_request, wait_for

pytestmark = pytest.mark.integration

WINDOW_S = 72.0  # baseline and attack each, in all
PAIRS = 6  # ...interleaved as PAIRS (baseline, attack) pairs, so a change in the machine's load hits both alike
# Why 6 x 12 s: alice and bob ack ~5 batches a second here, in bursts, with no ack at all for 22 % of the time
# (1-3 s gaps: adapter fetches, learner steps, the other xdist worker's tests). Resampled from a CI run's ack
# timeline with no attack effect, the ratio read below 0.8 / 0.93 (a row's usual ratio) in 10.6 % of 6 x 8 s
# windows, 4.9 % of 4 x 12 s and 0.4 % of 6 x 12 s: the fail of CI 2026-12-07 (0.77) was that noise.
HONEST_RATIO = 0.8  # acked batches per minute during the attack / during the baseline
PAUSE_S = 0.5  # between two rounds of an attack: a round is several requests, far above any honest volunteer's
# rate (about one lease request a second), while the attacker's own CPU — which on this 2-core test machine is
# alice's and bob's too — stays a small part of what is measured


ROWS = {  # the table's rows (docs/SECURITY.md): what mallory does, and what stops it
    "zero-byte overlap": (
        "3 fresh peer ids send zero-byte lease and submit requests, each overlapping non-empty requests of the "
        "same peer (handshake stream)",
        "the inbound gate reserves nothing for an empty request: never INTERNAL, no traceback logged"),
    "poison reports": (
        "8 fresh keys lease prompts and report every one unscorable, round after round (the built-in task's "
        "4 records, many times over)",
        "reports weigh by the reporter's standing: keys without accepted batches together count as one and never "
        "retire a record alone; at most a quarter of a task's records can be retired"),
    "Sybil idle crowd": (
        "10 fresh keys hold the leases their share allows, renew them, and keep asking for more (each waits in "
        "the idle line) every second, so proven volunteers find a crowd ahead of them",
        "a proven volunteer joins the idle line behind proven waiters only; fresh keys hold at most their share "
        "of the in-flight room together"),
    "lease-request copies": (
        "copies of a new volunteer's lease requests (before her first accepted batch), replayed from 3 peer ids "
        "of mallory's, round after round",
        "a request acts once (NONCE_REUSED; the guard outlives a restart: lease_replay.bin) and a copy from "
        "another peer never leases on her key; she keeps all her leases and her batch is accepted"),
    "handshake flood": (
        "one peer id sends 16 handshakes at once, each asking for a dial-back of its ports, round after round; "
        "3 honest doctor checks (fresh peer ids) ask for theirs during the flood",
        "each peer id has its own handshake bucket (2/s, 20 at once) and its own dial-back allowance, and a "
        "dial-back goes only to ports the caller connects from or announces"),
    "bad seeders": (
        "in each attack window 3 fresh peer ids of mallory's pass the coordinator's probe and announce they serve, "
        "so with 2 proven volunteers they fill seeder slots: one refuses every chunk at once, one never answers (a tarpit), one holds every "
        "long poll to its end, says \"not yet\", and drains chunks from the coordinator meanwhile",
        "right after a version is published the coordinator asks each seeder for one of its chunks: one that "
        "refuses at once, never answers or misses twice is dropped from the record at once and for a doubling "
        "while; fetchers back each seeder off on their own"),
    "receipt fishing": (
        "a volunteer's accepted payload re-sealed under 3 keys of mallory's (same batch id), and copies of her "
        "envelope from a peer id of mallory's, round after round",
        "accepted as a duplicate, but a receipt goes only to the key it was issued to, from its own peer; her "
        "own retry still gets hers"),
}


def open_row(attack, name: str):
    description, note = ROWS[name]
    return attack(name, description, note=note)


def honest_windows(swarm, step, pause_s: float = PAUSE_S, *, pairs: int = PAIRS, window_s: float = WINDOW_S / PAIRS,
                   begin=None, end=None, min_acked: int = 0, max_pairs: int = 0) -> dict:
    """alice's and bob's acked batches per minute with and without the attack: `pairs` pairs of windows of
    `window_s` seconds each, first without, then with `step()` (one round of the attack) run again and again,
    `pause_s` apart, on a thread of its own. With `min_acked`, pairs are added (up to `max_pairs` in all) until
    the baseline windows counted that many acks: a loaded machine acks fewer batches per window, and a ratio of
    few events is noisy. The rule looks at the baseline's count only, never at the ratio.

    An attack that cannot be paused (it changes what the coordinator remembers, e.g. whom it chose as a
    seeder) starts afresh in each attack window instead: `begin()` is called as the window opens (inside it:
    keep it cheap), `end()` after it closes, outside every window (it may wait, e.g. until the coordinator
    has forgotten the attackers, so that nothing of the attack reaches the next baseline window)."""
    active, stop, errors = threading.Event(), threading.Event(), []
    stepping = threading.Lock()  # held while a round runs: `end()` waits for the round in flight

    def run():
        try:
            while not stop.is_set():
                if active.wait(0.1):
                    with stepping:
                        step()
                    stop.wait(pause_s)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on the test's thread
            errors.append(exc)

    worker = threading.Thread(target=run, name="attack", daemon=True)
    worker.start()
    totals = {"baseline": [0, 0.0], "attack": [0, 0.0]}
    spans: list[tuple[str, float, float]] = []  # (phase, wall-clock start, end) of each window
    try:
        done = 0
        while done < pairs or (totals["baseline"][0] < min_acked and done < max_pairs):
            for phase in ("baseline", "attack"):
                a0, t0, wall = swarm.acked(), time.monotonic(), time.time()
                if phase == "attack":
                    if begin is not None:
                        begin()
                    active.set()
                stop.wait(window_s)  # a measurement window, not an ordering of events
                active.clear()
                totals[phase][0] += swarm.acked() - a0
                totals[phase][1] += time.monotonic() - t0
                spans.append((phase, wall, time.time()))
                if phase == "attack" and end is not None:
                    with stepping:
                        end()
                if errors:
                    raise errors[0]
            done += 1
    finally:
        stop.set()
        worker.join(120)
    if errors:
        raise errors[0]
    base, during = (60.0 * n / s for n, s in (totals["baseline"], totals["attack"]))
    return {"baseline_per_min": round(base, 1), "attack_per_min": round(during, 1),
            "ratio": round(during / base, 2) if base else 0.0, "baseline_acked": totals["baseline"][0],
            "attack_acked": totals["attack"][0], "spans": spans}


def trained_in(swarm, spans) -> dict:
    """Per phase, the groups the learner trained and those it dropped as too stale, by its step events within
    the windows `spans` (honest_windows): what acks alone do not show — an honest volunteer that generates with
    an old adapter version is acked, and its groups are then dropped."""
    out = {"baseline": [0, 0], "attack": [0, 0]}
    for e in read_events(swarm.run, "step"):
        for phase, t0, t1 in spans:
            if t0 <= e["t"] < t1:
                out[phase][0] += e.get("groups", 0)
                out[phase][1] += e.get("dropped_stale", 0)
    return out


def code_of(fn, ok: str) -> str:
    """`ok` when `fn()` is answered, else the code it was refused with."""
    try:
        fn()
        return ok
    except ProtocolError as exc:
        return exc.code.value


def figures(w: dict) -> str:
    return (f"alice+bob acked {w['baseline_per_min']:.0f}/min in the baseline window, {w['attack_per_min']:.0f}/min "
            f"during the attack (ratio {w['ratio']:.2f})")


def assert_kept_pace(w: dict) -> None:
    assert w["baseline_acked"] > 0 and w["ratio"] >= HONEST_RATIO, w


def coordinator_tracebacks(swarm) -> int:
    log = swarm.root / "coordinator.log"
    return log.read_text(errors="replace").count("Traceback") if log.exists() else 0


def test_zero_byte_requests_overlapping_others_of_the_same_peer(mallory, swarm, attack):
    rec = open_row(attack, "zero-byte overlap")
    tracebacks = coordinator_tracebacks(swarm)
    codes: list[str] = []

    async def one_round(node):
        async def ask(name, body):
            try:
                await node.acall(swarm.coordinator_peer, name, body, max_response_bytes=1 << 16)
                return "OK"
            except ProtocolError as exc:
                return exc.code.value
            except Exception:  # noqa: BLE001 - a stream p2pd dropped: no answer to count
                return "CLOSED"
        return await asyncio.gather(ask(stream_name(RUN_ID, streams.LEASE), b""),
                                    ask(stream_name(RUN_ID, streams.SUBMIT), b""),
                                    *(ask(streams.INFO, b"\x01" * 64) for _ in range(2)))

    nodes = [mallory.new_node() for _ in range(3)]  # made before the windows: the attacker's CPU is ours here

    rounds = [0]

    def flood():  # an empty request is MALFORMED: each peer id strikes itself out (then NOT_ALLOWED)
        node = nodes[rounds[0] % len(nodes)]
        codes.extend(node.loops.run(one_round(node), timeout=60))
        rounds[0] += 1

    w = honest_windows(swarm, flood)
    for c in codes:
        rec.saw(c, rejected=c != "OK")
    rec.note += f"; {figures(w)}"
    assert codes and "INTERNAL" not in codes, codes
    assert coordinator_tracebacks(swarm) == tracebacks
    assert_kept_pace(w)


def sybil_keys(mallory, n: int) -> list[Identity]:
    """`n` fresh keys the coordinator has seen (each leased once), within the new-identity brake."""
    keys = [Identity.generate() for _ in range(n)]
    for k in keys:
        mallory.lease(k, 1)
    return keys


def test_sybil_keys_reporting_every_prompt_unscorable_retire_nothing(mallory, swarm, attack):
    rec = open_row(attack, "poison reports")
    keys = sybil_keys(mallory, 8)
    retired0 = (swarm.trust().get("books") or {}).get("prompts_retired", 0)
    codes: list[str] = []

    def report_all(k) -> None:  # lease what the key may, report all of it unscorable
        ids = tuple(l.lease_id for l in mallory.lease_once(k, 4).leases)
        if ids:
            mallory.call("lease", sealed_request(swarm, k, unscorable=ids))
        codes.extend(["REPORTED"] * len(ids) or ["WAIT"])

    def report():
        for k in keys:
            code = code_of(lambda: report_all(k), "")
            if code:
                codes.append(code)

    w = honest_windows(swarm, report)
    ended = time.time()
    books = wait_for(lambda: (swarm.run / "trust.json").stat().st_mtime > ended and swarm.trust().get("books"), 60,
                     "trust.json written after the reports")
    for c in codes:
        rec.saw(c, rejected=c == "REPORTED")
    rec.note += f"; records retired by the reports: {books.get('prompts_retired', 0) - retired0}; {figures(w)}"
    assert codes.count("REPORTED") >= 8, codes
    assert books.get("prompts_retired", 0) == retired0, books
    assert_kept_pace(w)


def test_a_crowd_of_fresh_keys_waiting_for_room_does_not_hold_back_proven_volunteers(mallory, swarm, attack):
    rec = open_row(attack, "Sybil idle crowd")
    keys = sybil_keys(mallory, 10)
    held: dict[bytes, list[str]] = {k.public_key: [] for k in keys}
    codes: list[str] = []

    def hold_and_ask(k) -> None:  # renew what it holds, ask for more
        mine = held[k.public_key]
        if mine:
            left = mallory.renew(k, mine)
            held[k.public_key] = [lid for lid in mine if left.get(lid, 0) > 0]
        grant = mallory.lease_once(k, 4)
        held[k.public_key] += [l.lease_id for l in grant.leases]
        if not grant.leases:
            raise ProtocolError(RejectCode.RATE_LIMITED, "empty grant")  # counted as WAIT below

    def crowd():
        for k in keys:
            code = code_of(lambda: hold_and_ask(k), "GRANTED")
            codes.append("WAIT" if code == "RATE_LIMITED" else code)

    w = honest_windows(swarm, crowd, pause_s=1.0)  # 20 requests a round: twice a round's usual pause
    for c in codes:
        rec.saw(c, rejected=c != "GRANTED")
    rec.note += f"; {figures(w)}"
    assert codes, codes
    assert_kept_pace(w)


@pytest.fixture(scope="module")
def vee(package_mallory):
    """A volunteer run from the test process: her own key and peer id (her node lives as long as this module)."""
    ident = Identity.generate()
    node = package_mallory.own_node(ident, track=False)
    yield ident, node
    node.shutdown()


def test_copies_of_a_volunteers_lease_requests_never_lease_on_her_key(mallory, swarm, vee, attack):
    rec = open_row(attack, "lease-request copies")
    ident, node = vee
    senders = [mallory.new_node() for _ in range(3)]

    def ask(n):  # her own request, from her own peer, sealed afresh each try (as her client does)
        sealed = sealed_request(swarm, ident, n)
        try:
            grant = messages.decode(mallory.call("lease", sealed, node), messages.LeaseGrant, max_bytes=4 << 20)
        except ProtocolError as exc:
            if exc.code.value == "RATE_LIMITED":  # the new-identity brake: she waits, as a client does
                return None
            raise
        return (sealed, grant) if grant.leases else None

    sent = [wait_for(lambda: ask(n), 90, "a lease for vee", interval=0.5) for n in (1, 2)]
    mine = [l for _, g in sent for l in g.leases]
    codes: list[str] = []

    def replay():
        codes.extend(code_of(lambda: mallory.call("lease", sealed, sender), "GRANTED")
                     for sender in senders for sealed, _ in sent)

    with LeaseKeeper(lambda ids: mallory.renew(ident, ids, node), mine):  # she works on them meanwhile
        w = honest_windows(swarm, replay)
        left = mallory.renew(ident, [l.lease_id for l in mine], node)  # hers alone, all still held
        adapter = mallory.follow()
        groups = mallory.generate(mine, adapter)
    for c in codes:
        rec.saw(c, rejected=c != "GRANTED")
    rec.note += f"; {figures(w)}"
    assert codes and set(codes) <= {"NONCE_REUSED", "EXPIRED", "RATE_LIMITED", "NOT_ALLOWED"}, set(codes)
    assert len(left) == len(mine) and all(v > 0 for v in left.values()), left
    payload = messages.encode(mallory.batch(groups, adapter.version, client_name="vee"))
    code, _ = mallory.deliver(ident, payload, node=node)  # her batch: accepted (her key untouched by the copies)
    rec.honest_extra = int(code != "ACCEPTED")
    assert code == "ACCEPTED", code
    assert_kept_pace(w)


def test_a_resealed_payload_never_returns_her_receipt(mallory, swarm, vee, attack):
    rec = open_row(attack, "receipt fishing")
    ident, node = vee
    adapter = mallory.follow()
    leases = mallory.lease(ident, 1, node=node)
    payload = messages.encode(mallory.batch(mallory.generate(leases, adapter), adapter.version, client_name="vee"))
    sealed = mallory.seal(ident, payload)
    code, ack = mallory.submit(sealed, node=node)
    assert code == "ACCEPTED" and ack.receipt, code
    own = receipts.open_receipt(ack.receipt, coordinator_key=swarm.coordinator_key, volunteer_key=ident.public_key)
    strangers = [Identity.generate() for _ in range(3)]
    sender = mallory.new_node()
    leaked: list[bytes] = []
    codes: list[str] = []

    def fish():
        for k in strangers:
            for sealed_copy, via in ((mallory.seal(k, payload), None), (sealed, sender)):
                c, a = mallory.submit(sealed_copy, node=via)
                codes.append(c)
                if a is not None and a.receipt:
                    leaked.append(a.receipt)

    w = honest_windows(swarm, fish)
    for c in codes:
        rec.saw(c, rejected=True)
    again = mallory.submit(mallory.seal(ident, payload), node=node)[1]  # her own retry (a lost ack)
    rec.note += f"; receipts handed to strangers: {len(leaked)}; {figures(w)}"
    assert codes and leaked == [], (codes, len(leaked))
    assert again is not None and again.receipt == ack.receipt and own.batch_id == ack.batch_id
    assert_kept_pace(w)


def test_a_handshake_flood_is_answered_at_its_peer_rate_and_honest_dial_backs_are_still_made(mallory, swarm, attack):
    from asyncrl.client.checks import exchange
    from asyncrl.client.doctor import _listen_ports
    from asyncrl.protocol import handshake

    rec = open_row(attack, "handshake flood")
    flooder = mallory.new_node()
    doctors = [mallory.new_node() for _ in range(3)]
    request = handshake.encode(handshake.InfoRequest(client_version=handshake.package_version(),
                                                     dial_back_ports=_listen_ports(flooder)))
    codes: list[str] = []

    async def burst():
        async def one():
            try:
                await flooder.acall(swarm.coordinator_peer, streams.INFO, request,
                                    max_response_bytes=handshake.MAX_INFO_BYTES)
                return "OK"
            except ProtocolError as exc:
                return exc.code.value
            except Exception:  # noqa: BLE001 - a stream p2pd dropped: no answer to count
                return "CLOSED"
        return await asyncio.gather(*(one() for _ in range(16)))  # 32 a second: 16x its rate

    def flood():
        codes.extend(flooder.loops.run(burst(), timeout=60))

    w = honest_windows(swarm, flood)
    flooding, stop = threading.Event(), threading.Event()

    def keep_flooding():
        while not stop.is_set():
            flood()
            flooding.set()
    thread = threading.Thread(target=keep_flooding, daemon=True)
    thread.start()
    try:
        flooding.wait(60)
        checks = [exchange(d, swarm.coordinator_peer, dial_back_ports=_listen_ports(d)) for d in doctors]
    finally:
        stop.set()
        thread.join(60)
    reachable = [bool(c.info.reachable_ports) for c in checks]
    for c in codes:
        rec.saw(c, rejected=c != "OK")
    rec.note += f"; honest doctor dial-backs during the flood: {sum(reachable)} of {len(reachable)} reachable; {figures(w)}"
    assert codes.count("RATE_LIMITED") > codes.count("OK"), dict(Counter(codes))
    assert all(reachable), [c.info for c in checks]
    assert_kept_pace(w)


class BadSeeder:
    """A node of mallory's that passes the coordinator's probe (it refuses the probe's version at once, as any
    honest server does) and announces that it serves, so it can be chosen a seeder; then it serves nobody:
    `quick` refuses every request at once, `tarpit` never answers one, `slow` holds every long poll to its end
    and then says "not yet". It counts who asked it for what (probes left out), and when each first asked."""

    def __init__(self, mallory, kind: str):
        from asyncrl.swarm.records import PresenceBeacon

        self.kind = kind
        self.ident = Identity.generate()
        self.node = mallory.own_node(self.ident, track=False)  # shut down by `close`, when its window is over
        self.asked: Counter = Counter()  # peer id -> manifest and chunk requests
        self.first_asked: dict[str, float] = {}  # peer id -> wall-clock time of its first request
        self.closed = False  # a held request gives up (so none is pending when the node shuts down)
        self.inflight = 0
        for name, wait_at in ((streams.MANIFEST, 8), (streams.CHUNK, 12)):
            self.node.serve(stream_name(RUN_ID, name), self._handler(wait_at), max_request_bytes=64)
        self.beacon = PresenceBeacon(self.node, self.ident, RUN_ID, f"mallory-{kind}", lambda: {
            "adapter_version": 0, "versions": [], "serving": True}, every_s=1.0)

    def _handler(self, wait_at: int):
        from asyncrl.swarm.providers import PROBE_VERSION

        async def answer(request: bytes, peer: str) -> bytes:
            if int.from_bytes(request[:8], "big") != PROBE_VERSION:
                self.asked[peer] += 1
                self.first_asked.setdefault(peer, time.time())
                held = 120.0 if self.kind == "tarpit" else 0.0
                if self.kind == "slow" and len(request) == wait_at + 4:
                    held = min(10.0, int.from_bytes(request[wait_at:], "big") / 1000)
                until = time.monotonic() + held
                self.inflight += 1
                try:
                    while not self.closed and time.monotonic() < until:
                        await asyncio.sleep(min(0.2, max(0.0, until - time.monotonic())))
                finally:
                    self.inflight -= 1
            raise ProtocolError(RejectCode.STALE_VERSION, "chunk not held")
        return answer

    def close(self) -> None:
        """Stop announcing, let go of held requests, and leave the swarm (once)."""
        if self.closed:
            return
        self.beacon.stop()
        self.closed = True
        try:
            wait_for(lambda: self.inflight == 0, 30, f"mallory's {self.kind} seeder to let go of held requests")
        finally:
            self.node.shutdown()


def load_average() -> str:
    import os

    return "/".join(f"{x:.1f}" for x in os.getloadavg())


SEEDER_PAIRS, SEEDER_WINDOW_S = 3, 20.0
"""The bad-seeders row's windows: a fresh set of seeders in each attack window (a dropped seeder stays dropped,
so the same set would cost nothing after its first window), and longer windows than the other rows', since a
new set is chosen only after the coordinator has read its presence (every 5 s) and probed it (every 5 s)."""


def test_unproven_seeders_that_serve_nobody_are_dropped_on_measured_service(mallory, swarm, attack):
    from asyncrl.protocol import swarm as records
    from asyncrl.swarm.serving import chunk_request

    rec = open_row(attack, "bad seeders")
    honest_peers = {Identity.load(d / "identity.key").peer_id for d in swarm.honest.values()}

    def new_set() -> list[BadSeeder]:  # made between windows: the attacker's CPU is ours here
        return [BadSeeder(mallory, kind) for kind in ("quick", "tarpit", "slow")]

    sets = [new_set()]
    windows: list[tuple[float, float]] = []  # wall-clock span of each attack window
    codes: list[str] = []
    loads = [load_average()]

    def named_none(bad: list[BadSeeder]):  # the coordinator's record names none of `bad`
        raw = mallory.node.get(records.providers_key(RUN_ID, swarm.coordinator_peer, 0))
        if not isinstance(raw, bytes):
            return None
        record = records.check_providers(raw, coordinator_key=swarm.coordinator_key, run_id=RUN_ID, shard=0)
        named = set(record.seeders) | {h.peer_id for h in record.holders}
        return record if not named & {b.node.peer_id for b in bad} else None

    def begin():
        windows.append((time.time(), 0.0))
        for b in sets[-1]:
            b.beacon.start()

    def end():
        """After an attack window: the coordinator chose and checked this window's set (the attack landed),
        they leave, the record names none of them before the next baseline window opens, and the next
        window's set is made."""
        windows[-1] = (windows[-1][0], time.time())
        bad = sets[-1]
        try:
            wait_for(lambda: all(b.asked[swarm.coordinator_peer] for b in bad), 90,
                     "the coordinator to choose and check each of mallory's seeders")
        finally:
            for b in bad:
                b.close()
        wait_for(lambda: named_none(bad), 60, "a providers record naming none of mallory's seeders")
        if len(sets) < SEEDER_PAIRS:
            sets.append(new_set())

    def drain():  # the slow seeder drains chunk 0 of the newest version, 4 requests at once
        slow = sets[-1][-1]
        version = swarm.current_version()

        async def one():
            try:
                await slow.node.acall(swarm.coordinator_peer, stream_name(RUN_ID, streams.CHUNK),
                                      chunk_request(version, 0), max_response_bytes=4 << 20)
                return "PACED"
            except ProtocolError as exc:
                return exc.code.value
            except Exception:  # noqa: BLE001 - a stream p2pd dropped: no answer to count
                return "CLOSED"

        async def burst():
            return await asyncio.gather(*(one() for _ in range(4)))
        codes.extend(slow.node.loops.run(burst(), timeout=60))

    try:
        w = honest_windows(swarm, drain, pairs=SEEDER_PAIRS, window_s=SEEDER_WINDOW_S, begin=begin, end=end)
    finally:
        for bad in sets:
            for b in bad:
                b.close()
    loads.append(load_average())
    for c in codes:
        rec.saw(c, rejected=c != "PACED")
    for bad in sets:
        for b in bad:
            rec.saw("DROPPED")
    kinds = ("quick", "tarpit", "slow")
    honest_asks = {k: sum(n for bad in sets for b in bad if b.kind == k for p, n in b.asked.items()
                          if p in honest_peers) for k in kinds}
    checks = {k: sum(b.asked[swarm.coordinator_peer] for bad in sets for b in bad if b.kind == k) for k in kinds}
    in_window = sum(all(b.first_asked[swarm.coordinator_peer] <= t1 for b in bad)
                    for bad, (t0, t1) in zip(sets, windows))
    groups = trained_in(swarm, w["spans"])
    rec.note += (f"; {len(sets)} sets of 3 seeders, a fresh set in each attack window ({SEEDER_WINDOW_S:.0f} s, "
                 f"interleaved with as many baseline windows; a set leaves and the record names none of it before "
                 f"the next baseline window opens); sets checked by the coordinator within their window: "
                 f"{in_window} of {len(sets)}; requests alice and bob sent them: {honest_asks}; the coordinator's "
                 f"service checks: {checks}; load average {loads[0]} before, {loads[1]} after; {figures(w)}; "
                 f"groups the learner dropped as too stale (an honest volunteer held back on an old version is "
                 f"acked, then dropped): {groups['baseline'][1]} of {sum(groups['baseline'])} in the baseline "
                 f"windows, {groups['attack'][1]} of {sum(groups['attack'])} during the attack")
    assert len(sets) == len(windows) == SEEDER_PAIRS
    assert_kept_pace(w)
