"""Typed wire messages (msgspec Structs, msgpack) and their strict decoders.

Design choices:
  * Every top-level message carries `schema` (== SCHEMA_VERSION); the decoder refuses other values with
    UNSUPPORTED_VERSION, even when the newer message also has fields this version does not know.
  * `forbid_unknown_fields=True` and `frozen=True` everywhere. `schema` is keyword-only and defaults to
    SCHEMA_VERSION (msgspec therefore lists it last); the other fields may be passed positionally, in
    the order declared, but keywords are recommended for the big messages.
  * Arrays travel as raw little-endian bytes (token ids int32, logprobs float32), never as lists of
    Python ints, so decoding allocates about as much as it reads. Tuple fields carry msgspec length
    caps, which the decoder checks on the array header before building any element.
  * Strings that are names or ids carry length caps too (limits.py), so nothing a peer signs makes the
    receiver keep an unbounded string.
  * Decoding never allocates in proportion to element count or nesting before the schema allows it:
    every sequence is typed and capped (msgspec refuses on the array header), and the one lenient
    view (`_SchemaProbe`, used to tell a newer schema from garbage) types `schema` as an int, so a
    list bomb there is refused on its header instead of being built.
  * `decode` = size cap, then msgspec, then schema. Semantic rules live in `validate_*`, which the
    `decode_rollout_batch / decode_manifest / decode_pointer` helpers run. For *any* input bytes the
    only exception that escapes is `ProtocolError`.

Encoding is deterministic (field order), which matters only for hashing manifests: signatures cover
exact bytes (see envelope.py), never re-encoded objects.

Size: every wire message and its validator in one module, on purpose: a field added to a message and
not to its validator is the bug a reader must be able to see at a glance (structs ~300 lines, validation ~270).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import numpy as np

from . import limits
from .errors import ProtocolError, RejectCode

SCHEMA_VERSION = 2
"""2 (one schema for every change of this release, across the branches that added them; new fields have
defaults, at the end): LeaseGrant.retry_after_s, .max_batch_bytes and .renewed; LeaseRequest.renew and
.client_version; TaskLease.columns; AdapterManifest base/tokenizer pins, stop_token_ids, max_context_tokens and canary; LeaseRequest.canary; RolloutBatch.engine_dtype and .engine_kind;
Ack.receipt; AdapterPointer.finished (run end); length caps on names and ids; swarm.ProvidersRecord.shard and .shards;
Completion.env_mask (multi-turn episodes: b"" = every token is the model's, so batches without it stay valid)."""
SHA256_BYTES = 32

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_MAX_SEQ_BYTES = 4 * limits.MAX_TOKENS_PER_SEQUENCE
# logprobs are <= 0 in exact arithmetic; allow float32 rounding noise above zero.
LOGPROB_TOLERANCE = 1e-4

Dtype = Literal["bf16", "fp16", "fp32"]
FINISH_REASONS = ("stop", "length")  # Completion.finish_reason; ingest re-derives it (derive_finish_reason)
EngineDtype = Literal["", "bf16", "fp16", "fp32"]  # "" = not said
# the engine's name ("transformers", "vllm", ...; "" = not said): an open set, bounded in length and charset
EngineKind = Annotated[str, msgspec.Meta(max_length=32, pattern=r"^[a-z0-9_.-]*\Z")]
SeqBytes = Annotated[bytes, msgspec.Meta(max_length=_MAX_SEQ_BYTES)]
Name = Annotated[str, msgspec.Meta(max_length=limits.MAX_NAME_CHARS)]
Id = Annotated[str, msgspec.Meta(max_length=limits.MAX_ID_CHARS)]
PromptId = Annotated[str, msgspec.Meta(max_length=limits.MAX_PROMPT_ID_CHARS)]
ModelName = Annotated[str, msgspec.Meta(max_length=limits.MAX_MODEL_CHARS)]


class _Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Nested record: strict, immutable, positional construction allowed."""


class _Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Top-level message: strict, immutable, schema-versioned (`schema` is keyword-only)."""

    schema: int = SCHEMA_VERSION


class _SchemaProbe(msgspec.Struct):
    """Lenient view used only to tell 'newer schema' apart from 'garbage' after a strict decode fails.
    `schema` is typed (never Any): a list bomb in it is refused on its header, not built."""

    schema: int | None = None


# --------------------------------------------------------------------------------------------------
# Records


class TensorSpec(_Record):
    name: ModelName
    dtype: Dtype
    shape: Annotated[tuple[int, ...], msgspec.Meta(max_length=limits.MAX_TENSOR_DIMS)]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPE_BYTES[self.dtype]


class LoraSpec(_Record):
    r: int
    alpha: float
    dropout: float
    target_modules: Annotated[tuple[ModelName, ...], msgspec.Meta(max_length=256)]


class SamplingParams(_Record, omit_defaults=True):
    """What volunteers sample with; the reported log-probs are those of the processed distribution, in
    vLLM's order: repetition penalty, temperature, min_p, top-k, top-p (models/sampling.py, docs/sampling.md).
    omit_defaults: a knob left at its default is not on the wire, so a lease or batch that uses none of the
    newer knobs decodes in a peer that predates them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    max_new_tokens: int = 16
    min_p: float = 0.0  # 0 = disabled
    repetition_penalty: float = 1.0  # 1 = disabled


class TaskLease(_Record):
    lease_id: Id
    prompt_id: PromptId
    prompt: str
    prompt_token_ids: SeqBytes  # int32 little-endian
    answer: str
    reward: Id  # name of the reward function the coordinator will re-run
    group_size: int
    sampling: SamplingParams
    expires_at: float
    # schema 2: the record as TRL-style rewards see it (tasks/prompt.py `columns`: canonical JSON, "" = none);
    # the coordinator re-scores from its own copy, so this only has to reach the volunteer intact
    columns: Annotated[str, msgspec.Meta(max_length=limits.MAX_TASK_COLUMNS_CHARS)] = ""


class Completion(_Record, omit_defaults=True):
    """omit_defaults: a completion without `env_mask` encodes exactly as before the field existed, so a
    single-answer batch is the same bytes for peers on either side of the change."""

    token_ids: SeqBytes  # int32 little-endian
    logprobs: SeqBytes  # float32 little-endian, one per token, sampling-distribution logprobs
    reward: float
    finish_reason: Id
    # schema 2, multi-turn episodes (envs/): one byte per token, 1 = an environment token (tool result, game
    # feedback: no loss, no logprob audit, logprob 0.0), 0 = sampled by the model. b"" = all sampled.
    env_mask: SeqBytes = b""

    def env_mask_array(self) -> np.ndarray | None:
        """uint8 per token (1 = environment), or None when every token is the model's."""
        return np.frombuffer(self.env_mask, dtype=np.uint8) if self.env_mask else None

    def token_array(self) -> np.ndarray:
        return np.frombuffer(self.token_ids, dtype="<i4").astype(np.int32, copy=False)

    def logprob_array(self) -> np.ndarray:
        return np.frombuffer(self.logprobs, dtype="<f4").astype(np.float32, copy=False)


class RolloutGroup(_Record):
    lease_id: Id
    prompt_id: PromptId
    prompt_token_ids: SeqBytes  # int32 little-endian
    completions: Annotated[tuple[Completion, ...], msgspec.Meta(max_length=limits.MAX_COMPLETIONS_PER_GROUP)]


# --------------------------------------------------------------------------------------------------
# Top-level messages


CanaryBytes = Annotated[bytes, msgspec.Meta(max_length=4 * limits.MAX_CANARY_TOKENS)]


class Canary(_Record):
    """An adapter version's identity check (models/canary.py): a fixed probe prompt and completion (int32
    token ids) with the coordinator's per-token log-probs (float32, temperature 1) of the completion under
    this version, and under the base model alone. A volunteer scores the probe with its engine after
    loading the version: near `logprobs` = the adapter landed; near `base_logprobs` = it did not."""
    prompt_token_ids: CanaryBytes
    completion_token_ids: CanaryBytes
    logprobs: CanaryBytes
    base_logprobs: CanaryBytes


class CanaryReport(_Record):
    """A volunteer's canary result for one version (LeaseRequest.canary): a health report, never a strike."""
    version: int
    passed: bool
    diff: float       # mean |engine - coordinator| log-prob per completion token, under the version
    base_diff: float  # the same against the base model's log-probs


class AdapterManifest(_Message):
    run_id: Id
    version: int
    parent_version: int | None  # None for a keyframe
    keyframe_version: int
    base_model: ModelName
    base_revision: Id
    lora: LoraSpec
    codec: Id
    tensors: Annotated[tuple[TensorSpec, ...], msgspec.Meta(max_length=limits.MAX_TENSORS_PER_ADAPTER)]
    raw_bytes: int
    compressed_bytes: int
    chunk_bytes: int
    chunk_hashes: Annotated[tuple[bytes, ...], msgspec.Meta(max_length=limits.MAX_CHUNKS_PER_ADAPTER)]  # sha256 each
    created_at: float
    # schema 2 — the base model pin (models/pinning.py): base_revision is a hub commit sha or a content
    # hash; a volunteer verifies these before it generates and refuses a mismatch (never a strike).
    base_weights_sha256: str = ""  # "sha256:<hex>" over the model files
    tokenizer_sha256: str = ""     # "sha256:<hex>" over the tokenizer files
    stop_token_ids: Annotated[tuple[int, ...], msgspec.Meta(max_length=limits.MAX_STOP_TOKENS)] = ()
    # schema 2 — the task's shape: the most tokens (prompt + completion) any sequence of this run needs, i.e.
    # the longest prompt + max_new_tokens; a volunteer sizes its engine's context to it (never the model's
    # whole 32k by default) and spends the memory on batch. 0 = not said (multi-turn tasks, built-in toys).
    max_context_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] = 0
    # schema 2 — the adapter-identity canary (models/canary.py), computed by the learner at publish; None = none
    canary: Canary | None = None


