"""Swarm records in the DHT: their keys, who may write them, and what they say. Pure (no hivemind).

Three kinds of small records per run (adapter bytes travel over P2P streams, never through the DHT)::

    pointer   key    asyncrl/<run>/adapter/<coordinator peer id>        (plain value, no subkey)
              value  envelope(kind "adapter_pointer", signer = that coordinator, broadcast)
                     of an AdapterPointer {run, version, manifest sha256, keyframe version, published_at}
    providers key    asyncrl/<run>/providers/<coordinator peer id>      (plain value, no subkey)
              value  envelope(kind "providers", signer = that coordinator, broadcast)
                     of a ProvidersRecord {version, seeders, holders}: the fetch sources it vouches for
    presence  key    asyncrl/<run>/presence/<shard>   subkey  <volunteer peer id>
              value  envelope(kind "presence", signer = the Ed25519 key inside that peer id)
                     of a PresenceRecord {adapter version held, versions served, throughput, ...}

Presence is sharded so that no DHT value grows with the swarm: a volunteer writes only to shard
`presence_shard(peer id)` (sha256 of the peer id, mod PRESENCE_SHARDS) and a record under another shard is
refused; the coordinator is the one reader of all shards, and a reader verifies at most
MAX_RECORDS_PER_SHARD records of a shard. Volunteers read no presence at all: they fetch only from the
peers the coordinator's signed providers record names (docs/scale.md), so self-declared records — free
to forge in bulk under fresh keys — decide nothing about where chunks come from.

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
The run's end is a pointer too: the last manifest again, later, with `finished` set (`finish_pointer`).
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
PRESENCE_SHARDS = 64
"""Presence shards: a value holds ~N/64 records (10,000 volunteers: ~160, ~80 KB)."""
MAX_RECORDS_PER_SHARD = 256
"""A reader verifies at most this many records of one shard (64 x 256 = 16,384 volunteers; docs/scale.md)."""
PROVIDERS_TTL_S = 120.0
"""The providers record lives this long unless re-issued (the coordinator re-issues every few seconds)."""
MAX_SEEDERS = 64
"""Schema cap on the seeders a record may name (decoding refuses more)."""
MAX_HOLDERS = 64
"""Schema cap on the holders one record may name."""
SEEDERS_PER_VERSION = 8
"""Peers the coordinator names to seed a fresh version (each fetches its share of chunks from the coordinator
once and serves it to the rest); a constant, so a providers record does not grow with the swarm."""
HOLDERS_PER_SHARD = 8
"""Holders of complete versions named in one providers shard (late joiners walking a delta chain)."""
MAX_PROVIDER_SHARDS = 64
"""The providers record is split into ceil(vouched / HOLDERS_PER_SHARD) shards, at most this many
(64 x 8 = 512 holders named across the swarm); a volunteer reads only the shard its peer id hashes to."""
MAX_HOLDER_VERSIONS = 16
MAX_PEER_ID_CHARS = 64
MAX_PROVIDERS_BYTES = 16 * limits.KiB

POINTER_KIND = "adapter_pointer"
PRESENCE_KIND = "presence"
PROVIDERS_KIND = "providers"


def pointer_key(run_id: str, coordinator_peer_id: str) -> str:
    return f"asyncrl/{run_id}/adapter/{coordinator_peer_id}"


def providers_key(run_id: str, coordinator_peer_id: str, shard: int = 0) -> str:
    """Shard 0 keeps the unsharded key (it is also where a reader that knows no shard count starts)."""
    if not 0 <= shard < MAX_PROVIDER_SHARDS:
        raise ValueError(f"providers shard {shard} not in [0, {MAX_PROVIDER_SHARDS})")
    base = f"asyncrl/{run_id}/providers/{coordinator_peer_id}"
    return base if shard == 0 else f"{base}/{shard}"


def _peer_hash(peer_id: str) -> int:
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big")


def presence_shard(peer_id: str) -> int:
    """The one presence shard `peer_id` may write to."""
    return _peer_hash(peer_id) % PRESENCE_SHARDS


def providers_shard(peer_id: str, shards: int) -> int:
    """The providers shard `peer_id` reads when the record is split into `shards`."""
    return _peer_hash(peer_id) % max(1, min(shards, MAX_PROVIDER_SHARDS))


def presence_key(run_id: str, shard: int) -> str:
    if not 0 <= shard < PRESENCE_SHARDS:
        raise ValueError(f"presence shard {shard} not in [0, {PRESENCE_SHARDS})")
    return f"asyncrl/{run_id}/presence/{shard}"


PeerIdStr = Annotated[str, msgspec.Meta(max_length=MAX_PEER_ID_CHARS)]


class ProviderHolder(messages._Record):
    peer_id: PeerIdStr
    versions: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_HOLDER_VERSIONS)]  # complete, newest last


class ProvidersRecord(messages._Message):
    """The fetch sources the coordinator vouches for (signed by it). `seeders` are fixed for `version`:
    every fetcher computes the same chunk -> seeder assignment from them (swarm/fetch.py)."""

    run_id: str
    version: int  # the newest version published when this was issued; seeders are for it
    issued_at: float
    seeders: Annotated[tuple[PeerIdStr, ...], msgspec.Meta(max_length=MAX_SEEDERS)]
    holders: Annotated[tuple[ProviderHolder, ...], msgspec.Meta(max_length=MAX_HOLDERS)]
    shard: int = 0  # the key it is stored under (providers_key(..., shard)); seeders are the same in every shard
    shards: int = 1  # how many shards the coordinator issues now: a reader re-reads providers_shard(me, shards)


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


def finish_pointer(identity: Identity, sealed: bytes, *, now: float | None = None) -> bytes:
    """The final pointer: the latest pointer's version and manifest, published now, with `finished` set."""
    opened = envelope.open_envelope(sealed, max_bytes=limits.MAX_POINTER_BYTES, expected_kind=POINTER_KIND,
                                    expected_audience=envelope.BROADCAST, expected_signer=identity.public_key,
                                    window_s=None)
    last = messages.decode_pointer(opened.payload)
    final = messages.AdapterPointer(run_id=last.run_id, version=last.version, manifest_sha256=last.manifest_sha256,
                                    keyframe_version=last.keyframe_version, finished=True,
                                    published_at=max(time.time() if now is None else now, last.published_at + 1e-3))
    return envelope.seal(identity, POINTER_KIND, messages.encode(final))


