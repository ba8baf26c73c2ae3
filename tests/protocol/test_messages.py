"""Messages: round trips, strict decoding, and every validation rule (assert on `.code`)."""

from __future__ import annotations

import hashlib
import math

import msgspec
import numpy as np
import pytest

from asyncrl.protocol import limits, messages
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.messages import (
    SCHEMA_VERSION,
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
    validate_manifest,
    derive_finish_reason,
    derive_finish_reasons,
    validate_rollout_batch,
)

BIG = limits.MAX_ENVELOPE_BYTES


def ids(*xs: int) -> bytes:
    return np.asarray(xs, dtype="<i4").tobytes()


def lps(*xs: float) -> bytes:
    return np.asarray(xs, dtype="<f4").tobytes()


def completion(tokens=(5, 6, 7), logprobs=(-0.5, -1.0, -0.01), reward=1.0) -> Completion:
    return Completion(token_ids=ids(*tokens), logprobs=lps(*logprobs), reward=reward, finish_reason="stop")


def batch(groups=None, **kw) -> RolloutBatch:
    if groups is None:
        groups = (RolloutGroup("lease-1", "p-1", ids(1, 2, 3), (completion(), completion(reward=0.0))),)
    fields = dict(run_id="run", adapter_version=3, client_name="bob", sampling=SamplingParams(),
                  groups=groups, generated_at=1000.0)
    fields.update(kw)
    return RolloutBatch(**fields)


def manifest(**kw) -> AdapterManifest:
    tensors = (TensorSpec("a", "bf16", (16, 64)), TensorSpec("b", "fp32", (64, 16)))
    fields = dict(run_id="run", version=2, parent_version=1, keyframe_version=0, base_model="Qwen/Qwen2.5-0.5B",
                  base_revision="abc", lora=LoraSpec(16, 32.0, 0.0, ("q_proj", "v_proj")), codec="zstd-delta-v1",
                  tensors=tensors, raw_bytes=16 * 64 * 2 + 64 * 16 * 4, compressed_bytes=2500, chunk_bytes=1024,
                  chunk_hashes=tuple(hashlib.sha256(bytes([i])).digest() for i in range(3)), created_at=5.0)
    fields.update(kw)
    return AdapterManifest(**fields)


def pointer(**kw) -> AdapterPointer:
    fields = dict(run_id="run", version=2, manifest_sha256=bytes(32), keyframe_version=0, published_at=6.0)
    fields.update(kw)
    return AdapterPointer(**fields)


def lease_grant() -> LeaseGrant:
    lease = TaskLease("l1", "p1", "2+2?", ids(1, 2), "4", "math_verify", 8, SamplingParams(0.7, 0.95, 20, 256), 99.0)
    return LeaseGrant(run_id="run", leases=(lease,), current_version=4)


def code_of(fn, *a, **kw) -> RejectCode:
    with pytest.raises(ProtocolError) as e:
        fn(*a, **kw)
    return e.value.code


# ----------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "msg",
    [
        batch(),
        manifest(),
        manifest(parent_version=None, keyframe_version=2),
        pointer(),
        LeaseRequest(run_id="run", max_prompts=4, adapter_version=0, client_name="bob"),
        lease_grant(),
        Ack(batch_id=bytes(32), accepted=True),
        Ack(batch_id=bytes(32), accepted=False, code=RejectCode.STALE_VERSION.value, detail="too old"),
    ],
)
def test_round_trip(msg):
    data = encode(msg)
    assert decode(data, type(msg), max_bytes=BIG) == msg
    assert msg.schema == SCHEMA_VERSION


def test_typed_decoders_round_trip():
    assert decode_rollout_batch(encode(batch()), max_bytes=BIG, vocab_size=10) == batch()
    assert decode_manifest(encode(manifest())) == manifest()
    assert decode_pointer(encode(pointer())) == pointer()


def test_array_helpers():
    c = completion(tokens=(1, 2**31 - 1), logprobs=(-0.25, 0.0))
    assert c.token_array().dtype == np.int32 and c.token_array().tolist() == [1, 2**31 - 1]
    assert c.logprob_array().dtype == np.float32 and c.logprob_array().tolist() == [-0.25, 0.0]


def test_tensor_nbytes():
    assert TensorSpec("x", "bf16", (3, 4)).nbytes == 24
    assert TensorSpec("x", "fp32", (3, 4)).nbytes == 48