class AdapterPointer(_Message):
    run_id: Id
    version: int
    manifest_sha256: bytes
    keyframe_version: int
    published_at: float
    finished: bool = False  # schema 2: the run is over (max_steps reached or stopped for good); `version` is final


class LeaseRequest(_Message):
    run_id: Id
    max_prompts: int
    adapter_version: int
    client_name: Name
    # schema 2: leases still being worked on; each held one is extended (coordinator/leasing/taskboard.py `renew`).
    # A request with max_prompts = 0 only renews.
    renew: Annotated[tuple[Id, ...], msgspec.Meta(max_length=limits.MAX_GROUPS_PER_BATCH)] = ()
    client_version: Id = ""  # schema 2: the volunteer's asyncrl release (the coordinator's version gate)
    # schema 2: leases this volunteer gives back unfinished (it paused: client/polite.py); handled before any grant
    release: Annotated[tuple[Id, ...], msgspec.Meta(max_length=limits.MAX_GROUPS_PER_BATCH)] = ()
    # schema 2: this volunteer's measured wall seconds per leased prompt, grant to ack; 0 = not measured.
    # The coordinator refuses TOO_SLOW when even one prompt cannot be back within `lease_budget_s`.
    seconds_per_prompt: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 0.0
    # schema 2: leases whose groups this volunteer could not score (its reward check did not finish): ended
    # now, and counted against the prompt (poison prompts are retired: coordinator/leasing/taskboard.py)
    unscorable: Annotated[tuple[Id, ...], msgspec.Meta(max_length=limits.MAX_GROUPS_PER_BATCH)] = ()
    # schema 2: this volunteer's canary result for the version it loaded last (health, never a strike)
    canary: CanaryReport | None = None
    # schema 2: with `release`, what the volunteer's reward function raised on those leases ("reward 'x':
    # TypeError: ..."); the coordinator logs it for the operator (metrics.jsonl `reward_error`, dashboard)
    reward_error: Annotated[str, msgspec.Meta(max_length=limits.MAX_REWARD_ERROR_CHARS)] = ""


