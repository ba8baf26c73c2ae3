"""Envelopes and replay protection with real Ed25519 keys: alice (volunteer), coordinator, mallory."""

from __future__ import annotations

import hashlib
import os
import random
import time

import pytest

from asyncrl.protocol.envelope import BROADCAST, DOMAIN, HEADER_BYTES, MAGIC, ReplayGuard, open_envelope, seal
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity, verify_signature
from asyncrl.protocol.limits import MAX_ENVELOPE_BYTES, NONCE_BYTES, TIMESTAMP_WINDOW_S

NOW = 1_800_000_000.0
KIND = "rollout_batch"


@pytest.fixture(scope="module")
def alice() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def coordinator() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def mallory() -> Identity:
    return Identity.generate()


def open_as(coordinator: Identity, data: bytes, **kw):
    args = dict(max_bytes=MAX_ENVELOPE_BYTES, expected_kind=KIND, expected_audience=coordinator.public_key, now=NOW)
    args.update(kw)
    return open_envelope(data, **args)


def code_of(fn, *a, **kw) -> RejectCode:
    with pytest.raises(ProtocolError) as e:
        fn(*a, **kw)
    return e.value.code


def test_alice_seals_coordinator_opens(alice, coordinator):
    payload = b"\x81\xa1x\x01" * 100
    data = seal(alice, KIND, payload, audience=coordinator.public_key, now=NOW)
    assert data[:4] == MAGIC and data[4:36] == alice.public_key
    opened = open_as(coordinator, data, expected_signer=alice.public_key)
    assert opened.signer == alice.public_key
    assert opened.kind == KIND and opened.audience == coordinator.public_key
    assert opened.timestamp == NOW and len(opened.nonce) == NONCE_BYTES
    assert opened.payload == payload
    assert opened.payload_id == hashlib.sha256(payload).digest()


def test_payload_id_ignores_nonce_and_time(alice, coordinator):
    a = open_as(coordinator, seal(alice, KIND, b"same", audience=coordinator.public_key, now=NOW))
    b = open_as(coordinator, seal(alice, KIND, b"same", audience=coordinator.public_key, now=NOW + 1))
    assert a.nonce != b.nonce and a.payload_id == b.payload_id


def test_signature_covers_domain_and_exact_body(alice, coordinator):
    data = seal(alice, KIND, b"payload", audience=coordinator.public_key, now=NOW)
    verify_signature(data[4:36], data[36:HEADER_BYTES], DOMAIN + data[HEADER_BYTES:])


def test_every_flipped_byte_is_rejected(alice, coordinator):
    data = seal(alice, KIND, b"payload bytes", audience=coordinator.public_key, now=NOW)
    for i in range(len(data)):
        tampered = bytearray(data)
        tampered[i] ^= 0x01
        code = code_of(open_as, coordinator, bytes(tampered))
        if i < 4:
            assert code in (RejectCode.MALFORMED, RejectCode.UNSUPPORTED_VERSION)
        else:
            assert code is RejectCode.SIGNATURE_MISMATCH


def test_tampered_payload_byte(alice, coordinator):
    data = bytearray(seal(alice, KIND, b"reward=0.0", audience=coordinator.public_key, now=NOW))
    data[-1] ^= ord("0") ^ ord("1")  # reward=0.0 -> reward=0.1
    assert code_of(open_as, coordinator, bytes(data)) is RejectCode.SIGNATURE_MISMATCH


def test_mallory_claims_alice_as_signer(alice, coordinator, mallory):
    forged = seal(mallory, KIND, b"bad batch", audience=coordinator.public_key, now=NOW)
    forged = forged[:4] + alice.public_key + forged[36:]
    assert code_of(open_as, coordinator, forged) is RejectCode.SIGNATURE_MISMATCH


def test_expected_signer(alice, coordinator, mallory):
    data = seal(mallory, KIND, b"x", audience=coordinator.public_key, now=NOW)
    assert code_of(open_as, coordinator, data, expected_signer=alice.public_key) is RejectCode.NOT_ALLOWED
    # checked before the (more expensive) signature
    junk_sig = data[:36] + bytes(64) + data[HEADER_BYTES:]
    assert code_of(open_as, coordinator, junk_sig, expected_signer=alice.public_key) is RejectCode.NOT_ALLOWED