def test_messages_are_frozen():
    with pytest.raises(AttributeError):
        batch().adapter_version = 7  # type: ignore[misc]


def test_reject_code_values_equal_names():
    assert all(c.value == c.name for c in RejectCode)
    err = ProtocolError(RejectCode.MALFORMED, "groups[0]")
    assert err.code is RejectCode.MALFORMED and err.detail == "groups[0]"
    assert str(err) == "MALFORMED: groups[0]"


# ------------------------------------------------------------------------------------- strict decoding


def test_size_cap_checked_before_decoding():
    assert code_of(decode, b"\xff" * 101, Ack, max_bytes=100) is RejectCode.PAYLOAD_TOO_LARGE
    assert code_of(decode_rollout_batch, encode(batch()), max_bytes=10) is RejectCode.PAYLOAD_TOO_LARGE
    assert code_of(decode_pointer, bytes(limits.MAX_POINTER_BYTES + 1)) is RejectCode.PAYLOAD_TOO_LARGE


def test_unknown_field_is_malformed():
    raw = msgspec.to_builtins(pointer())
    raw["extra"] = 1
    assert code_of(decode, msgspec.msgpack.encode(raw), AdapterPointer, max_bytes=BIG) is RejectCode.MALFORMED


def test_wrong_type_is_malformed():
    raw = msgspec.to_builtins(pointer())
    raw["version"] = "two"
    assert code_of(decode, msgspec.msgpack.encode(raw), AdapterPointer, max_bytes=BIG) is RejectCode.MALFORMED
    # an Ack where a RolloutBatch is expected
    assert code_of(decode, encode(Ack(batch_id=b"", accepted=True)), RolloutBatch, max_bytes=BIG) is RejectCode.MALFORMED
    assert code_of(decode, b"", Ack, max_bytes=BIG) is RejectCode.MALFORMED
    assert code_of(decode, encode(Ack(batch_id=b"", accepted=True)) + b"\x00", Ack, max_bytes=BIG) is RejectCode.MALFORMED
    assert code_of(decode, "not bytes", Ack, max_bytes=BIG) is RejectCode.MALFORMED  # type: ignore[arg-type]


@pytest.mark.parametrize("schema", [0, 1, SCHEMA_VERSION + 1, 99])
def test_wrong_schema_is_unsupported(schema):
    msg = pointer(schema=schema)
    assert code_of(decode, encode(msg), AdapterPointer, max_bytes=BIG) is RejectCode.UNSUPPORTED_VERSION
    assert code_of(decode_pointer, encode(msg)) is RejectCode.UNSUPPORTED_VERSION


def test_newer_schema_with_new_fields_is_unsupported_not_malformed():
    raw = msgspec.to_builtins(batch())
    raw["schema"] = SCHEMA_VERSION + 1
    raw["new_field_from_the_future"] = [1, 2, 3]
    data = msgspec.msgpack.encode(raw)
    assert code_of(decode_rollout_batch, data, max_bytes=BIG) is RejectCode.UNSUPPORTED_VERSION


def test_decoder_enforces_count_caps():
    c = completion()
    group = RolloutGroup("l", "p", ids(1), (c,) * (limits.MAX_COMPLETIONS_PER_GROUP + 1))
    assert code_of(decode_rollout_batch, encode(batch(groups=(group,))), max_bytes=BIG) is RejectCode.MALFORMED
    g1 = RolloutGroup("l", "p", ids(1), (c,))
    too_many = batch(groups=(g1,) * (limits.MAX_GROUPS_PER_BATCH + 1))
    assert code_of(decode, encode(too_many), RolloutBatch, max_bytes=BIG) is RejectCode.MALFORMED


# ---------------------------------------------------------------------------------- rollout batch rules