class LeaseRenewal(_Record):
    lease_id: Id
    expires_in_s: float  # seconds left on the coordinator's clock after this renewal; 0 = gone (do not send it)


MAX_RETRY_AFTER_S = 3600.0


class LeaseGrant(_Message):
    run_id: Id
    leases: Annotated[tuple[TaskLease, ...], msgspec.Meta(max_length=limits.MAX_GROUPS_PER_BATCH)]
    current_version: int
    # schema 2: with no leases, when to ask again (coordinator/leasing/leasing.py FairShare); 0 = the client's own pause
    retry_after_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_RETRY_AFTER_S)] = 0.0
    # schema 2: the answer to LeaseRequest.renew, one entry per id asked about
    renewed: Annotated[tuple[LeaseRenewal, ...], msgspec.Meta(max_length=limits.MAX_GROUPS_PER_BATCH)] = ()
    # schema 2: what a volunteer sizes its next request by (`lease_budget_s`, client/lease_sizing.py)
    lease_life_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e7)] = 0.0  # renewals included; 0 = unknown
    max_staleness: Annotated[int, msgspec.Meta(ge=-1)] = -1  # versions; -1 = unlimited
    version_interval_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e7)] = 0.0  # recent s per version; 0 = unknown
    max_batch_bytes: int = 0  # the largest sealed batch the coordinator accepts (0 = not said); schema 2


