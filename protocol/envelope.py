"""Signed envelopes: sign the exact bytes, verify before decoding.

Wire form::

    b"ARL1" | signer public key (32) | Ed25519 signature (64) | body
    body = msgpack(EnvelopeBody{kind, audience(32; zeros = broadcast), timestamp, nonce(16), payload})
    signature = Ed25519(signer, b"asyncrl-envelope-v1\\x00" + body)

The payload is itself an encoded message (see messages.py); its sha256 (`Opened.payload_id`) is the
id used for idempotent ingest, so the same batch re-sealed (new nonce, new timestamp) is still a
duplicate. `open_envelope` runs its checks cheapest first so hostile input costs as little as possible:
size -> magic -> expected signer -> signature -> body decode -> kind -> audience -> timestamp -> nonce.
Replay protection across calls is `ReplayGuard`'s job: open first, then `check_and_remember`.

Clock: `seal` stamps envelopes with `clock()`, the wall clock plus ASYNCRL_TEST_CLOCK_SKEW_S seconds when that
variable is set — a test-only way to give one process a wrong clock (tests/integration/test_doctor.py);
nothing else reads it.

Audience rule: a sealed audience must equal `expected_audience` exactly (a broadcast envelope is not
accepted where a directed one is expected, and vice versa); `expected_audience=None` skips the check.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import os
import time
from dataclasses import dataclass

import msgspec

from .errors import ProtocolError, RejectCode
from .identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, verify_signature
from .limits import NONCE_BYTES, TIMESTAMP_WINDOW_S

PROTOCOL_VERSION = 1
"""The envelope format; MAGIC ends in it (protocol/handshake.py reports it to the other side)."""
MAGIC = b"ARL" + str(PROTOCOL_VERSION).encode()
DOMAIN = b"asyncrl-envelope-v1\x00"  # domain separation: these signatures mean nothing elsewhere
BROADCAST = bytes(PUBLIC_KEY_BYTES)
HEADER_BYTES = len(MAGIC) + PUBLIC_KEY_BYTES + SIGNATURE_BYTES
CLOCK_SKEW_ENV = "ASYNCRL_TEST_CLOCK_SKEW_S"
_SKEW_S = float(os.environ.get(CLOCK_SKEW_ENV) or 0.0)


def clock() -> float:
    """The clock this process stamps envelopes with (see the module docstring)."""
    return time.time() + _SKEW_S


class EnvelopeBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: str
    audience: bytes
    timestamp: float
    nonce: bytes
    payload: bytes


@dataclass(frozen=True)
class Opened:
    signer: bytes
    kind: str
    audience: bytes
    timestamp: float
    nonce: bytes
    payload: bytes
    payload_id: bytes  # sha256(payload): the batch id for idempotency


_body_encoder = msgspec.msgpack.Encoder()
_body_decoder = msgspec.msgpack.Decoder(EnvelopeBody)


def seal(
    identity: Identity,
    kind: str,
    payload: bytes,
    *,
    audience: bytes = BROADCAST,
    now: float | None = None,
    nonce: bytes | None = None,
) -> bytes:
    """Sign `payload` for `audience` and return the envelope bytes. Caller mistakes raise ValueError."""
    if len(audience) != PUBLIC_KEY_BYTES:
        raise ValueError(f"audience must be {PUBLIC_KEY_BYTES} bytes")
    nonce = os.urandom(NONCE_BYTES) if nonce is None else bytes(nonce)
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"nonce must be {NONCE_BYTES} bytes")
    timestamp = clock() if now is None else float(now)
    if not math.isfinite(timestamp):
        raise ValueError("timestamp must be finite")
    body = _body_encoder.encode(
        EnvelopeBody(kind=kind, audience=bytes(audience), timestamp=timestamp, nonce=nonce, payload=bytes(payload))
    )
    return MAGIC + identity.public_key + identity.sign(DOMAIN + body) + body


def sealed_size_bound(kind: str, payload_bytes: int) -> int:
    """The most bytes `seal` can produce for a payload of this size (header + body framing): start-up
    checks size a batch against a byte cap with it (coordinator/leasing/preflight.py)."""
    empty = _body_encoder.encode(EnvelopeBody(kind=kind, audience=BROADCAST, timestamp=0.0,
                                              nonce=bytes(NONCE_BYTES), payload=b""))
    return HEADER_BYTES + len(empty) + 4 + payload_bytes  # +4: a bin8 length header grows to at most bin32


def open_envelope(
    data: bytes,
    *,
    max_bytes: int,
    expected_kind: str,
    expected_audience: bytes | None,
    expected_signer: bytes | None = None,
    now: float | None = None,
    window_s: float | None = TIMESTAMP_WINDOW_S,
) -> Opened:
    """Verify and unpack an envelope. Only ProtocolError escapes, whatever the bytes."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(RejectCode.MALFORMED, f"expected bytes, got {type(data).__name__}")
    try:
        data = memoryview(data).cast("B")
    except (TypeError, ValueError) as e:
        raise ProtocolError(RejectCode.MALFORMED, f"unreadable buffer: {e}") from None
    if data.nbytes > max_bytes:
        raise ProtocolError(RejectCode.PAYLOAD_TOO_LARGE, f"{data.nbytes} bytes > cap {max_bytes}")
    magic = bytes(data[: len(MAGIC)])
    if magic != MAGIC:
        if len(magic) == 4 and magic[:3] == MAGIC[:3] and magic[3:].isdigit():
            raise ProtocolError(RejectCode.UNSUPPORTED_VERSION, f"envelope version {magic!r}, this peer speaks {MAGIC!r}")
        raise ProtocolError(RejectCode.MALFORMED, "not an asyncrl envelope (bad magic)")
    if data.nbytes <= HEADER_BYTES:
        raise ProtocolError(RejectCode.MALFORMED, "envelope truncated")
    signer = bytes(data[len(MAGIC) : len(MAGIC) + PUBLIC_KEY_BYTES])
    signature = bytes(data[len(MAGIC) + PUBLIC_KEY_BYTES : HEADER_BYTES])
    if expected_signer is not None and signer != expected_signer:
        raise ProtocolError(RejectCode.NOT_ALLOWED, "envelope not signed by the expected key")
    body = data[HEADER_BYTES:]
    verify_signature(signer, signature, DOMAIN + body)
    try:
        parsed = _body_decoder.decode(body)
    except Exception as e:  # only reachable with a validly signed but broken body
        raise ProtocolError(RejectCode.MALFORMED, f"envelope body: {e}") from None
    if not math.isfinite(parsed.timestamp):
        raise ProtocolError(RejectCode.MALFORMED, "envelope timestamp is not finite")
    if parsed.kind != expected_kind:
        raise ProtocolError(RejectCode.MALFORMED, f"envelope kind {parsed.kind!r}, expected {expected_kind!r}")
    if expected_audience is not None and parsed.audience != expected_audience:
        raise ProtocolError(RejectCode.WRONG_AUDIENCE, "envelope sealed for another recipient")
    if window_s is not None:
        now = time.time() if now is None else now
        if abs(parsed.timestamp - now) > window_s:
            raise ProtocolError(RejectCode.EXPIRED, f"timestamp {parsed.timestamp:.0f} is {parsed.timestamp - now:+.0f}s from now")
    if len(parsed.nonce) != NONCE_BYTES:
        raise ProtocolError(RejectCode.MALFORMED, f"nonce must be {NONCE_BYTES} bytes")
    return Opened(
        signer=signer,
        kind=parsed.kind,
        audience=parsed.audience,
        timestamp=parsed.timestamp,
        nonce=parsed.nonce,
        payload=parsed.payload,
        payload_id=hashlib.sha256(parsed.payload).digest(),
    )


