"""Access control: who may talk to the coordinator, how often, and who has lost the right to.

Owned here and nowhere else:
  * mode `open` (anyone with a key) or `allowlist` (a file of volunteer keys, re-read whenever its
    mtime or size changes: no restart needed);
  * a ban-list file (operator-owned, same format, re-read on change) plus automatic bans;
  * token buckets per identity (Ed25519 key), per transport peer id (libp2p authenticates it), and one
    shared bucket for identities seen for the first time (the Sybil brake: fresh keys are free, first
    contact is not);
  * a per-identity quota: accepted batches per rolling hour;
  * strikes. An identity is struck only for evidence of a lie that needs its private key and that
    honest code cannot produce: MALFORMED after a valid signature, and a generation audit failure the
    quarantine confirmed (coordinator/trust/audit.py). Not for REWARD_MISMATCH (we train on our own recomputed
    rewards, so the claim cannot reach a gradient; an honest volunteer can differ through a verifier
    version or timeout of its own), not for FUTURE_VERSION (a coordinator restarted without --resume
    under the same key numbers its versions from 0 again, so every honest volunteer still holding the
    old lineage's newer adapter, and every batch it spooled during the outage, claims a version this
    lineage has not published; striking those would ban an honest volunteer within a few batches
    (tests/integration/test_swarm_coordinator.py); the batch is refused either way, so the
    claim never reaches a gradient), not for anything our side could not finish
    (UNSCORABLE), and never for replays, expired timestamps or a foreign audience: anyone can replay
    someone else's envelope, and strikes must not be a way to get an honest volunteer banned.
    Unattributable garbage (bad signature, undecodable envelope) strikes the transport peer instead.
  * sender vs signer. A volunteer's peer id *is* its key, so a request whose transport peer is not the
    signer's peer id is a copy sent by someone else (a replay, a relay of stolen bytes). Such a copy is
    charged to the peer that sent it — its bucket, never the signer's — and once a key has had a batch
    accepted from its own peer, copies of its requests from any other peer are refused (NOT_ALLOWED,
    charged to that peer), so nobody can pin an honest volunteer's leases or drain its bucket. Each peer's
    `foreign_sent` / `foreign_refused` counts are in `status()["peers"]`; ingest writes no verdict on the
    signer's batch for such a refusal (it is the sender's, not the batch's).
    `max_strikes` / `peer_max_strikes` strikes ban; a ban is permanent until the operator clears it
    (bans persist in `state_bytes()`).
  * BOINC-style track record: `valid_streak(key)` = accepted batches since the identity's last strike;
    the generation audit samples with probability 1/n after n of them (coordinator/trust/audit.py).

Key-file format (allowlist and banlist): one key per line, any of: 64 hex characters (raw Ed25519
public key), a libp2p peer id ("12D3KooW..."), or a fingerprint ("ab12:cd34:ef56:7890"); `#` starts a
comment.

Callers order the checks cheapest first (see coordinator/ingest/ingest.py): `admit_peer` (before the request
frame's body is read) -> `check_signer` (header key, before the signature is verified: refusing costs
nothing and changes no state) -> signature etc. -> `admit_identity` (rate + quota; only after the
signature verified, so nobody can drain someone else's bucket). Every refusal is a ProtocolError with
NOT_ALLOWED or RATE_LIMITED. Thread-safe (one lock). All limits come from CoordinatorConfig.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import PUBLIC_KEY_BYTES, fingerprint, peer_id_from_public_key, public_key_from_peer_id
from asyncrl.swarm.rate import TokenBucket

# Offences that only the holder of the signing key can commit (the payload itself is the lie).
# ENV_MISMATCH: the replay of a pinned, deterministic environment disagrees with the claimed episode (envs/).
IDENTITY_STRIKES = frozenset({RejectCode.LOGPROB_MISMATCH, RejectCode.MALFORMED, RejectCode.ENV_MISMATCH})
# Suspicious but not proof (honest code can produce it): no strike, the key loses its track record
# (audited on every batch again). FUTURE_VERSION: see "strikes" in the module docstring.
IDENTITY_SUSPICIONS = frozenset({RejectCode.REWARD_MISMATCH, RejectCode.FUTURE_VERSION})
# Offences with no verified signer behind them: charge the (libp2p-authenticated) transport peer.
PEER_STRIKES = frozenset({RejectCode.SIGNATURE_MISMATCH, RejectCode.MALFORMED, RejectCode.UNSUPPORTED_VERSION,
                          RejectCode.PAYLOAD_TOO_LARGE})
MAX_TRACKED = 100_000  # identities / peers with live buckets (LRU); evicted ones start afresh
MAX_BANNED = 100_000  # automatic bans kept (oldest forgotten first: a throwaway key banned long ago)
HOUR_S = 3600.0


@dataclass(frozen=True)
class AccessPolicy:
    mode: str = "open"  # "open" | "allowlist"
    allowlist_path: str = ""
    banlist_path: str = ""
    identity_rate_per_s: float = 20.0
    identity_burst: int = 60
    peer_rate_per_s: float = 40.0
    peer_burst: int = 120
    new_identity_rate_per_s: float = 1.0
    new_identity_burst: int = 20
    batches_per_hour: int = 0  # 0 = no quota
    max_strikes: int = 3
    peer_max_strikes: int = 20

    @classmethod
    def from_config(cls, cfg) -> "AccessPolicy":
        return cls(mode=cfg.access_mode, allowlist_path=cfg.allowlist_path, banlist_path=cfg.banlist_path,
                   identity_rate_per_s=cfg.identity_rate_per_s, identity_burst=cfg.identity_burst,
                   peer_rate_per_s=cfg.peer_rate_per_s, peer_burst=cfg.peer_burst,
                   new_identity_rate_per_s=cfg.new_identity_rate_per_s, new_identity_burst=cfg.new_identity_burst,
                   batches_per_hour=cfg.batches_per_hour, max_strikes=cfg.max_strikes,
                   peer_max_strikes=cfg.peer_max_strikes)


def parse_key_file(text: str) -> tuple[set[bytes], set[str]]:
    """(public keys, fingerprints) listed in an allow/ban file; unparseable lines raise ValueError."""
    keys: set[bytes] = set()
    fps: set[str] = set()
    for n, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if len(entry) == 2 * PUBLIC_KEY_BYTES and all(c in "0123456789abcdefABCDEF" for c in entry):
            keys.add(bytes.fromhex(entry))
        elif entry.count(":") == 3 and len(entry) == 19:
            fps.add(entry.lower())
        else:
            try:
                keys.add(public_key_from_peer_id(entry))
            except ProtocolError:
                raise ValueError(f"line {n}: {entry[:40]!r} is not a hex key, peer id or fingerprint") from None
    return keys, fps


class KeyFile:
    """A key list on disk, re-read when (mtime, size) changes. A missing file lists nobody."""

    def __init__(self, path: str):
        self.path = Path(path) if path else None
        self._stamp: tuple[int, int] | None = None
        self.keys: set[bytes] = set()
        self.fingerprints: set[str] = set()
        self.error = ""

    def refresh(self) -> None:
        if self.path is None:
            return
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = (0, -1)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        if stamp[1] < 0:
            self.keys, self.fingerprints, self.error = set(), set(), f"{self.path} does not exist"
            return
        try:
            self.keys, self.fingerprints = parse_key_file(self.path.read_text())
            self.error = ""
        except (OSError, ValueError) as exc:  # keep the previous list: a half-edited file must not open the gate
            self.error = str(exc)

    def __contains__(self, key: bytes) -> bool:
        return key in self.keys or (bool(self.fingerprints) and fingerprint(key) in self.fingerprints)


@dataclass
class _Identity:
    bucket: TokenBucket
    strikes: int = 0
    valid_streak: int = 0
    accepted: int = 0  # batches accepted in all (a strike does not reset it)
    peer_id: str = ""  # the libp2p peer id of this key (its own transport identity)
    own_peer_seen: bool = False  # a batch of this key was accepted from its own peer id
    accepted_at: deque = field(default_factory=deque)  # wall times of accepted batches in the last hour
    rate_limited: int = 0


@dataclass
class _Peer:
    bucket: TokenBucket
    strikes: int = 0
    rate_limited: int = 0
    foreign_sent: int = 0     # requests signed by another key that this peer delivered (charged here)
    foreign_refused: int = 0  # ...of which refused because their signer delivers from its own peer


def _charged_to_peer(code: RejectCode, detail: str) -> ProtocolError:
    exc = ProtocolError(code, detail)
    exc.charge_peer = True  # ingest/leasing book it against the transport peer, not the signer
    return exc


class _State(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    banned: list[bytes]
    banned_peers: list[str]
    strikes: dict[str, int]  # hex key -> strikes (identities that have any)
    # hex key -> [accepted, valid_streak, own_peer_seen] (identities with accepted batches; version 2 on): a
    # restarted coordinator still knows who is proven and which keys deliver from their own peer
    records: dict[str, list[int]] = {}


class AccessControl:
    def __init__(self, policy: AccessPolicy, *, clock=time.monotonic, wall=time.time):
        if policy.mode not in ("open", "allowlist"):
            raise ValueError(f"access mode must be open or allowlist, got {policy.mode!r}")
        self.policy = policy
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()
        self.allowlist = KeyFile(policy.allowlist_path)
        self.banlist = KeyFile(policy.banlist_path)
        self.banned: OrderedDict[bytes, None] = OrderedDict()  # automatic bans (identities), oldest first
        self.banned_peers: OrderedDict[str, None] = OrderedDict()  # automatic bans (transport peers), oldest first
        self._ids: OrderedDict[bytes, _Identity] = OrderedDict()
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._new_ids = TokenBucket(policy.new_identity_rate_per_s, policy.new_identity_burst, clock())
        self.counters = {"not_allowed": 0, "rate_limited": 0, "new_identity_limited": 0, "bans": 0, "peer_bans": 0,
                         "foreign_sent": 0, "foreign_refused": 0}

    # ---- checks, cheapest first -----------------------------------------------------------------
    def admit_peer(self, peer: str) -> None:
        """Before a request body is read: banned peers and peers over their rate are refused."""
        if not peer:
            return
        with self._lock:
            if peer in self.banned_peers:
                self.counters["not_allowed"] += 1
                raise ProtocolError(RejectCode.NOT_ALLOWED, "peer banned")
            rec = self._peer(peer)
            if not rec.bucket.take(self._clock()):
                rec.rate_limited += 1
                self.counters["rate_limited"] += 1
                raise ProtocolError(RejectCode.RATE_LIMITED, "too many requests from this peer")

    def check_peer(self, peer: str) -> None:
        """Banned peers are refused (NOT_ALLOWED); nothing is charged (adapter serving has its own
        byte budget, swarm/serving.py ServeBudget)."""
        if peer and peer in self.banned_peers:
            with self._lock:
                self.counters["not_allowed"] += 1
            raise ProtocolError(RejectCode.NOT_ALLOWED, "peer banned")

    def peer_has_accepted(self, peer: str) -> bool:
        """True when `peer`'s key (a volunteer's peer id is its key) has accepted batches and no ban."""
        try:
            key = public_key_from_peer_id(peer)
        except ProtocolError:
            return False
        return self.has_accepted(key)

    def has_accepted(self, key: bytes) -> bool:
        """True when `key` has accepted batches and no ban: its word weighs more than a fresh key's
        (coordinator/leasing/taskboard.py retirement)."""
        with self._lock:
            self.banlist.refresh()  # an operator's ban weighs at once, before any request is checked (a resume)
            rec = self._ids.get(key)
            return rec is not None and rec.accepted > 0 and key not in self.banned and key not in self.banlist

    def check_signer(self, key: bytes) -> None:
        """Stateless: banned keys, and keys missing from the allowlist, are refused (NOT_ALLOWED)."""
        with self._lock:
            self.banlist.refresh()
            if self.policy.mode == "allowlist":
                self.allowlist.refresh()
            refused = key in self.banned or key in self.banlist or (
                self.policy.mode == "allowlist" and key not in self.allowlist)
            if refused:
                self.counters["not_allowed"] += 1
                raise ProtocolError(RejectCode.NOT_ALLOWED, "identity banned or not on the allowlist")

    def admit_identity(self, key: bytes, peer: str = "") -> None:
        """After the signature verified: per-identity rate, first-contact rate, hourly quota. A request
        sent by another peer than the key's own is charged to that peer (see the module docstring); a
        refusal of such a copy carries `charge_peer = True` so that ingest books it against the peer."""
        with self._lock:
            now = self._clock()
            rec = self._ids.get(key)
            if rec is None:
                if not self._new_ids.take(now):
                    self.counters["new_identity_limited"] += 1
                    self.counters["rate_limited"] += 1
                    raise ProtocolError(RejectCode.RATE_LIMITED, "too many new identities; retry later")
                rec = self._identity(key)
            else:
                self._ids.move_to_end(key)
            if peer and peer != rec.peer_id:
                sender = self._peer(peer)
                sender.foreign_sent += 1
                self.counters["foreign_sent"] += 1
                if rec.own_peer_seen:
                    sender.foreign_refused += 1
                    self.counters["foreign_refused"] += 1
                    raise _charged_to_peer(RejectCode.NOT_ALLOWED, "sent by another peer than its signer")
                if not sender.bucket.take(now):
                    sender.rate_limited += 1
                    self.counters["rate_limited"] += 1
                    raise _charged_to_peer(RejectCode.RATE_LIMITED, "too many requests from this peer")
            elif not rec.bucket.take(now):
                rec.rate_limited += 1
                self.counters["rate_limited"] += 1
                raise ProtocolError(RejectCode.RATE_LIMITED, "too many requests from this identity")
            quota = self.policy.batches_per_hour
            if quota:
                horizon = self._wall() - HOUR_S
                while rec.accepted_at and rec.accepted_at[0] < horizon:
                    rec.accepted_at.popleft()
                if len(rec.accepted_at) >= quota:
                    rec.rate_limited += 1
                    self.counters["rate_limited"] += 1
                    raise ProtocolError(RejectCode.RATE_LIMITED, f"quota of {quota} batches per hour reached")

    # ---- outcomes ---------------------------------------------------------------------------------
    def record_accepted(self, key: bytes, peer: str = "") -> None:
        with self._lock:
            rec = self._identity(key)
            rec.valid_streak += 1
            rec.accepted += 1
            if peer and peer == rec.peer_id:
                rec.own_peer_seen = True
            if self.policy.batches_per_hour:
                rec.accepted_at.append(self._wall())

    def valid_streak(self, key: bytes) -> int:
        with self._lock:
            rec = self._ids.get(key)
            return rec.valid_streak if rec is not None else 0

    def on_reject(self, code: RejectCode, *, signer: bytes | None, peer: str = "", strike: bool = True) -> bool:
        """Strike whoever is accountable for a rejected request; True when that caused a ban. `strike=False`
        (a first failed audit: quarantine, coordinator/trust/audit_policy.py) only resets the key's track record."""
        code = RejectCode(code)
        with self._lock:
            if signer is not None:
                if code in IDENTITY_SUSPICIONS or (code in IDENTITY_STRIKES and not strike):
                    self._identity(signer).valid_streak = 0
                if code not in IDENTITY_STRIKES or not strike:
                    return False
                rec = self._identity(signer)
                rec.strikes += 1
                rec.valid_streak = 0  # back to "no track record": audited every time
                if rec.strikes >= self.policy.max_strikes and signer not in self.banned:
                    self._ban(signer)
                    self.counters["bans"] += 1
                    return True
                return False
            if peer and code in PEER_STRIKES:
                rec = self._peer(peer)
                rec.strikes += 1
                if rec.strikes >= self.policy.peer_max_strikes and peer not in self.banned_peers:
                    self._ban(peer, self.banned_peers)
                    self.counters["peer_bans"] += 1
                    return True
            return False

    def strikes(self, key: bytes) -> int:
        with self._lock:
            rec = self._ids.get(key)
            return rec.strikes if rec is not None else 0

    def is_banned(self, key: bytes) -> bool:
        with self._lock:
            return key in self.banned or key in self.banlist

    # ---- bookkeeping ------------------------------------------------------------------------------
    def _ban(self, key, table: OrderedDict | None = None) -> None:
        table = self.banned if table is None else table
        table[key] = None
        while len(table) > MAX_BANNED:
            table.popitem(last=False)

    def _identity(self, key: bytes) -> _Identity:
        rec = self._ids.get(key)
        if rec is None:
            p = self.policy
            rec = self._ids[key] = _Identity(TokenBucket(p.identity_rate_per_s, p.identity_burst, self._clock()),
                                             peer_id=peer_id_from_public_key(key))
            while len(self._ids) > MAX_TRACKED:
                self._ids.popitem(last=False)
        else:
            self._ids.move_to_end(key)
        return rec

    def _peer(self, peer: str) -> _Peer:
        rec = self._peers.get(peer)
        if rec is None:
            p = self.policy
            rec = self._peers[peer] = _Peer(TokenBucket(p.peer_rate_per_s, p.peer_burst, self._clock()))
            while len(self._peers) > MAX_TRACKED:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(peer)
        return rec

    def status(self) -> dict:
        """JSON-ready view for trust.json and dashboards (identities by fingerprint)."""
        with self._lock:
            return {
                "mode": self.policy.mode,
                "allowlist_size": len(self.allowlist.keys) + len(self.allowlist.fingerprints),
                "allowlist_error": self.allowlist.error,
                "banlist_size": len(self.banlist.keys) + len(self.banlist.fingerprints),
                "banned": sorted(fingerprint(k) for k in self.banned),
                "banned_peers": sorted(self.banned_peers),
                "counters": dict(self.counters),
                "identities": {fingerprint(k): {"strikes": r.strikes, "valid_streak": r.valid_streak,
                                                "rate_limited": r.rate_limited}
                               for k, r in self._ids.items() if r.strikes or r.valid_streak or r.rate_limited},
                "peers": {p: {"strikes": r.strikes, "rate_limited": r.rate_limited, "foreign_sent": r.foreign_sent,
                              "foreign_refused": r.foreign_refused}
                          for p, r in self._peers.items() if r.strikes or r.rate_limited or r.foreign_sent},
            }

    def state_bytes(self) -> bytes:
        """Bans, strikes and track records (msgpack, no pickle) so a restarted coordinator keeps them."""
        with self._lock:
            state = _State(2, sorted(self.banned), sorted(self.banned_peers),
                           {k.hex(): r.strikes for k, r in self._ids.items() if r.strikes},
                           {k.hex(): [r.accepted, r.valid_streak, int(r.own_peer_seen)]
                            for k, r in self._ids.items() if r.accepted})
        return msgspec.msgpack.encode(state)

    def load_state(self, data: bytes) -> None:
        try:
            state = msgspec.msgpack.decode(data, type=_State)
            if state.version not in (1, 2) or any(len(k) != PUBLIC_KEY_BYTES for k in state.banned):
                raise ValueError("unknown version or bad key")
            strikes = {bytes.fromhex(k): int(v) for k, v in state.strikes.items()}
            records = {bytes.fromhex(k): (int(v[0]), int(v[1]), bool(v[2])) for k, v in state.records.items()
                       if len(v) == 3 and min(v) >= 0}
        except Exception as exc:
            raise ProtocolError(RejectCode.MALFORMED, f"access state: {exc}") from None
        with self._lock:
            for key in state.banned:
                self._ban(key)
            for peer in state.banned_peers:
                self._ban(peer, self.banned_peers)
            for key, n in strikes.items():
                if len(key) == PUBLIC_KEY_BYTES and n > 0 and math.isfinite(n):
                    self._identity(key).strikes = n
            for key, (accepted, streak, own) in records.items():
                if len(key) == PUBLIC_KEY_BYTES:
                    rec = self._identity(key)
                    rec.accepted, rec.valid_streak, rec.own_peer_seen = accepted, streak, own