LEASE_SAFETY = 0.5
"""A lease is sized to come back within this fraction of its time budget (room for a slower stretch)."""


def lease_budget_s(lease_life_s: float, max_staleness: int | None, version_interval_s: float) -> float:
    """Seconds within which a leased prompt must be back to be trained: before its lease dies (renewed up to
    lease_max_s after the grant), and before max_staleness + 1 more versions are published (then a batch of
    the leased version is stale). An unknown life or interval (0), or unlimited staleness (None / -1), adds
    no bound; both sides compute it with this one function."""
    budget = lease_life_s if lease_life_s > 0 else math.inf
    if max_staleness is not None and max_staleness >= 0 and version_interval_s > 0:
        budget = min(budget, (max_staleness + 1) * version_interval_s)
    return budget


class RolloutBatch(_Message):
    run_id: Id
    adapter_version: int
    client_name: Name
    sampling: SamplingParams
    groups: Annotated[tuple[RolloutGroup, ...], msgspec.Meta(max_length=limits.MAX_GROUPS_PER_BATCH)]
    generated_at: float
    engine_dtype: EngineDtype = ""  # dtype the engine computed the logprobs in (audit tolerance); schema 2
    engine_kind: EngineKind = ""  # which engine computed them (audit tolerance per kind x dtype); schema 2


class Ack(_Message):
    batch_id: Annotated[bytes, msgspec.Meta(max_length=SHA256_BYTES)]
    accepted: bool
    code: Id | None = None  # a RejectCode value when not accepted
    detail: Annotated[str, msgspec.Meta(max_length=limits.MAX_DETAIL_CHARS)] = ""
    # schema 2: the coordinator-signed Receipt for an accepted batch (protocol/receipts.py); b"" = none
    receipt: Annotated[bytes, msgspec.Meta(max_length=limits.MAX_RECEIPT_BYTES)] = b""


class Receipt(_Message):
    """The coordinator's signed statement that it accepted one batch from `volunteer` (protocol/receipts.py).

    Sealed as an envelope of kind "receipt", signed by the coordinator key (the one in the join address),
    audience = the volunteer's key, so anyone holding the join address can verify it offline."""

    run_id: str
    volunteer: bytes  # Ed25519 public key that signed the batch
    batch_id: bytes  # sha256 of the batch payload (the ingest id)
    seq: int  # this key's n-th accepted batch in this run (1-based)
    adapter_version: int
    groups: int
    completions: int
    tokens: int  # completion tokens accepted
    accepted_at: float  # coordinator clock
    total_batches: int  # running totals for this key in this run, this receipt included
    total_groups: int
    total_tokens: int


