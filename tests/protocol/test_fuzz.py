"""Fuzzing the decoders: for any bytes, only ProtocolError may escape (hypothesis, real crypto)."""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.protocol.envelope import DOMAIN, HEADER_BYTES, MAGIC, open_envelope, seal
from asyncrl.protocol.errors import ProtocolError
from asyncrl.protocol.identity import Identity
from asyncrl.protocol.messages import (
    Ack,
    AdapterManifest,
    AdapterPointer,
    Completion,
    LeaseGrant,
    LeaseRequest,
    LoraSpec,
    RolloutBatch,
    RolloutGroup,
    SamplingParams,
    TaskLease,
    TensorSpec,
    decode,
    decode_manifest,
    decode_pointer,
    decode_rollout_batch,
    encode,
)

# database=None: no .hypothesis/ folder in the checkout; failures print their reproducing example.
FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
CAP = 1 << 20
NOW = 1_800_000_000.0
ALICE = Identity.from_seed(bytes(range(32)))
COORD = Identity.from_seed(bytes(range(1, 33)))

_ids = np.arange(1, 6, dtype="<i4").tobytes()
_lps = np.full(5, -0.5, dtype="<f4").tobytes()
_sampling = SamplingParams(0.7, 0.95, 20, 64)
VALID = [
    encode(RolloutBatch(run_id="r", adapter_version=1, client_name="bob", sampling=_sampling, generated_at=NOW,
                        groups=(RolloutGroup("l", "p", _ids, (Completion(_ids, _lps, 1.0, "stop"),) * 2),))),
    encode(AdapterManifest(run_id="r", version=1, parent_version=0, keyframe_version=0, base_model="m",
                           base_revision="rev", lora=LoraSpec(8, 16.0, 0.0, ("q_proj",)), codec="c",
                           tensors=(TensorSpec("a", "bf16", (8, 4)),), raw_bytes=64, compressed_bytes=40,
                           chunk_bytes=16, chunk_hashes=(hashlib.sha256(b"").digest(),) * 3, created_at=NOW)),
    encode(AdapterPointer(run_id="r", version=1, manifest_sha256=bytes(32), keyframe_version=0, published_at=NOW)),
    encode(LeaseRequest(run_id="r", max_prompts=4, adapter_version=1, client_name="bob")),
    encode(LeaseGrant(run_id="r", current_version=1,
                      leases=(TaskLease("l", "p", "q?", _ids, "a", "exact", 4, _sampling, NOW),))),
    encode(Ack(batch_id=bytes(32), accepted=False, code="MALFORMED", detail="x")),
]
ENVELOPE = seal(ALICE, "rollout_batch", VALID[0], audience=COORD.public_key, now=NOW)
TYPES = (RolloutBatch, AdapterManifest, AdapterPointer, LeaseRequest, LeaseGrant, Ack)


def only_protocol_errors(data: bytes) -> None:
    """Run every decoder on `data`; any exception other than ProtocolError fails the test."""
    for type_ in TYPES:
        try:
            decode(data, type_, max_bytes=CAP)
        except ProtocolError:
            pass
    for fn in (
        lambda: decode_rollout_batch(data, max_bytes=CAP, vocab_size=100),
        lambda: decode_manifest(data),
        lambda: decode_pointer(data),
        lambda: open_envelope(data, max_bytes=CAP, expected_kind="rollout_batch",
                              expected_audience=COORD.public_key, now=NOW),
    ):
        try:
            fn()
        except ProtocolError:
            pass


@st.composite
def mutated(draw, originals=tuple(VALID) + (ENVELOPE,)):
    data = bytearray(draw(st.sampled_from(originals)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "append", "set", "insert"]))
        if op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            data = data[: draw(st.integers(0, len(data)))]
        elif op == "append":
            data += draw(st.binary(min_size=1, max_size=64))
        elif op == "set" and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.sampled_from([0x00, 0x7F, 0xC0, 0xC1, 0xCB, 0xCF, 0xDD, 0xDF, 0xFF]))
        elif op == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


def test_hostile_shapes():
    """Hand-picked bombs: absurd nesting, huge declared lengths, non-finite floats."""
    bombs = [
        b"\x91" * 200_000 + b"\xc0",  # 200k nested arrays (recursion)
        b"\x81\xa6groups" + b"\x91" * 200_000 + b"\xc0",
        b"\x81\xa6schema" + b"\x91" * 200_000 + b"\xc0",
        b"\xdd\xff\xff\xff\xff",  # array claiming 4 billion items
        b"\x81\xa6groups\xdd\xff\xff\xff\xff",
        b"\xdf\xff\xff\xff\xff",  # map claiming 4 billion pairs
        b"\xc6\xff\xff\xff\xff",  # bin claiming 4 GiB
        b"\x81\xa6schema\xcf\xff\xff\xff\xff\xff\xff\xff\xff",  # uint64 max
        b"\x81\xa6schema\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",  # NaN schema
    ]
    for data in bombs:
        only_protocol_errors(data)


def test_valid_samples_decode():
    for data, type_ in zip(VALID, TYPES):
        decode(data, type_, max_bytes=CAP)
    open_envelope(ENVELOPE, max_bytes=CAP, expected_kind="rollout_batch", expected_audience=COORD.public_key, now=NOW)


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes(data):
    only_protocol_errors(data)


@FUZZ
@given(mutated())
def test_mutated_encodings(data):
    only_protocol_errors(data)


@FUZZ
@given(st.binary(max_size=256))
def test_arbitrary_body_signed_by_alice(body):
    """Past the signature check: a key-holding peer signs garbage bodies."""
    data = MAGIC + ALICE.public_key + ALICE.sign(DOMAIN + body) + body
    try:
        open_envelope(data, max_bytes=CAP, expected_kind="rollout_batch", expected_audience=None, now=NOW)
    except ProtocolError:
        pass


@FUZZ
@given(mutated(originals=(ENVELOPE[HEADER_BYTES:],)))
def test_mutated_body_resigned(body):
    """A valid envelope body, mutated and re-signed: exercises body decoding and the later checks."""
    data = MAGIC + ALICE.public_key + ALICE.sign(DOMAIN + body) + body
    try:
        opened = open_envelope(data, max_bytes=CAP, expected_kind="rollout_batch", expected_audience=None, now=NOW)
    except ProtocolError:
        return
    only_protocol_errors(opened.payload)


@FUZZ
@given(st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.sampled_from(["schema", "run_id", "groups", "version", "tensors", "chunk_hashes", "leases", "x"]) | st.text(max_size=4),
        kids, max_size=5),
    max_leaves=20,
))
def test_structured_msgpack(obj):
    """Well-formed msgpack of the wrong shape (the usual path for a hostile peer)."""
    try:
        data = msgspec.msgpack.encode(obj)
    except (OverflowError, msgspec.EncodeError):
        return
    only_protocol_errors(data)
