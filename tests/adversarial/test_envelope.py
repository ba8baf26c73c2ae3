"""mallory vs the envelope: forged signatures, tampering, replays, foreign audiences, stale timestamps,
oversized frames and fuzzed bytes. Each refusal must carry the right code and cost alice and bob nothing."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity

from tests.adversarial.swarm import batch_id_of, corrupt, wait_for

pytestmark = pytest.mark.integration


def honest_sealed(mallory, ident=None, n=1, node=None):
    """A batch mallory generated honestly for her own lease (so only the tampering can fail it)."""
    ident = ident or mallory.identity
    leases = mallory.lease(ident, n, node=node)
    current = mallory.follow()
    groups = mallory.generate(leases, current)
    payload = messages.encode(mallory.batch(groups, current.version))
    return ident, payload


def test_forged_signature(mallory, swarm, attack):
    rec = attack("forged signature", "batch claiming alice's key, signed by mallory")
    _, payload = honest_sealed(mallory)
    sealed = mallory.seal(mallory.identity, payload)
    forged = sealed[:4] + swarm.honest_key("alice") + sealed[36:]  # alice's key, mallory's signature
    code, _ = mallory.submit(forged)
    rec.saw(code)
    assert code == "SIGNATURE_MISMATCH"
    random_sig = sealed[:36] + os.urandom(64) + sealed[100:]
    code, _ = mallory.submit(random_sig)
    rec.saw(code)
    assert code == "SIGNATURE_MISMATCH"


def test_tampered_payload(mallory, attack):
    rec = attack("tampered payload", "one bit of a signed batch flipped in transit")
    _, payload = honest_sealed(mallory)
    sealed = mallory.seal(mallory.identity, payload)
    for at in (len(sealed) - 5, len(sealed) // 2):
        code, _ = mallory.submit(corrupt(sealed, at))
        rec.saw(code)
        assert code == "SIGNATURE_MISMATCH"


def test_replayed_batch(mallory, swarm, attack):
    rec = attack("replayed batch", "an accepted batch sent again (same bytes, re-sealed) and a refused one replayed")
    ident = Identity.generate()
    # From the key's own peer id, as a volunteer sends: copies from another peer are that peer's problem
    # (tests/adversarial/test_honest.py), here the signer's own books must show the replays.
    node = mallory.own_node(ident)
    _, payload = honest_sealed(mallory, ident, node=node)
    sealed = mallory.seal(ident, payload)
    assert mallory.final_code(sealed, node=node) == "ACCEPTED"  # honest work by a new key passes its audit
    fp = ident.fingerprint
    code, ack = mallory.submit(sealed, node=node)  # byte-identical replay
    rec.saw(code)
    assert code == "DUPLICATE_BATCH" and ack.batch_id == batch_id_of(sealed)
    code, _ = mallory.submit(mallory.seal(ident, payload), node=node)  # same payload, fresh nonce and timestamp
    rec.saw(code)
    assert code == "DUPLICATE_BATCH"
    # A refused envelope replayed: its nonce is spent.
    refused = mallory.seal(ident, messages.encode(mallory.batch(
        mallory.generate(mallory.lease(ident, 1, node=node)), mallory.sync.current.version, run_id="another-run")))
    assert mallory.submit(refused, node=node)[0] == "WRONG_RUN"
    code, _ = mallory.submit(refused, node=node)
    rec.saw(code)
    assert code == "NONCE_REUSED"
    # trust.json is rewritten every few seconds: judge the first one that already shows the last refusal
    book = wait_for(lambda: (lambda c: c.get("rejected", {}).get("NONCE_REUSED", 0) >= 1 and c)(
        swarm.trust()["clients"].get(fp, {})), 60, "trust.json to show the replayed envelope's refusal")
    assert book["accepted"] == 1, "a replay was counted (and trained) twice"  # this new key's one distinct batch


def test_foreign_audience(mallory, swarm, attack):
    rec = attack("foreign audience", "a batch sealed for another coordinator (or broadcast) delivered here")
    _, payload = honest_sealed(mallory)
    for audience in (Identity.generate().public_key, envelope.BROADCAST):
        code, _ = mallory.submit(mallory.seal(mallory.identity, payload, audience=audience))
        rec.saw(code)
        assert code == "WRONG_AUDIENCE"


def test_expired_timestamp(mallory, attack):
    rec = attack("expired timestamp", "envelopes dated an hour in the past and in the future")
    _, payload = honest_sealed(mallory)
    for skew in (-3600.0, +3600.0):
        code, _ = mallory.submit(mallory.seal(mallory.identity, payload, now=time.time() + skew))
        rec.saw(code)
        assert code == "EXPIRED"


def test_oversized_payload_is_refused_before_it_is_read(mallory, swarm, attack):
    rec = attack("oversized payload", "frame announcing 1 GiB, 128 MiB actually sent; coordinator memory bounded",
                 note="RSS growth measured on the coordinator process")
    node = mallory.new_node()
    # The coordinator trains and ingests meanwhile, so its RSS moves by itself: 27 MiB within this window
    # under one CPU hog (2026-12-03). The body is large next to that, so a buffered body cannot hide in it.
    body = os.urandom(1 << 20) * 128
    rss_before = swarm.rss_bytes()
    code = mallory.raw_stream("submit", 1 << 30, body, node=node)
    rec.saw(code)
    assert code == "PAYLOAD_TOO_LARGE"
    code = mallory.raw_stream("lease", 1 << 20, b"\x00" * (2 << 20), node=node)
    rec.saw(code)
    assert code == "PAYLOAD_TOO_LARGE"
    growth = swarm.rss_bytes() - rss_before
    rec.note += f"; RSS growth {growth / 2**20:.1f} MiB"
    assert growth < len(body) // 2, f"coordinator grew by {growth / 2**20:.0f} MiB: the body was buffered"


MALFORMED_CODES = {"MALFORMED", "SIGNATURE_MISMATCH", "UNSUPPORTED_VERSION", "PAYLOAD_TOO_LARGE", "NOT_ALLOWED",
                   "RATE_LIMITED", "EXPIRED", "WRONG_AUDIENCE"}


@pytest.fixture(scope="module")
def fuzz_node(package_mallory):
    node = package_mallory.new_node(track=False)  # garbage earns peer strikes: keep them off mallory's main node
    yield node
    node.shutdown()


@pytest.fixture(scope="module")
def fuzz_record(swarm):
    from tests.adversarial.swarm import AttackRecord

    rec = AttackRecord("malformed bytes", "hypothesis: random bytes, truncations, bit flips, and signed garbage "
                                          "payloads", note="codes: any refusal; never accepted")
    swarm.results[rec.attack] = rec
    return rec


@given(data=st.one_of(st.binary(max_size=2048),
                      st.tuples(st.integers(0, 10_000), st.integers(0, 7)),
                      st.binary(min_size=1, max_size=512).map(lambda b: ("signed", b))))
@settings(max_examples=30, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_malformed_bytes(mallory, swarm, fuzz_node, fuzz_record, data):
    if isinstance(data, bytes):
        sealed = data
    elif data[0] == "signed":  # validly signed, undecodable payload: the signer is accountable
        sealed = mallory.seal(Identity.from_seed(b"m" * 32), data[1])
    else:  # a valid envelope, truncated or with one flipped bit
        base = mallory.seal(mallory.identity, b"\x80" * 64)
        at, bit = data
        sealed = base[: at % len(base)] if at % 3 == 0 else corrupt(base, at % len(base))
    code, _ = mallory.submit(sealed, node=fuzz_node)
    fuzz_record.saw(code, rejected=code != "ACCEPTED")
    assert code in MALFORMED_CODES, code


def test_malformed_bytes_cost_honest_nothing(fuzz_record, swarm):
    assert fuzz_record.tried >= 30 and fuzz_record.rejected == fuzz_record.tried, fuzz_record
    fuzz_record.honest_lost = swarm.honest_rejections()
    assert fuzz_record.honest_lost == 0, swarm.honest_view()