def rollout_batch_bytes_bound(*, groups: int, group_size: int, max_new_tokens: int, prompt_tokens: int,
                              episodes: bool = False) -> int:
    """The most bytes an encoded RolloutBatch of this shape takes: every completion at max_new_tokens,
    every prompt at `prompt_tokens`, ids and names at their longest. Exact per part (each part encoded as
    it would be sent), plus 4 bytes per array/bin header for the growth of msgpack length headers.
    `episodes`: completions are multi-turn transcripts of max_new_tokens tokens carrying an env_mask."""
    name = "x" * 128
    comp = Completion(token_ids=bytes(4 * max_new_tokens), logprobs=bytes(4 * max_new_tokens), reward=-1e300,
                      finish_reason="length", env_mask=bytes(max_new_tokens) if episodes else b"")
    group = RolloutGroup(lease_id=name, prompt_id=name * 2, prompt_token_ids=bytes(4 * prompt_tokens), completions=())
    batch = RolloutBatch(run_id=name, adapter_version=2**62, client_name=name, groups=(), generated_at=0.0,
                         sampling=SamplingParams(temperature=1e300, top_p=1e300, top_k=2**62, max_new_tokens=2**62,
                                                 min_p=1e300, repetition_penalty=1e300))
    per_comp = len(encode(comp)) + 8
    per_group = len(encode(group)) + 12 + group_size * per_comp
    return len(encode(batch)) + 4 + groups * per_group


# --------------------------------------------------------------------------------------------------
# Encode / decode

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}
_probe_decoder = msgspec.msgpack.Decoder(_SchemaProbe)
T = TypeVar("T")


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def _check_schema(value: Any) -> None:
    if type(value) is not int or value != SCHEMA_VERSION:
        shown = value if type(value) is int else type(value).__name__  # never repr hostile nesting
        raise ProtocolError(RejectCode.UNSUPPORTED_VERSION, f"schema {shown} (this peer speaks {SCHEMA_VERSION})")


def decode(data: bytes, type_: type[T], *, max_bytes: int) -> T:
    """Strictly decode `data` as `type_`. Only ProtocolError escapes, whatever the bytes."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(RejectCode.MALFORMED, f"expected bytes, got {type(data).__name__}")
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > max_bytes:
        raise ProtocolError(RejectCode.PAYLOAD_TOO_LARGE, f"{size} bytes > cap {max_bytes}")
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders.setdefault(type_, msgspec.msgpack.Decoder(type_))
    try:
        msg = dec.decode(data)
    except Exception as e:  # DecodeError/ValidationError; RecursionError on absurd nesting
        versioned = issubclass(type_, _Message)
        if versioned:
            try:
                probe = _probe_decoder.decode(data)
            except Exception:
                probe = None
            if probe is not None and probe.schema is not None:
                _check_schema(probe.schema)  # newer schema -> UNSUPPORTED_VERSION, not MALFORMED
        raise ProtocolError(RejectCode.MALFORMED, f"{type_.__name__}: {e}") from None
    if isinstance(msg, _Message):
        _check_schema(msg.schema)
    return msg


# --------------------------------------------------------------------------------------------------
# Validation


def _bad(detail: str) -> ProtocolError:
    return ProtocolError(RejectCode.MALFORMED, detail)


def _finite(x: float, field: str) -> None:
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        raise _bad(f"{field} must be a finite number, got {x!r}")


def _int_range(x: int, field: str, lo: int, hi: int | None = None) -> None:
    if type(x) is not int or x < lo or (hi is not None and x > hi):
        raise _bad(f"{field} must be an int in [{lo}, {hi if hi is not None else 'inf'}], got {x!r}")


def _token_count(raw: bytes, field: str) -> int:
    if not isinstance(raw, bytes) or len(raw) % 4:
        raise _bad(f"{field} must be int32 bytes (length multiple of 4)")
    n = len(raw) // 4
    if not 1 <= n <= limits.MAX_TOKENS_PER_SEQUENCE:
        raise _bad(f"{field} must hold 1..{limits.MAX_TOKENS_PER_SEQUENCE} tokens, got {n}")
    return n


def _ids_in_range(ids: np.ndarray, vocab_size: int | None) -> bool:
    return not (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size))


def _token_ids(raw: bytes, field: str, vocab_size: int | None) -> np.ndarray:
    _token_count(raw, field)
    ids = np.frombuffer(raw, dtype="<i4")
    if not _ids_in_range(ids, vocab_size):
        raise _bad(f"{field} has token ids outside [0, {vocab_size if vocab_size is not None else '2^31'})")
    return ids


def _logprobs(raw: bytes, field: str) -> None:
    lp = np.frombuffer(raw, dtype="<f4")
    if not np.isfinite(lp).all():
        raise _bad(f"{field} must be finite")
    if lp.max() > LOGPROB_TOLERANCE:
        raise _bad(f"{field} must be <= 0 (got max {float(lp.max())})")


def _env_mask(c: Completion, field: str) -> None:
    """An episode's mask: one 0/1 byte per token, starting with a model token, logprob exactly 0.0 on every
    environment token (nothing was sampled there). Whether the marked tokens *are* the environment's is the
    replay's question (coordinator ingest: ENV_MISMATCH)."""
    if not isinstance(c.env_mask, bytes) or len(c.env_mask) * 4 != len(c.token_ids):
        raise _bad(f"{field}.env_mask must hold one byte per token")
    mask = np.frombuffer(c.env_mask, dtype=np.uint8)
    if mask.max() > 1 or mask[0] != 0:
        raise _bad(f"{field}.env_mask must be 0/1 and start with a model token")
    if np.any(np.frombuffer(c.logprobs, dtype="<f4")[mask == 1] != 0.0):
        raise _bad(f"{field}.logprobs must be 0.0 on environment tokens")