def group_with(*completions: Completion, prompt=ids(1, 2)) -> tuple[RolloutGroup, ...]:
    return (RolloutGroup("lease", "prompt", prompt, tuple(completions)),)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(batch(groups=group_with(completion(logprobs=(-0.1, math.nan, -0.2)))), id="nan-logprob"),
        pytest.param(batch(groups=group_with(completion(logprobs=(-0.1, -math.inf, -0.2)))), id="-inf-logprob"),
        pytest.param(batch(groups=group_with(completion(logprobs=(-0.1, math.inf, -0.2)))), id="inf-logprob"),
        pytest.param(batch(groups=group_with(completion(logprobs=(-0.1, 0.5, -0.2)))), id="positive-logprob"),
        pytest.param(batch(groups=group_with(completion(logprobs=(-0.1, -0.2)))), id="length-mismatch"),
        pytest.param(batch(groups=group_with(Completion(ids(1, 2), lps(-1.0, -1.0)[:-1], 1.0, "stop"))), id="logprobs-not-x4"),
        pytest.param(batch(groups=group_with(Completion(ids(1, 2)[:-1], lps(-1.0, -1.0)[:-1], 1.0, "stop"))), id="tokens-not-x4"),
        pytest.param(batch(groups=group_with(Completion(b"", b"", 1.0, "stop"))), id="empty-completion"),
        pytest.param(batch(groups=group_with(completion(reward=2 * limits.MAX_ABS_REWARD))), id="reward-above-cap"),
        pytest.param(batch(groups=group_with(completion(reward=-2 * limits.MAX_ABS_REWARD))), id="reward-below-cap"),
        pytest.param(batch(groups=group_with(completion(reward=math.nan))), id="reward-nan"),
        pytest.param(batch(groups=group_with(completion(reward=math.inf))), id="reward-inf"),
        pytest.param(batch(groups=group_with(completion(tokens=(1, -3, 2)))), id="negative-token"),
        pytest.param(batch(groups=group_with(completion(), prompt=b"")), id="empty-prompt"),
        pytest.param(batch(groups=group_with(completion(), prompt=ids(1, -1))), id="negative-prompt-token"),
        pytest.param(batch(groups=group_with()), id="empty-group"),
        pytest.param(batch(groups=()), id="no-groups"),
        pytest.param(batch(adapter_version=-1), id="negative-adapter-version"),
        pytest.param(batch(generated_at=math.nan), id="nan-generated-at"),
        pytest.param(batch(sampling=SamplingParams(temperature=-1.0)), id="negative-temperature"),
        pytest.param(batch(sampling=SamplingParams(top_p=0.0)), id="zero-top-p"),
        pytest.param(batch(sampling=SamplingParams(top_k=-1)), id="negative-top-k"),
        pytest.param(batch(sampling=SamplingParams(min_p=1.5)), id="min-p-above-1"),
        pytest.param(batch(sampling=SamplingParams(min_p=math.nan)), id="min-p-nan"),
        pytest.param(batch(sampling=SamplingParams(repetition_penalty=0.0)), id="zero-repetition-penalty"),
        pytest.param(batch(sampling=SamplingParams(repetition_penalty=math.inf)), id="inf-repetition-penalty"),
        pytest.param(batch(sampling=SamplingParams(max_new_tokens=0)), id="zero-max-new-tokens"),
    ],
)
def test_rollout_batch_rules(bad):
    assert code_of(validate_rollout_batch, bad) is RejectCode.MALFORMED
    assert code_of(decode_rollout_batch, encode(bad), max_bytes=BIG) is RejectCode.MALFORMED


def test_sampling_knobs_at_their_defaults_are_not_on_the_wire():
    """A lease or batch that uses none of min_p / repetition_penalty encodes without them, so it decodes in
    a peer that predates those fields; one that uses them round-trips them."""
    plain = msgspec.msgpack.decode(encode(batch()))["sampling"]
    assert "min_p" not in plain and "repetition_penalty" not in plain
    knobs = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.2)
    again = decode_rollout_batch(encode(batch(sampling=knobs)), max_bytes=BIG)
    assert again.sampling == knobs


def test_too_long_sequence():
    n = limits.MAX_TOKENS_PER_SEQUENCE + 1
    c = Completion(bytes(4 * n), lps(-1.0) * n, 0.5, "length")
    bad = batch(groups=group_with(c))
    assert code_of(validate_rollout_batch, bad) is RejectCode.MALFORMED
    assert code_of(decode_rollout_batch, encode(bad), max_bytes=BIG) is RejectCode.MALFORMED
    ok = batch(groups=group_with(Completion(bytes(4 * (n - 1)), lps(-1.0) * (n - 1), 0.5, "length")))
    validate_rollout_batch(ok)


def test_count_rules_on_locally_built_batches():
    c = completion()
    assert code_of(validate_rollout_batch, batch(groups=group_with(*(c,) * 65))) is RejectCode.MALFORMED
    g = group_with(c)[0]
    assert code_of(validate_rollout_batch, batch(groups=(g,) * 257)) is RejectCode.MALFORMED
    validate_rollout_batch(batch(groups=(RolloutGroup("l", "p", ids(1), (c,) * 64),) * 256))


