"""LeaseDesk: answers a volunteer's sealed LeaseRequest with a LeaseGrant — which prompts, how many, and
when an idle volunteer should ask again.

Beside the TaskBoard (which owns the prompts and their lease books), the desk owns the *policy* of
granting: who may ask (access control: banned keys refused before the signature check, per-key rate
and quota after it; the version gate of coordinator/leasing/handshake.py, UNSUPPORTED_VERSION with what to upgrade,
for volunteers that skipped the handshake), and how much may be in flight. Back-pressure invariant: groups queued for the
learner + groups leased and not yet returned never exceed `max_inflight_groups`, so volunteers cannot
race ahead into work that will be stale when it arrives (docs/decisions.md). Under `--sync` the
SyncRound hands out one grant per live volunteer per version instead. Until `--wait-for-volunteers N`
distinct keys have asked (coordinator/leasing/quorum.py) every grant is empty (retry_after_s = idle_retry_s);
under `--sync` the request still reaches the SyncRound, so a volunteer that waited is live in the first round.

Fair share (`FairShare`, docs/scale.md), so that hundreds of volunteers share the in-flight room:
  * *proven* volunteers (an accepted batch since their last strike: `AccessControl.valid_streak`) split
    all of it: each may hold at most ceil(max_inflight / proven volunteers active) groups, so one fast
    volunteer cannot take every lease;
  * keys without that record may hold `new_key_share` of it *together* (each an equal part) while any
    proven volunteer is active — a crowd of fresh keys that lease and never deliver can pin at most
    that share until their leases expire; with nobody proven yet (a run's start) they share all of it;
  * "active" = asked within `active_window_s`.
An empty grant carries `retry_after_s`: volunteers that found no room wait in a line (proven first,
then by when they started waiting: a proven volunteer joins behind the proven waiters only, however many
fresh keys wait, so a Sybil crowd cannot push her to the back); the one at place p is told `idle_retry_s * (1 + p)`, at most
`max_idle_retry_s` (stretched so that the whole line asks at most `max_idle_polls_per_s` times a second).
The front of the line asks again soon and gets the next free room; the back costs almost nothing.

Work sized to the machine (client/lease_sizing.py): every grant carries what a prompt must be back
within — the lease's life with renewals (`lease_max_s`, or `lease_timeout_s` without renewals),
`max_staleness`, and the recent seconds per published version (`VersionClock`) — so a volunteer can
size its next request (`messages.lease_budget_s`, one formula for both sides). A request that reports
its measured `seconds_per_prompt` is cut to what fits LEASE_SAFETY of that budget, and refused TOO_SLOW,
with the numbers, when even one prompt cannot make it: its work would only expire or go stale.

Bound to the sender, once: a request is answered for `lease_holder(signer, peer)` (coordinator/leasing/taskboard.py) —
the signer when its own peer id sent it, else the (signer, sender) pair — so a copy of a volunteer's request
sent by anyone else never puts leases on her key, renews, releases or reports hers, and her batches never
answer its leases. Each request's (signer, nonce) is accepted once (NONCE_REUSED, charged to the sending
peer), and the guard is written to lease_replay.bin with the trust state, so a copy replayed after a restart
is refused too (a copy older than the timestamp window is EXPIRED by the envelope).

Renewals ride on the same request (`LeaseRequest.renew`, TaskBoard.renew): they are answered before any
grant, and a request for 0 prompts only renews (it never joins the idle line). So do returns
(`LeaseRequest.release`, TaskBoard.release): a pausing volunteer's unfinished leases go back to the
front of the queue at once.

No network here: `handle(request_bytes, peer)` takes the bytes a P2P handler read and returns the
bytes to answer, so tests drive it in-process with sealed envelopes (tests/coordinator/leasing/test_leasing.py).
Unattributable garbage (no valid signature) is charged to the transport peer.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from asyncrl.protocol import envelope, handshake, messages
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.tasks.sources import encode_prompt

from .taskboard import lease_holder

MAX_LEASE_REQUEST_BYTES = 64 * 1024
REPLAY_ENTRIES = 200_000
"""Lease-request nonces remembered (within the timestamp window); beyond, the oldest become an EXPIRED floor."""
VERSION_WINDOW = 8
"""The publish interval that sizes leases is averaged over this many recent publishes."""
COUNT_EVERY_S = 1.0
"""The active and waiting volunteers are re-counted at most this often (O(volunteers) each time)."""


@dataclass(frozen=True)
class LeasePolicy:
    run_id: str
    group_size: int
    prompts_per_lease: int
    max_inflight_groups: int
    window_s: float
    new_key_share: float = 0.25
    active_window_s: float = 60.0
    idle_retry_s: float = 2.0
    max_idle_retry_s: float = 30.0
    max_idle_polls_per_s: float = 20.0
    lease_life_s: float = 0.0  # how long a lease can live, renewals included; 0 = not sized (desk-only tests)
    max_staleness: int | None = None
    max_batch_bytes: int = 0  # told to volunteers in every grant, so they never build a batch we refuse

    @classmethod
    def from_config(cls, cfg) -> "LeasePolicy":
        return cls(run_id=cfg.run_id, group_size=cfg.group_size, prompts_per_lease=cfg.prompts_per_lease,
                   max_inflight_groups=cfg.inflight_groups, window_s=cfg.timestamp_window_s,
                   new_key_share=cfg.new_key_share, active_window_s=cfg.lease_timeout_s,
                   idle_retry_s=cfg.idle_retry_s, max_idle_retry_s=cfg.max_idle_retry_s,
                   lease_life_s=cfg.lease_max_s or cfg.lease_timeout_s, max_staleness=cfg.max_staleness,
                   max_batch_bytes=cfg.max_batch_bytes)


class VersionClock:
    """Seconds per published version over the last VERSION_WINDOW publishes (0 until three were seen):
    the staleness half of a lease's time budget (messages.lease_budget_s). Thread-safe."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._times: deque[float] = deque(maxlen=VERSION_WINDOW)

    def published(self) -> None:
        with self._lock:
            self._times.append(self._clock())

    def interval_s(self) -> float:
        with self._lock:
            if len(self._times) < 3:
                return 0.0
            return (self._times[-1] - self._times[0]) / (len(self._times) - 1)