MAX_REPETITION_PENALTY = 100.0  # far past any useful value (HF/vLLM suggest ~1.0-1.3); keeps logits finite


def validate_sampling(s: SamplingParams, field: str = "sampling") -> None:
    _finite(s.temperature, f"{field}.temperature")
    _finite(s.top_p, f"{field}.top_p")
    if s.temperature < 0:
        raise _bad(f"{field}.temperature must be >= 0")
    if not 0 < s.top_p <= 1:
        raise _bad(f"{field}.top_p must be in (0, 1]")
    _int_range(s.top_k, f"{field}.top_k", 0)
    _finite(s.min_p, f"{field}.min_p")
    _finite(s.repetition_penalty, f"{field}.repetition_penalty")
    if not 0 <= s.min_p <= 1:
        raise _bad(f"{field}.min_p must be in [0, 1]")
    if not 0 < s.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise _bad(f"{field}.repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}]")
    _int_range(s.max_new_tokens, f"{field}.max_new_tokens", 1, limits.MAX_TOKENS_PER_SEQUENCE)


def validate_rollout_batch(batch: RolloutBatch, *, vocab_size: int | None = None) -> None:
    """Semantic checks on a rollout batch; every failure is MALFORMED with the field path."""
    _check_schema(batch.schema)
    _int_range(batch.adapter_version, "adapter_version", 0)
    _finite(batch.generated_at, "generated_at")
    validate_sampling(batch.sampling)
    if not 1 <= len(batch.groups) <= limits.MAX_GROUPS_PER_BATCH:
        raise _bad(f"groups must hold 1..{limits.MAX_GROUPS_PER_BATCH} groups, got {len(batch.groups)}")
    for g_i, group in enumerate(batch.groups):
        where = f"groups[{g_i}]"
        _token_ids(group.prompt_token_ids, f"{where}.prompt_token_ids", vocab_size)
        if not 1 <= len(group.completions) <= limits.MAX_COMPLETIONS_PER_GROUP:
            raise _bad(f"{where}.completions must hold 1..{limits.MAX_COMPLETIONS_PER_GROUP}, got {len(group.completions)}")
        for c_i, c in enumerate(group.completions):  # sizes, types, scalars: per completion
            cw = f"{where}.completions[{c_i}]"
            _token_count(c.token_ids, f"{cw}.token_ids")
            if not isinstance(c.logprobs, bytes) or len(c.logprobs) != len(c.token_ids):
                raise _bad(f"{cw}.logprobs must hold one float32 per token")
            if c.finish_reason not in FINISH_REASONS:
                raise _bad(f"{cw}.finish_reason must be one of {FINISH_REASONS}, got {c.finish_reason[:20]!r}")
            _finite(c.reward, f"{cw}.reward")
            if c.env_mask:
                _env_mask(c, cw)
            if not abs(c.reward) <= limits.MAX_ABS_REWARD:  # TRL-style rewards are not clamped to [0, 1]
                raise _bad(f"{cw}.reward must be within ±{limits.MAX_ABS_REWARD:g}, got {c.reward}")
        # Token ranges and logprobs: one numpy pass over the group's (already size-capped) bytes instead of
        # four reductions per completion; only a failing group is walked again to name the offender.
        ids = np.frombuffer(b"".join(c.token_ids for c in group.completions), dtype="<i4")
        lps = np.frombuffer(b"".join(c.logprobs for c in group.completions), dtype="<f4")
        if not _ids_in_range(ids, vocab_size) or not np.isfinite(lps).all() or lps.max() > LOGPROB_TOLERANCE:
            for c_i, c in enumerate(group.completions):
                cw = f"{where}.completions[{c_i}]"
                _token_ids(c.token_ids, f"{cw}.token_ids", vocab_size)
                _logprobs(c.logprobs, f"{cw}.logprobs")