def test_vocab_range():
    b = batch(groups=group_with(completion(tokens=(0, 9, 3)), prompt=ids(1, 2)))
    validate_rollout_batch(b, vocab_size=10)
    assert code_of(validate_rollout_batch, b, vocab_size=9) is RejectCode.MALFORMED
    assert code_of(decode_rollout_batch, encode(b), max_bytes=BIG, vocab_size=9) is RejectCode.MALFORMED
    prompt_out = batch(groups=group_with(completion(tokens=(0,), logprobs=(-1.0,)), prompt=ids(50)))
    assert code_of(validate_rollout_batch, prompt_out, vocab_size=10) is RejectCode.MALFORMED


def test_boundary_values_accepted():
    b = batch(groups=group_with(completion(logprobs=(0.0, 5e-5, -80.0), reward=0.0), completion(reward=1.0)))
    validate_rollout_batch(b)


# -------------------------------------------------------------------------------- manifest and pointer


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(manifest(chunk_hashes=manifest().chunk_hashes[:2]), id="too-few-hashes"),
        pytest.param(manifest(chunk_hashes=manifest().chunk_hashes + (bytes(32),)), id="too-many-hashes"),
        pytest.param(manifest(chunk_hashes=(bytes(32), bytes(31), bytes(32))), id="short-hash"),
        pytest.param(manifest(raw_bytes=1), id="raw-bytes-mismatch"),
        pytest.param(manifest(tensors=(TensorSpec("a", "bf16", (0, 64)),), raw_bytes=0), id="zero-dim"),
        pytest.param(manifest(tensors=(TensorSpec("a", "bf16", (-2, -64)),), raw_bytes=256), id="negative-dims"),
        pytest.param(manifest(tensors=(TensorSpec("a", "bf16", (2,)), TensorSpec("a", "bf16", (2,))), raw_bytes=8), id="duplicate-name"),
        pytest.param(manifest(version=-1, parent_version=None, keyframe_version=0), id="negative-version"),
        pytest.param(manifest(parent_version=2), id="parent-not-older"),
        pytest.param(manifest(parent_version=3), id="parent-newer"),
        pytest.param(manifest(keyframe_version=3), id="keyframe-newer"),
        pytest.param(manifest(chunk_bytes=0, chunk_hashes=()), id="zero-chunk-bytes"),
        pytest.param(manifest(chunk_bytes=limits.MAX_CHUNK_BYTES + 1, chunk_hashes=(bytes(32),)), id="huge-chunk"),
        pytest.param(manifest(compressed_bytes=-1, chunk_hashes=()), id="negative-compressed"),
        pytest.param(manifest(created_at=math.nan), id="nan-created-at"),
        pytest.param(manifest(lora=LoraSpec(0, 32.0, 0.0, ("q_proj",))), id="rank-zero"),
        pytest.param(manifest(stop_token_ids=(7, 7)), id="duplicate-stop-token"),
        pytest.param(manifest(stop_token_ids=(-1,)), id="negative-stop-token"),
        pytest.param(manifest(tokenizer_sha256="x" * 600), id="huge-tokenizer-hash"),
    ],
)
def test_manifest_rules(bad):
    assert code_of(validate_manifest, bad) is RejectCode.MALFORMED
    assert code_of(decode_manifest, encode(bad)) is RejectCode.MALFORMED


def test_manifest_chunk_count_boundaries():
    validate_manifest(manifest(compressed_bytes=0, chunk_hashes=()))
    validate_manifest(manifest(compressed_bytes=1024, chunk_hashes=(bytes(32),)))
    validate_manifest(manifest(compressed_bytes=1025, chunk_hashes=(bytes(32),) * 2))


def test_manifest_bad_dtype_is_malformed():
    raw = msgspec.to_builtins(manifest())
    raw["tensors"][0]["dtype"] = "int8"
    assert code_of(decode_manifest, msgspec.msgpack.encode(raw)) is RejectCode.MALFORMED


@pytest.mark.parametrize(
    "bad",
    [pointer(manifest_sha256=bytes(31)), pointer(version=-1, keyframe_version=0), pointer(keyframe_version=3),
     pointer(published_at=math.inf)],
)
def test_pointer_rules(bad):
    assert code_of(decode_pointer, encode(bad)) is RejectCode.MALFORMED