class _GuardState(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    version: int
    window_s: float
    max_entries: int
    floor: float
    entries: list[tuple[bytes, bytes, float]]


class ReplayGuard:
    """Remembers (signer, nonce) of accepted envelopes for as long as they could pass `open_envelope`.

    Entries older than `now - window_s` are forgotten: such an envelope would be EXPIRED anyway, and the
    guard itself refuses timestamps that old (EXPIRED), so forgetting never admits a replay. When full,
    the oldest entry is evicted and its timestamp becomes a floor below which everything is EXPIRED:
    memory stays bounded and a replay is still never accepted (late messages are refused instead).
    Not thread-safe: call it from the one task/thread that ingests envelopes.
    """

    _STATE_VERSION = 1

    def __init__(self, window_s: float = TIMESTAMP_WINDOW_S, max_entries: int = 1_000_000) -> None:
        if not (window_s > 0 and max_entries > 0):
            raise ValueError("window_s and max_entries must be positive")
        self.window_s = float(window_s)
        self.max_entries = int(max_entries)
        self._floor = -math.inf
        self._seen: dict[bytes, float] = {}
        self._heap: list[tuple[float, bytes]] = []  # (timestamp, key), one pair per remembered key

    def __len__(self) -> int:
        return len(self._seen)

    def _pop_oldest(self) -> float:
        ts, key = heapq.heappop(self._heap)
        self._seen.pop(key, None)
        return ts

    def check_and_remember(self, signer: bytes, nonce: bytes, timestamp: float, *, now: float | None = None) -> None:
        """Raise NONCE_REUSED if seen before (EXPIRED if too old to tell); otherwise remember it.

        `now` defaults to the wall clock; pass the same value given to `open_envelope`.
        """
        if len(signer) != PUBLIC_KEY_BYTES:
            raise ValueError(f"signer must be a {PUBLIC_KEY_BYTES}-byte public key")
        now = time.time() if now is None else now
        horizon = now - self.window_s
        while self._heap and self._heap[0][0] < horizon:
            self._pop_oldest()
        if not math.isfinite(timestamp) or timestamp < horizon or timestamp <= self._floor:
            raise ProtocolError(RejectCode.EXPIRED, "timestamp older than the replay guard's memory")
        key = bytes(signer) + bytes(nonce)
        if key in self._seen:
            raise ProtocolError(RejectCode.NONCE_REUSED, "nonce already used by this signer")
        while len(self._seen) >= self.max_entries:
            self._floor = max(self._floor, self._pop_oldest())
        if timestamp <= self._floor:
            raise ProtocolError(RejectCode.EXPIRED, "timestamp older than the replay guard's memory")
        self._seen[key] = timestamp
        heapq.heappush(self._heap, (timestamp, key))

    def merge(self, other: ReplayGuard) -> None:
        """Remember everything `other` remembers too (e.g. a persisted guard after a restart)."""
        self._floor = max(self._floor, other._floor)
        for key, ts in other._seen.items():
            if key not in self._seen and ts > self._floor:
                self._seen[key] = ts
                heapq.heappush(self._heap, (ts, key))
        while len(self._seen) > self.max_entries:
            self._floor = max(self._floor, self._pop_oldest())

    def to_bytes(self) -> bytes:
        """Serialise the seen-set (msgpack, no pickle) so it survives a restart."""
        return self.encode_snapshot(self.snapshot())

    def snapshot(self) -> tuple:
        """A cheap copy of the state (call under the owner's lock); `encode_snapshot` it outside the lock."""
        return self.window_s, self.max_entries, self._floor, list(self._seen.items())

    @classmethod
    def encode_snapshot(cls, snapshot: tuple) -> bytes:
        window_s, max_entries, floor, items = snapshot
        entries = [(k[:PUBLIC_KEY_BYTES], k[PUBLIC_KEY_BYTES:], ts) for k, ts in items]
        return msgspec.msgpack.encode(_GuardState(cls._STATE_VERSION, window_s, max_entries, floor, entries))

    @classmethod
    def from_bytes(cls, data: bytes) -> ReplayGuard:
        """Inverse of `to_bytes`; a corrupt state raises ProtocolError(MALFORMED)."""
        try:
            state = msgspec.msgpack.decode(data, type=_GuardState)
            if state.version != cls._STATE_VERSION:
                raise ValueError(f"unknown state version {state.version}")
            guard = cls(window_s=state.window_s, max_entries=state.max_entries)
            if math.isnan(state.floor) or any(len(s) != PUBLIC_KEY_BYTES or not math.isfinite(t) for s, _, t in state.entries):
                raise ValueError("bad entry")
        except Exception as e:
            raise ProtocolError(RejectCode.MALFORMED, f"replay guard state: {e}") from None
        guard._floor = state.floor
        for signer, nonce, ts in state.entries:
            key = signer + nonce
            if key not in guard._seen:
                guard._seen[key] = ts
                guard._heap.append((ts, key))
        heapq.heapify(guard._heap)
        return guard