def derive_finish_reason(token_ids, stop_token_ids, *, max_new_tokens: int, prompt_len: int = 0,
                         context_limit: int | None = None) -> str:
    """The one rule both engines and ingest apply, from the tokens alone (never trusted from a string).

    "stop"   the last token is in the published stop set (and no stop token comes before it);
    "length" no stop token, and the completion reached max_new_tokens — or the model's context
             (prompt_len + len == context_limit), where an engine must stop too.
    Anything else — a stop token before the end, or a completion that ended early without one —
    is MALFORMED: no engine that follows the manifest produces it.
    """
    return derive_finish_reasons([token_ids], stop_token_ids, max_new_tokens=max_new_tokens, prompt_len=prompt_len,
                                 context_limit=context_limit)[0]


def derive_finish_reasons(completions, stop_token_ids, *, max_new_tokens: int, prompt_len: int = 0,
                          context_limit: int | None = None) -> list[str]:
    """`derive_finish_reason` of each completion (token id lists or arrays) of one prompt: a single numpy
    pass over all their tokens (ingest checks 64 x 512 per batch), not a Python loop per token."""
    lengths = [len(t) for t in completions]
    if not all(lengths):
        raise _bad("empty completion")
    flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in completions])
    hit = np.zeros(len(flat), dtype=bool)
    for stop in set(stop_token_ids):
        hit |= flat == stop
    ends = np.cumsum(lengths) - 1
    ends_on_stop = hit[ends].tolist()
    hit[ends] = False
    if hit.any():
        raise _bad("completion goes on after a stop token")
    out = []
    for n, stopped in zip(lengths, ends_on_stop):
        if stopped:
            out.append("stop")
        elif n == max_new_tokens or (context_limit is not None and prompt_len + n == context_limit):
            out.append("length")
        else:
            raise _bad(f"completion of {n} tokens ends without a stop token before max_new_tokens={max_new_tokens}")
    return out