def reseal_pointer(identity: Identity, sealed: bytes) -> bytes:
    """The same pointer payload under a fresh signature and timestamp (for refreshing the record)."""
    opened = envelope.open_envelope(sealed, max_bytes=limits.MAX_POINTER_BYTES, expected_kind=POINTER_KIND,
                                    expected_audience=envelope.BROADCAST, expected_signer=identity.public_key,
                                    window_s=None)
    return envelope.seal(identity, POINTER_KIND, opened.payload)


def pointer_is_newer(new: messages.AdapterPointer, held: messages.AdapterPointer | None) -> bool:
    """True if `new` names another manifest published later than `held` (see the module docstring), or is
    the later, final pointer of the same manifest (the run finished at that version)."""
    if held is None:
        return True
    if new.published_at <= held.published_at:
        return False
    return new.manifest_sha256 != held.manifest_sha256 or (new.finished and not held.finished)


# ---- providers -----------------------------------------------------------------------------------


def seal_providers(identity: Identity, record: ProvidersRecord) -> bytes:
    return envelope.seal(identity, PROVIDERS_KIND, messages.encode(record))


def check_providers(value: bytes, *, coordinator_key: bytes, run_id: str, expiration_time: float | None = None,
                    now: float | None = None, shard: int | None = None) -> ProvidersRecord:
    """Verify a providers record: the coordinator's signature, run, well-formed peer ids, and (with `shard`)
    that it is the record for the key it was read from. Only ProtocolError escapes."""
    now = time.time() if now is None else now
    opened = envelope.open_envelope(value, max_bytes=MAX_PROVIDERS_BYTES, expected_kind=PROVIDERS_KIND,
                                    expected_audience=envelope.BROADCAST, expected_signer=coordinator_key,
                                    window_s=None)
    record = messages.decode(opened.payload, ProvidersRecord, max_bytes=MAX_PROVIDERS_BYTES)
    if record.run_id != run_id:
        raise ProtocolError(RejectCode.WRONG_RUN, f"providers for run {record.run_id!r}")
    if type(record.version) is not int or record.version < 0:
        raise ProtocolError(RejectCode.MALFORMED, "version must be an int >= 0")
    if not (type(record.shards) is int and 1 <= record.shards <= MAX_PROVIDER_SHARDS
            and type(record.shard) is int and 0 <= record.shard < MAX_PROVIDER_SHARDS):
        raise ProtocolError(RejectCode.MALFORMED, f"shard {record.shard!r} of {record.shards!r} out of range")
    if shard is not None and record.shard != shard:
        raise ProtocolError(RejectCode.MALFORMED, f"providers shard {record.shard} stored under shard {shard}'s key")
    messages._finite(record.issued_at, "issued_at")
    for peer in (*record.seeders, *(h.peer_id for h in record.holders)):
        public_key_from_peer_id(peer)  # MALFORMED unless an Ed25519 peer id
    if any(type(v) is not int or v < 0 for h in record.holders for v in h.versions):
        raise ProtocolError(RejectCode.MALFORMED, "holder versions must be ints >= 0")
    _check_expiration(expiration_time, opened.timestamp, PROVIDERS_TTL_S, now)
    return record


# ---- presence ------------------------------------------------------------------------------------


def seal_presence(identity: Identity, record: PresenceRecord) -> bytes:
    if record.peer_id != identity.peer_id:
        raise ValueError("a presence record is signed by the peer it describes")
    return envelope.seal(identity, PRESENCE_KIND, messages.encode(record))


def check_presence(value: bytes, *, subkey: str, run_id: str, expiration_time: float | None = None,
                   now: float | None = None, shard: int | None = None) -> PresenceRecord:
    """Verify a presence record stored under `subkey` (a peer id) of presence shard `shard` (when given,
    the peer must belong to it: NOT_ALLOWED otherwise). Only ProtocolError escapes."""
    now = time.time() if now is None else now
    signer = public_key_from_peer_id(subkey)  # MALFORMED unless an Ed25519 peer id
    if shard is not None and presence_shard(subkey) != shard:
        raise ProtocolError(RejectCode.NOT_ALLOWED, "presence record in another peer's shard")
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