@pytest.mark.parametrize("retry", [-1.0, math.nan, math.inf, 3601.0])
def test_a_lease_grants_retry_after_is_bounded(retry):
    raw = msgspec.to_builtins(LeaseGrant(run_id="run", leases=(), current_version=4, retry_after_s=2.0))
    assert decode(encode(LeaseGrant(run_id="run", leases=(), current_version=4, retry_after_s=2.0)), LeaseGrant,
                  max_bytes=BIG).retry_after_s == 2.0
    raw["retry_after_s"] = retry
    assert code_of(decode, msgspec.msgpack.encode(raw), LeaseGrant, max_bytes=BIG) is RejectCode.MALFORMED


def test_manifest_pin_round_trips_and_caps_the_stop_set():
    m = manifest(base_weights_sha256="sha256:" + "1" * 64, tokenizer_sha256="sha256:" + "2" * 64,
                 stop_token_ids=(151643, 151645))
    assert decode_manifest(encode(m)) == m
    too_many = msgspec.to_builtins(m)
    too_many["stop_token_ids"] = list(range(limits.MAX_STOP_TOKENS + 1))
    assert code_of(decode_manifest, msgspec.msgpack.encode(too_many)) is RejectCode.MALFORMED


# ---- finish_reason: one rule, derived from the tokens (Qwen2.5-Instruct's stop set: <|endoftext|>, <|im_end|>)
STOPS = (151643, 151645)


@pytest.mark.parametrize("tokens, max_new, want", [
    ([5, 6, 151645], 8, "stop"),                  # <|im_end|>
    ([5, 6, 151643], 8, "stop"),                  # <|endoftext|>: the generation config's second stop token
    ([5] * 7 + [151645], 8, "stop"),              # a stop token as the last allowed token is still "stop"
    ([5] * 8, 8, "length"),
])
def test_finish_reason_is_derived_from_the_tokens(tokens, max_new, want):
    assert derive_finish_reason(tokens, STOPS, max_new_tokens=max_new) == want


@pytest.mark.parametrize("tokens, max_new", [
    ([5, 151645, 6], 8),   # generation went on after a stop token
    ([5, 6], 8),           # ended early without a stop token
    ([], 8),
])
def test_impossible_endings_are_malformed(tokens, max_new):
    assert code_of(derive_finish_reason, tokens, STOPS, max_new_tokens=max_new) is RejectCode.MALFORMED


def test_a_group_gets_the_same_rule_in_one_pass():
    """derive_finish_reasons (ingest: one numpy pass per group) says what the single rule says of each
    completion; a stop token ending one completion never excuses the next, and arrays work like lists."""
    group = [[5, 6, 151645], np.array([151643, 5, 6, 7], dtype="<i4"), [5] * 8, np.array([151643], dtype="<i4")]
    ok = [group[0], group[2], group[3]]
    assert derive_finish_reasons(ok, STOPS, max_new_tokens=8) == ["stop", "length", "stop"]
    assert [derive_finish_reason(t, STOPS, max_new_tokens=8) for t in ok] == ["stop", "length", "stop"]
    assert code_of(derive_finish_reasons, group, STOPS, max_new_tokens=8) is RejectCode.MALFORMED  # 2nd goes on
    assert code_of(derive_finish_reasons, [[5] * 8, []], STOPS, max_new_tokens=8) is RejectCode.MALFORMED
    assert code_of(derive_finish_reasons, [[5] * 8, [5, 6]], STOPS, max_new_tokens=8) is RejectCode.MALFORMED


def test_the_model_context_also_ends_a_completion():
    assert derive_finish_reason([5, 6], STOPS, max_new_tokens=8, prompt_len=30, context_limit=32) == "length"
    assert code_of(derive_finish_reason, [5, 6], STOPS, max_new_tokens=8, prompt_len=29,
                   context_limit=32) is RejectCode.MALFORMED


def test_unknown_finish_reason_string_is_malformed():
    c = completion()
    bad = batch(groups=group_with(Completion(c.token_ids, c.logprobs, 0.5, "eos")))
    assert code_of(validate_rollout_batch, bad) is RejectCode.MALFORMED


# ---- decoding bombs and length caps (schema 2) ---------------------------------------------------------
BOMB = [[]] * 1_000_000  # 1 MB of msgpack that would become a million Python lists