def test_wrong_audience(alice, coordinator, mallory):
    to_mallory = seal(alice, KIND, b"x", audience=mallory.public_key, now=NOW)
    assert code_of(open_as, coordinator, to_mallory) is RejectCode.WRONG_AUDIENCE
    broadcast = seal(alice, KIND, b"x", now=NOW)
    assert code_of(open_as, coordinator, broadcast) is RejectCode.WRONG_AUDIENCE
    assert open_as(coordinator, broadcast, expected_audience=BROADCAST).audience == BROADCAST
    assert open_as(coordinator, to_mallory, expected_audience=None).audience == mallory.public_key


def test_wrong_kind_is_malformed(alice, coordinator):
    data = seal(alice, "adapter_manifest", b"x", audience=coordinator.public_key, now=NOW)
    assert code_of(open_as, coordinator, data) is RejectCode.MALFORMED


def test_expired_and_future(alice, coordinator):
    w = TIMESTAMP_WINDOW_S
    old = seal(alice, KIND, b"x", audience=coordinator.public_key, now=NOW - w - 1)
    future = seal(alice, KIND, b"x", audience=coordinator.public_key, now=NOW + w + 1)
    edge = seal(alice, KIND, b"x", audience=coordinator.public_key, now=NOW - w)
    assert code_of(open_as, coordinator, old) is RejectCode.EXPIRED
    assert code_of(open_as, coordinator, future) is RejectCode.EXPIRED
    open_as(coordinator, edge)
    open_as(coordinator, old, window_s=None)
    assert code_of(open_as, coordinator, old, window_s=0.5, now=NOW - w) is RejectCode.EXPIRED


def test_default_clock(alice, coordinator):
    data = seal(alice, KIND, b"x", audience=coordinator.public_key)
    opened = open_envelope(data, max_bytes=1024, expected_kind=KIND, expected_audience=coordinator.public_key)
    assert abs(opened.timestamp - time.time()) < 60