class FairShare:
    """Per-volunteer caps on in-flight groups and the waiting line of idle volunteers (module docstring).

    `allowance(key, proven, held, room)` = how many groups `key` may be granted now; `idle(key, proven)`
    = seconds it should wait after an empty grant; `granted(key)` takes it out of the line. Counts of
    active volunteers and places in the line are refreshed at most every COUNT_EVERY_S, so a request
    costs O(1) however many volunteers there are. Thread-safe."""

    def __init__(self, policy: LeasePolicy, *, proven: Callable[[bytes], bool], clock=time.monotonic):
        self.policy = policy
        self.proven = proven
        self._clock = clock
        self._lock = threading.Lock()
        self._active: OrderedDict[bytes, float] = OrderedDict()  # key -> last request (oldest first)
        self._waiting: OrderedDict[bytes, float] = OrderedDict()  # key -> last empty grant (first waiter first)
        self._waiting_proven: set[bytes] = set()  # the proven keys among them (the front of the line)
        self._counted_at = -math.inf
        self.active_proven = self.active_new = 0
        self._places: dict[bytes, int] = {}
        self.counters = {"granted": 0, "empty": 0}

    def seen(self, key: bytes) -> None:
        with self._lock:
            now = self._clock()
            self._active[key] = now
            self._active.move_to_end(key)
            self._recount_locked(now)

    def allowance(self, key: bytes, *, proven: bool, held: dict[bytes, int], room: int) -> int:
        """Groups `key` may be granted now: its fair share minus what it holds, within `room`."""
        p = self.policy
        m = p.max_inflight_groups
        if room <= 0:
            return 0
        if proven:
            cap = math.ceil(m / max(1, self.active_proven))
            return max(0, min(room, cap - held.get(key, 0)))
        pool = m if self.active_proven == 0 else max(1, math.floor(p.new_key_share * m))
        cap = max(1, pool // max(1, self.active_new))
        held_new = sum(n for k, n in held.items() if k != key and not self.proven(k)) + held.get(key, 0)
        return max(0, min(room, cap - held.get(key, 0), pool - held_new))

    def granted(self, key: bytes) -> None:
        with self._lock:
            self.counters["granted"] += 1
            self._waiting.pop(key, None)
            self._waiting_proven.discard(key)

    def idle(self, key: bytes, *, proven: bool) -> float:
        """An empty grant for `key`: put it in the line; how long it should wait before asking again."""
        p = self.policy
        with self._lock:
            now = self._clock()
            self.counters["empty"] += 1
            if key not in self._waiting:  # proven keys join behind the proven waiters only, never behind fresh ones
                self._waiting[key] = now
                if proven:
                    self._waiting_proven.add(key)
                    self._places[key] = len(self._waiting_proven) - 1
                else:
                    self._places[key] = len(self._waiting) - 1 + max(0, self.active_proven - len(self._waiting_proven))
            else:
                self._waiting[key] = now  # stays at its place: order is by when it started waiting
            place = self._places.get(key, len(self._waiting) - 1)
            cap = max(p.max_idle_retry_s, len(self._waiting) / p.max_idle_polls_per_s)
            return round(min(cap, p.idle_retry_s * (1 + place)), 3)

    def _recount_locked(self, now: float) -> None:
        if now - self._counted_at < COUNT_EVERY_S:
            return
        self._counted_at = now
        p = self.policy
        while self._active and now - next(iter(self._active.values())) > p.active_window_s:
            self._active.popitem(last=False)
        # a waiter that did not come back within its longest possible wait has gone away
        horizon = max(p.max_idle_retry_s, len(self._waiting) / p.max_idle_polls_per_s) * 2 + COUNT_EVERY_S
        for key in [k for k, t in self._waiting.items() if now - t > horizon]:
            del self._waiting[key]
        proven = {k for k in self._active if self.proven(k)}
        self.active_proven, self.active_new = len(proven), len(self._active) - len(proven)
        self._waiting_proven = {k for k in self._waiting if k in proven}
        line = [k for k in self._waiting if k in proven] + [k for k in self._waiting if k not in proven]
        self._places = {k: i for i, k in enumerate(line)}

    def status(self) -> dict:
        with self._lock:
            return {"active_proven": self.active_proven, "active_new": self.active_new,
                    "waiting": len(self._waiting), **self.counters}


class LeaseDesk:
    def __init__(self, policy: LeasePolicy, *, audience: bytes, board, ingest, access, tokenizer,
                 current_version: Callable[[], int], sync_round=None, quorum=None, clock=time.monotonic, gate=None,
                 on_reward_error: Callable[[str, str, int], None] | None = None):
        self.policy = policy
        self.audience = audience  # the coordinator's public key: requests sealed for anyone else are refused
        self.board, self.ingest, self.access, self.sync_round = board, ingest, access, sync_round
        self.quorum = quorum  # --wait-for-volunteers (coordinator/leasing/quorum.py); None = never wait
        self.tokenizer = tokenizer
        self.current_version = current_version
        self.fair = FairShare(policy, proven=self._proven, clock=clock)
        self.versions = VersionClock(clock)  # the hub calls versions.published() after each publish
        self.on_reward_error = on_reward_error  # (client name, what its reward raised, leases given back)
        self.gate = gate  # coordinator.leasing.handshake.GatePolicy: the version gate, also for clients that skipped it
        self.replay = envelope.ReplayGuard(window_s=policy.window_s, max_entries=REPLAY_ENTRIES)
        self._replay_lock = threading.Lock()

    def _proven(self, key: bytes) -> bool:
        return self.access.valid_streak(key) > 0

    def handle(self, request: bytes, peer: str = "") -> bytes:
        """Sealed LeaseRequest bytes -> encoded LeaseGrant; raises ProtocolError with a stable code."""
        try:
            return self._grant(request, peer)
        except ProtocolError as exc:  # unattributable garbage strikes the transport peer (coordinator/trust/access.py)
            self.access.on_reject(exc.code, signer=None, peer=peer)
            raise

    def room(self) -> int:
        """Groups that may still be leased before the in-flight bound is reached."""
        return self.policy.max_inflight_groups - self.ingest.queued() - self.board.counts()["outstanding"]

    def _grant(self, request: bytes, peer: str = "") -> bytes:
        p = self.policy
        if len(request) > envelope.HEADER_BYTES and request[:4] == envelope.MAGIC:
            self.access.check_signer(bytes(request[4:36]))  # banned / not allowed: before the signature check
        opened = envelope.open_envelope(request, max_bytes=MAX_LEASE_REQUEST_BYTES, expected_kind="lease_request",
                                        expected_audience=self.audience, window_s=p.window_s)
        self.access.admit_identity(opened.signer, peer)  # per-key rate (a copy from another peer: that peer's), quota
        with self._replay_lock:  # each request acts once, also across a restart (state_bytes: lease_replay.bin)
            self.replay.check_and_remember(opened.signer, opened.nonce, opened.timestamp)
        holder = lease_holder(opened.signer, peer)  # a copy sent by another peer leases for that peer only
        try:
            req = messages.decode(opened.payload, messages.LeaseRequest, max_bytes=MAX_LEASE_REQUEST_BYTES)
        except ProtocolError as exc:
            if exc.code is RejectCode.UNSUPPORTED_VERSION:  # an older (or newer) volunteer: say what to upgrade
                raise ProtocolError(exc.code, f"{exc.detail}; {handshake.upgrade_hint('client', handshake.package_version())}"
                                    " (or, if the volunteer is the newer one, ask the operator to upgrade)") from None
            raise
        if self.gate is not None:
            refusal = self.gate.refusal(protocol=envelope.PROTOCOL_VERSION, schema=req.schema,
                                        client_version=req.client_version)
            if refusal is not None:
                raise ProtocolError(*refusal)
        if req.run_id != p.run_id:
            raise ProtocolError(RejectCode.WRONG_RUN, f"this coordinator runs {p.run_id!r}")
        version = self.current_version()
        if req.release:  # a pausing volunteer's unfinished leases (client/polite.py): someone else gets them now
            self.board.release(req.release, holder)
        if req.unscorable:  # groups it could not score: ended now, counted against the prompt (poison)
            self.board.report_unscorable(req.unscorable, holder)
        if req.reward_error and self.on_reward_error is not None:  # its reward function raised: tell the operator
            self.on_reward_error(req.client_name, req.reward_error, len(req.release) + len(req.unscorable))
        renewed = tuple(messages.LeaseRenewal(lid, left)
                        for lid, left in self.board.renew(req.renew, holder).items()) if req.renew else ()
        interval = self.versions.interval_s()
        budget = messages.lease_budget_s(p.lease_life_s, p.max_staleness, interval)
        sizing = dict(lease_life_s=p.lease_life_s, version_interval_s=interval,
                      max_staleness=-1 if p.max_staleness is None else p.max_staleness)
        if req.seconds_per_prompt > budget:  # its own measurement says it cannot make it: tell it, lease nothing
            raise ProtocolError(RejectCode.TOO_SLOW, (
                f"this volunteer needs ~{req.seconds_per_prompt:.0f} s per prompt (its measurement); this run needs a "
                f"prompt back within {budget:.0f} s (lease life {p.lease_life_s:.0f} s, max_staleness "
                f"{sizing['max_staleness']} at ~{interval:.0f} s per version), so its work would be dropped. "
                "A faster engine or GPU helps; this machine cannot join this run."))
        want = min(req.max_prompts, p.prompts_per_lease)
        if want > 0 and req.seconds_per_prompt > 0 and math.isfinite(budget):  # backstop: one that asks too much
            want = min(want, max(1, int(messages.LEASE_SAFETY * budget / req.seconds_per_prompt)))
        retry_after = 0.0
        renewal_only = want <= 0  # a renewal only: no grant, no place in the idle line, no quorum vote
        waiting = (not renewal_only and self.quorum is not None
                   and not self.quorum.admit(opened.signer, req.client_name))
        if waiting:  # still short of --wait-for-volunteers: an empty grant for everyone; ask again soon
            want, retry_after = 0, p.idle_retry_s
        if renewal_only:
            grants = []
        elif self.sync_round is not None:  # one grant per live volunteer per version, no back-pressure needed
            grants = self.sync_round.lease(holder, req.adapter_version, version, want)
        elif waiting:
            grants = []  # no place in the fair-share line yet: nobody is leased anything before the quorum
        else:
            key = holder
            self.fair.seen(key)
            proven = self._proven(key)
            allowed = self.fair.allowance(key, proven=proven, held=self.board.held_by_client(), room=self.room())
            grants = self.board.lease(key, max(0, min(want, allowed)))
            if grants:
                self.fair.granted(key)
            else:
                retry_after = self.fair.idle(key, proven=proven)
        sampling = self.ingest.sampling  # ingest refuses batches claiming anything else
        for g in grants:  # kept on the lease: ingest compares the batch's prompt tokens to these bytes
            g.prompt_token_ids = int32_bytes(encode_prompt(self.tokenizer, g.prompt.text))
        leases = tuple(messages.TaskLease(
            lease_id=g.lease_id, prompt_id=g.prompt.prompt_id, prompt=g.prompt.text,
            prompt_token_ids=g.prompt_token_ids, answer=g.prompt.answer,
            reward=g.prompt.reward, group_size=p.group_size, sampling=sampling, expires_at=g.expires_at,
            columns=g.prompt.columns)
            for g in grants)
        self.ingest.note_client(opened.signer, req.client_name)
        if req.canary is not None:  # the volunteer's adapter-identity check: health, never a strike (models/canary.py)
            self.ingest.note_canary(opened.signer, req.canary)
        return messages.encode(messages.LeaseGrant(run_id=p.run_id, leases=leases, current_version=version,
                                                   retry_after_s=retry_after, renewed=renewed,
                                                   max_batch_bytes=p.max_batch_bytes, **sizing))


    def state_bytes(self) -> bytes:
        """The lease-request replay guard (msgpack, no pickle; coordinator/trust/trust_state.py writes it)."""
        with self._replay_lock:
            snapshot = self.replay.snapshot()
        return envelope.ReplayGuard.encode_snapshot(snapshot)

    def load_state(self, data: bytes) -> None:
        """Merge a `state_bytes()` snapshot (ProtocolError MALFORMED when it is not one)."""
        guard = envelope.ReplayGuard.from_bytes(data)
        with self._replay_lock:
            self.replay.merge(guard)


def int32_bytes(ids) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()