@pytest.mark.parametrize("where", ["schema", "groups", "unknown", "nested", "sampling"])
def test_a_list_bomb_is_refused_from_its_header_without_building_it(where):
    import tracemalloc

    raw = msgspec.to_builtins(batch())
    if where == "nested":
        raw["groups"][0]["completions"] = BOMB
    elif where == "unknown":
        raw["zzz"] = BOMB
    elif where == "sampling":
        raw["sampling"]["top_k"] = BOMB
    else:
        raw[where] = BOMB
    data = msgspec.msgpack.encode(raw)
    tracemalloc.start()
    try:
        code = code_of(decode_rollout_batch, data, max_bytes=BIG)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code in (RejectCode.MALFORMED, RejectCode.UNSUPPORTED_VERSION)
    assert peak < len(data) // 4, f"decoding allocated {peak} bytes for a {len(data)}-byte bomb"


def test_names_and_ids_have_length_caps():
    long_name = LeaseRequest(run_id="run", max_prompts=1, adapter_version=0, client_name="x" * 60_000)
    assert code_of(decode, encode(long_name), LeaseRequest, max_bytes=BIG) is RejectCode.MALFORMED
    ok = LeaseRequest(run_id="run", max_prompts=1, adapter_version=0, client_name="x" * limits.MAX_NAME_CHARS)
    assert decode(encode(ok), LeaseRequest, max_bytes=BIG).client_name == ok.client_name
    assert code_of(decode_rollout_batch, encode(batch(client_name="y" * 65)), max_bytes=BIG) is RejectCode.MALFORMED
    assert code_of(decode_rollout_batch, encode(batch(run_id="r" * 200)), max_bytes=BIG) is RejectCode.MALFORMED
    long_reason = (RolloutGroup("lease-1", "p-1", ids(1), (Completion(ids(5), lps(-1.0), 1.0, "s" * 500),)),)
    assert code_of(decode_rollout_batch, encode(batch(groups=long_reason)), max_bytes=BIG) is RejectCode.MALFORMED


def test_schema_2_fields_default_and_round_trip():
    assert SCHEMA_VERSION == 2
    grant = LeaseGrant(run_id="run", leases=(), current_version=3)
    assert grant.max_batch_bytes == 0 and batch().engine_dtype == ""
    got = decode(encode(LeaseGrant(run_id="run", leases=(), current_version=3, max_batch_bytes=1 << 20)), LeaseGrant,
                 max_bytes=BIG)
    assert got.max_batch_bytes == 1 << 20
    assert decode_rollout_batch(encode(batch(engine_dtype="bf16")), max_bytes=BIG).engine_dtype == "bf16"
    assert code_of(decode_rollout_batch, encode(batch(engine_dtype="int4")), max_bytes=BIG) is RejectCode.MALFORMED
    assert batch().engine_kind == ""  # an older client says no kind: still accepted
    assert decode_rollout_batch(encode(batch(engine_kind="vllm")), max_bytes=BIG).engine_kind == "vllm"
    for bad in ("VLLM", "v" * 33, "vllm\n", "vllm/bf16"):  # the coordinator's keys stay short and plain
        assert code_of(decode_rollout_batch, encode(batch(engine_kind=bad)), max_bytes=BIG) is RejectCode.MALFORMED


@pytest.mark.parametrize("where", ["schema", "groups"])
def test_a_list_bomb_is_refused_on_its_header_without_building_it(where):
    """A signed batch's payload whose `schema` or `groups` is 2 million empty lists (~2 MB of msgpack that
    would become 2M Python objects, ~123 MiB) is refused MALFORMED while allocating almost nothing: the
    typed decoder rejects it on its array header or first element (tests/adversarial/test_budgets.py sends
    the same bomb to a live coordinator)."""
    import tracemalloc

    raw = msgspec.to_builtins(messages.RolloutBatch(
        run_id="r", adapter_version=0, client_name="m", groups=(), generated_at=1.0,
        sampling=messages.SamplingParams(temperature=1.0, max_new_tokens=8)))
    raw[where] = [[]] * 2_000_000
    data = msgspec.msgpack.encode(raw)
    del raw
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        with pytest.raises(ProtocolError) as exc:
            messages.decode_rollout_batch(data, max_bytes=64 << 20)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert exc.value.code == RejectCode.MALFORMED
    assert peak < 1 << 20, peak  # built, the bomb's lists alone take 2M x 56 bytes