def test_oversize_rejected_without_decoding(coordinator):
    huge = os.urandom(1024) * (MAX_ENVELOPE_BYTES // 1024 + 1)  # garbage: decoding would say MALFORMED
    assert code_of(open_as, coordinator, huge) is RejectCode.PAYLOAD_TOO_LARGE
    assert code_of(open_as, coordinator, memoryview(huge)) is RejectCode.PAYLOAD_TOO_LARGE


def test_oversize_valid_envelope(alice, coordinator):
    data = seal(alice, KIND, bytes(2000), audience=coordinator.public_key, now=NOW)
    assert code_of(open_as, coordinator, data, max_bytes=len(data) - 1) is RejectCode.PAYLOAD_TOO_LARGE
    open_as(coordinator, data, max_bytes=len(data))


def test_magic_and_truncation(alice, coordinator):
    data = seal(alice, KIND, b"x", audience=coordinator.public_key, now=NOW)
    assert code_of(open_as, coordinator, b"ARL2" + data[4:]) is RejectCode.UNSUPPORTED_VERSION
    assert code_of(open_as, coordinator, b"XXXX" + data[4:]) is RejectCode.MALFORMED
    for n in (0, 3, 4, 36, HEADER_BYTES):
        assert code_of(open_as, coordinator, data[:n]) is RejectCode.MALFORMED
    assert code_of(open_as, coordinator, data[:-1]) is RejectCode.SIGNATURE_MISMATCH


def test_validly_signed_garbage_body_is_malformed(alice, coordinator):
    body = b"\x93\x01\x02\x03"  # msgpack array, not an EnvelopeBody
    data = MAGIC + alice.public_key + alice.sign(DOMAIN + body) + body
    assert code_of(open_as, coordinator, data) is RejectCode.MALFORMED


def test_bad_nonce_length_is_malformed(alice, coordinator):
    import msgspec

    from asyncrl.protocol.envelope import EnvelopeBody

    body = msgspec.msgpack.encode(EnvelopeBody(KIND, coordinator.public_key, NOW, b"short", b"x"))
    data = MAGIC + alice.public_key + alice.sign(DOMAIN + body) + body
    assert code_of(open_as, coordinator, data) is RejectCode.MALFORMED
    nan_body = msgspec.msgpack.encode(EnvelopeBody(KIND, coordinator.public_key, float("nan"), bytes(16), b"x"))
    data = MAGIC + alice.public_key + alice.sign(DOMAIN + nan_body) + nan_body
    assert code_of(open_as, coordinator, data, window_s=None) is RejectCode.MALFORMED


def test_seal_rejects_caller_mistakes(alice):
    with pytest.raises(ValueError):
        seal(alice, KIND, b"x", audience=bytes(31))
    with pytest.raises(ValueError):
        seal(alice, KIND, b"x", nonce=bytes(8))


# ------------------------------------------------------------------------------------------ replay guard


def test_replay_is_rejected(alice, coordinator):
    guard = ReplayGuard()
    data = seal(alice, KIND, b"batch", audience=coordinator.public_key, now=NOW)
    opened = open_as(coordinator, data)
    guard.check_and_remember(opened.signer, opened.nonce, opened.timestamp, now=NOW)
    again = open_as(coordinator, data)  # the envelope itself is still valid ...
    with pytest.raises(ProtocolError) as e:  # ... but the guard has seen it
        guard.check_and_remember(again.signer, again.nonce, again.timestamp, now=NOW + 1)
    assert e.value.code is RejectCode.NONCE_REUSED


def test_same_nonce_other_signer_is_fine(alice, mallory):
    guard = ReplayGuard()
    nonce = bytes(16)
    guard.check_and_remember(alice.public_key, nonce, NOW, now=NOW)
    guard.check_and_remember(mallory.public_key, nonce, NOW, now=NOW)
    assert len(guard) == 2


def test_guard_forgets_old_entries_and_refuses_older(alice):
    guard = ReplayGuard(window_s=10.0)
    guard.check_and_remember(alice.public_key, b"a" * 16, NOW, now=NOW)
    guard.check_and_remember(alice.public_key, b"b" * 16, NOW + 5, now=NOW + 5)
    guard.check_and_remember(alice.public_key, b"c" * 16, NOW + 11, now=NOW + 11)  # prunes "a"
    assert len(guard) == 2
    with pytest.raises(ProtocolError) as e:
        guard.check_and_remember(alice.public_key, b"a" * 16, NOW, now=NOW + 11)
    assert e.value.code is RejectCode.EXPIRED


def test_guard_full_evicts_oldest_and_raises_floor(alice):
    guard = ReplayGuard(window_s=100.0, max_entries=3)
    for i in range(3):
        guard.check_and_remember(alice.public_key, bytes([i]) * 16, NOW + i, now=NOW + 3)
    guard.check_and_remember(alice.public_key, b"\x09" * 16, NOW + 3, now=NOW + 3)  # evicts nonce 0
    assert len(guard) == 3
    # replaying the evicted nonce is still refused (floor), never accepted
    with pytest.raises(ProtocolError) as e:
        guard.check_and_remember(alice.public_key, b"\x00" * 16, NOW, now=NOW + 3)
    assert e.value.code is RejectCode.EXPIRED


def test_guard_persistence_round_trip(alice, mallory):
    guard = ReplayGuard(window_s=60.0, max_entries=10)
    for i in range(5):
        guard.check_and_remember(alice.public_key, bytes([i]) * 16, NOW + i, now=NOW + i)
    guard.check_and_remember(mallory.public_key, b"m" * 16, NOW, now=NOW + 4)
    restored = ReplayGuard.from_bytes(guard.to_bytes())
    assert restored.window_s == 60.0 and restored.max_entries == 10 and len(restored) == 6
    with pytest.raises(ProtocolError) as e:
        restored.check_and_remember(alice.public_key, b"\x03" * 16, NOW + 3, now=NOW + 5)
    assert e.value.code is RejectCode.NONCE_REUSED
    restored.check_and_remember(alice.public_key, b"new-nonce-000000", NOW + 5, now=NOW + 5)
    assert ReplayGuard.from_bytes(ReplayGuard().to_bytes()).max_entries == 1_000_000


@pytest.mark.parametrize("state", [b"", b"\x00", random.Random(64).randbytes(64), b"\x95\x07\xcb" + bytes(8) + b"\x01\x00\x90"])
def test_guard_corrupt_state(state):
    with pytest.raises(ProtocolError) as e:
        ReplayGuard.from_bytes(state)
    assert e.value.code is RejectCode.MALFORMED
