"""Swarm records in the DHT: their keys, who may write them, and what they say. Pure (no hivemind).

Two kinds of small records per run (adapter bytes travel over P2P streams, never through the DHT)::

    pointer   key    asyncrl/<run>/adapter/<coordinator peer id>        (plain value, no subkey)
              value  envelope(kind "adapter_pointer", signer = that coordinator, broadcast)
                     of an AdapterPointer {run, version, manifest sha256, keyframe version, published_at}
    presence  key    asyncrl/<run>/presence     subkey  <volunteer peer id>
              value  envelope(kind "presence", signer = the Ed25519 key inside that peer id)
                     of a PresenceRecord {adapter version held, versions served, throughput, ...}

The coordinator's peer id is in the pointer's key, so each coordinator has its own pointer and a node
that knows the join address knows whose signature the pointer needs. Every asyncrl DHT node runs
`check_pointer` / `check_presence` on every record it is asked to store or receives in an answer
(`swarm/records.py` wires them into hivemind as a record validator), so a pointer signed by
anyone but the coordinator, or a presence record for someone else's peer id, is refused everywhere.

Freshness: hivemind does not sign a record's expiration time and answers `get` with the value that
expires last, so a replayed old record given a far-future expiration would outrank the newest one.
The checks bound it by the *signed* envelope timestamp: expiration <= timestamp + TTL + clock slack.
The coordinator therefore re-seals the pointer (same payload, new timestamp) on every refresh.

Which pointer is newer (`pointer_is_newer`): a different manifest with a later `published_at`. That
is the coordinator's clock, not the version number, so a coordinator restarted without its checkpoint
(versions start again at 0) is followed, while replayed old pointers (older `published_at`) are not.
"""

from __future__ import annotations

import hashlib
import time
from typing import Annotated

import msgspec

from . import envelope, limits, messages
from .errors import ProtocolError, RejectCode
from .identity import Identity, peer_id_from_public_key, public_key_from_peer_id

POINTER_TTL_S = 600.0
"""A pointer lives this long in the DHT unless refreshed (the coordinator refreshes every minute)."""
PRESENCE_TTL_S = 30.0
"""A presence record lives this long; volunteers re-announce every few seconds, so a vanished one
drops out of the provider set within this time."""
CLOCK_SLACK_S = 60.0
"""Tolerated clock difference between the signer and the node checking the record."""
MAX_PRESENCE_BYTES = 4 * limits.KiB
MAX_VERSIONS_SERVED = 64
MAX_NAME_CHARS = 64
MAX_MADDRS = 8
MAX_MADDR_CHARS = 256

POINTER_KIND = "adapter_pointer"
PRESENCE_KIND = "presence"


def pointer_key(run_id: str, coordinator_peer_id: str) -> str:
    return f"asyncrl/{run_id}/adapter/{coordinator_peer_id}"


def presence_key(run_id: str) -> str:
    return f"asyncrl/{run_id}/presence"


class PresenceRecord(messages._Message):
    """What a volunteer announces about itself (signed by its own key, stored under its peer id)."""

    run_id: str
    peer_id: str
    name: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
    adapter_version: int  # the version it generates with; -1 = none yet
    versions: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_VERSIONS_SERVED)]  # complete, served
    serving: bool  # accepts chunk requests (False in client mode or with --no-serve)
    upload_bps: int  # its upload cap in bytes/s; 0 = unlimited
    throughput: float  # rollouts per second over its recent batches
    last_seen: float  # its clock when it wrote this record
    maddrs: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=MAX_MADDR_CHARS)], ...],
                      msgspec.Meta(max_length=MAX_MADDRS)] = ()  # where it listens (a restarted coordinator calls back)


# ---- pointer -------------------------------------------------------------------------------------


def _check_expiration(expiration_time: float | None, timestamp: float, ttl: float, now: float) -> None:
    if timestamp > now + CLOCK_SLACK_S:
        raise ProtocolError(RejectCode.EXPIRED, f"record signed {timestamp - now:.0f}s in the future")
    if expiration_time is not None and expiration_time > timestamp + ttl + CLOCK_SLACK_S:
        raise ProtocolError(RejectCode.EXPIRED, "record expiration reaches beyond its signed timestamp + TTL")