def validate_manifest(m: AdapterManifest) -> None:
    """Internal consistency of a manifest (the signature and hashes are checked elsewhere)."""
    _check_schema(m.schema)
    _int_range(m.version, "version", 0)
    _int_range(m.keyframe_version, "keyframe_version", 0, m.version)
    if m.parent_version is not None:
        _int_range(m.parent_version, "parent_version", 0, m.version - 1)
        if m.keyframe_version > m.parent_version:
            raise _bad("keyframe_version must be <= parent_version for a delta")
    _finite(m.created_at, "created_at")
    _int_range(m.lora.r, "lora.r", 1)
    _finite(m.lora.alpha, "lora.alpha")
    _finite(m.lora.dropout, "lora.dropout")
    if not 0 <= m.lora.dropout < 1:
        raise _bad("lora.dropout must be in [0, 1)")
    if not 1 <= len(m.tensors) <= limits.MAX_TENSORS_PER_ADAPTER:
        raise _bad(f"tensors must hold 1..{limits.MAX_TENSORS_PER_ADAPTER} specs, got {len(m.tensors)}")
    names = set()
    for i, t in enumerate(m.tensors):
        if not t.name or t.name in names:
            raise _bad(f"tensors[{i}].name must be non-empty and unique")
        names.add(t.name)
        if t.dtype not in _DTYPE_BYTES:
            raise _bad(f"tensors[{i}].dtype {t.dtype!r} unknown")
        if not 1 <= len(t.shape) <= limits.MAX_TENSOR_DIMS or any(type(d) is not int or d < 1 for d in t.shape):
            raise _bad(f"tensors[{i}].shape must be 1..{limits.MAX_TENSOR_DIMS} positive dims, got {t.shape}")
    raw = sum(t.nbytes for t in m.tensors)
    if m.raw_bytes != raw:
        raise _bad(f"raw_bytes {m.raw_bytes} != sum of tensor sizes {raw}")
    _int_range(m.compressed_bytes, "compressed_bytes", 0)
    if m.canary is not None:
        c = m.canary
        n = len(c.completion_token_ids)
        if not c.prompt_token_ids or not n or len(c.prompt_token_ids) % 4 or n % 4 or \
                len(c.logprobs) != n or len(c.base_logprobs) != n:
            raise _bad("canary: token ids and both log-prob arrays must be non-empty int32/float32, one per token")
    _int_range(m.chunk_bytes, "chunk_bytes", 1, limits.MAX_CHUNK_BYTES)
    n_chunks = -(-m.compressed_bytes // m.chunk_bytes)
    if len(m.chunk_hashes) != n_chunks:
        raise _bad(f"chunk_hashes has {len(m.chunk_hashes)} entries, expected ceil({m.compressed_bytes}/{m.chunk_bytes}) = {n_chunks}")
    if any(not isinstance(h, bytes) or len(h) != SHA256_BYTES for h in m.chunk_hashes):
        raise _bad("chunk_hashes must be 32-byte sha256 digests")
    for f in ("base_model", "base_revision", "base_weights_sha256", "tokenizer_sha256"):
        if len(getattr(m, f)) > 512:
            raise _bad(f"{f} longer than 512 characters")
    if len(set(m.stop_token_ids)) != len(m.stop_token_ids):
        raise _bad("stop_token_ids must be unique")
    for i, t in enumerate(m.stop_token_ids):
        _int_range(t, f"stop_token_ids[{i}]", 0, 2**31 - 1)


def validate_pointer(p: AdapterPointer) -> None:
    _check_schema(p.schema)
    _int_range(p.version, "version", 0)
    _int_range(p.keyframe_version, "keyframe_version", 0, p.version)
    if not isinstance(p.manifest_sha256, bytes) or len(p.manifest_sha256) != SHA256_BYTES:
        raise _bad("manifest_sha256 must be a 32-byte sha256 digest")
    _finite(p.published_at, "published_at")


def decode_rollout_batch(data: bytes, *, max_bytes: int, vocab_size: int | None = None) -> RolloutBatch:
    batch = decode(data, RolloutBatch, max_bytes=max_bytes)
    validate_rollout_batch(batch, vocab_size=vocab_size)
    return batch


def decode_manifest(data: bytes, *, max_bytes: int = limits.MAX_MANIFEST_BYTES) -> AdapterManifest:
    manifest = decode(data, AdapterManifest, max_bytes=max_bytes)
    validate_manifest(manifest)
    return manifest


def decode_pointer(data: bytes, *, max_bytes: int = limits.MAX_POINTER_BYTES) -> AdapterPointer:
    pointer = decode(data, AdapterPointer, max_bytes=max_bytes)
    validate_pointer(pointer)
    return pointer