def check_pointer(value: bytes, *, coordinator_key: bytes, run_id: str, expiration_time: float | None = None,
                  now: float | None = None) -> tuple[messages.AdapterPointer, float]:
    """Verify a pointer record; returns (pointer, signed timestamp). Only ProtocolError escapes."""
    now = time.time() if now is None else now
    opened = envelope.open_envelope(value, max_bytes=limits.MAX_POINTER_BYTES, expected_kind=POINTER_KIND,
                                    expected_audience=envelope.BROADCAST, expected_signer=coordinator_key,
                                    window_s=None)
    pointer = messages.decode_pointer(opened.payload)
    if pointer.run_id != run_id:
        raise ProtocolError(RejectCode.WRONG_RUN, f"pointer for run {pointer.run_id!r}")
    _check_expiration(expiration_time, opened.timestamp, POINTER_TTL_S, now)
    return pointer, opened.timestamp


def reseal_pointer(identity: Identity, sealed: bytes) -> bytes:
    """The same pointer payload under a fresh signature and timestamp (for refreshing the record)."""
    opened = envelope.open_envelope(sealed, max_bytes=limits.MAX_POINTER_BYTES, expected_kind=POINTER_KIND,
                                    expected_audience=envelope.BROADCAST, expected_signer=identity.public_key,
                                    window_s=None)
    return envelope.seal(identity, POINTER_KIND, opened.payload)


def pointer_is_newer(new: messages.AdapterPointer, held: messages.AdapterPointer | None) -> bool:
    """True if `new` names another manifest published later than `held` (see the module docstring)."""
    if held is None:
        return True
    return new.manifest_sha256 != held.manifest_sha256 and new.published_at > held.published_at


def manifest_matches(raw_manifest: bytes, pointer: messages.AdapterPointer) -> bool:
    return hashlib.sha256(raw_manifest).digest() == pointer.manifest_sha256


# ---- presence ------------------------------------------------------------------------------------


def seal_presence(identity: Identity, record: PresenceRecord) -> bytes:
    if record.peer_id != identity.peer_id:
        raise ValueError("a presence record is signed by the peer it describes")
    return envelope.seal(identity, PRESENCE_KIND, messages.encode(record))


def check_presence(value: bytes, *, subkey: str, run_id: str, expiration_time: float | None = None,
                   now: float | None = None) -> PresenceRecord:
    """Verify a presence record stored under `subkey` (a peer id). Only ProtocolError escapes."""
    now = time.time() if now is None else now
    signer = public_key_from_peer_id(subkey)  # MALFORMED unless an Ed25519 peer id
    opened = envelope.open_envelope(value, max_bytes=MAX_PRESENCE_BYTES, expected_kind=PRESENCE_KIND,
                                    expected_audience=envelope.BROADCAST, expected_signer=signer, window_s=None)
    record = messages.decode(opened.payload, PresenceRecord, max_bytes=MAX_PRESENCE_BYTES)
    if record.run_id != run_id:
        raise ProtocolError(RejectCode.WRONG_RUN, f"presence for run {record.run_id!r}")
    if record.peer_id != subkey or peer_id_from_public_key(signer) != subkey:
        raise ProtocolError(RejectCode.NOT_ALLOWED, "presence record for another peer id")
    if type(record.adapter_version) is not int or record.adapter_version < -1:
        raise ProtocolError(RejectCode.MALFORMED, "adapter_version must be an int >= -1")
    if any(type(v) is not int or v < 0 for v in record.versions):
        raise ProtocolError(RejectCode.MALFORMED, "versions must be ints >= 0")
    messages._finite(record.throughput, "throughput")
    messages._finite(record.last_seen, "last_seen")
    if type(record.upload_bps) is not int or record.upload_bps < 0:
        raise ProtocolError(RejectCode.MALFORMED, "upload_bps must be an int >= 0")
    _check_expiration(expiration_time, opened.timestamp, PRESENCE_TTL_S, now)
    return record
