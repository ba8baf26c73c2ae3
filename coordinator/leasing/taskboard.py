"""TaskBoard: which prompt each volunteer works on, and what became of it.

The coordinator chooses prompts (volunteers cannot cherry-pick easy ones). A lease expires after
`lease_timeout_s`; its prompt then goes back to the front of the queue and is leased to someone else
("re-leased"). A volunteer still working renews its leases (`renew`, carried by a LeaseRequest): each
renewal restarts the timeout, up to `lease_max_s` after the grant, so a slow honest group is not lost
to expiry while a vanished volunteer's prompts still come back after one timeout; a volunteer that
pauses gives its unfinished leases back (`release`: "returned", their prompts first in line).
Poison prompts: a prompt no reward check finishes on (or that breaks the reward function) would otherwise be
re-leased forever, each round costing a volunteer a check timeout. A volunteer that cannot score a leased
group says so (`LeaseRequest.unscorable`: the lease ends now, counted as returned), and ingest notes a group
it could not score itself; once `prompt_max_failures` *distinct* keys reported one record (its content:
text, answer, reward, columns — a dataset's later epochs give it new prompt ids) with no group of it
scored since, it is **retired**: not requeued, never leased again in any epoch, counted, its id kept
among the last `RETIRED_KEPT`. Only explicit reports count, never a silent expiry (a volunteer that
crashed), and distinct keys, so one key cannot retire a prompt alone. A reported record is never leased
again to a key that reported it (it would fail there again), so the next report comes from another key.
Reports are a volunteer's word and keys are free to mint, so the evidence is weighed by the reporters'
standing (`standing(key)`: a key with accepted batches and no ban, asked when the weight is taken): each
proven key weighs 1, all keys without a record together at most 1 (`FRESH_REPORTS_WEIGHT`), and a record
is retired only when the weight reaches `prompt_max_failures` with at least one proven reporter — a crowd
of Sybil keys alone retires nothing. Whatever the reports, at most RETIRE_SHARE of the distinct records the
task has (and at most max(RETIRE_FLOOR, RETIRE_FRACTION x grants)) are retired, so a small
dataset is never emptied; a retirement is kept with its evidence, and `restore` keeps only those whose
evidence still stands within the cap (a checkpoint's retirement without evidence, or from keys banned
since, comes back into the dataset on --resume). A lease call skips at most SOURCE_SKIP_BOUND retired
records in all, however many prompts it asks for.
Invariant, checked by `balanced()` (and written into summary.json): every lease grant is outstanding,
completed (its group was accepted), expired or returned; every expired or returned lease's prompt was
re-leased, still waits in the requeue, or was retired; every completed group was trained, explicitly
dropped (e.g. stale) or still waits in the learner's queue — none vanishes.
Thread-safe: the P2P loop leases and completes, the learner loop only reads counters.
Resumable: `state()` / `restore()` round-trip the outstanding leases, the requeue, the counters and the
prompt source's position (JSON; coordinator/checkpoint.py stores it).

Size: leases, the requeue and retirement sit behind one lock, and the invariant `balanced()` spans all
three; split, a reader could not check that every grant ends in exactly one state.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import secrets
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterator

from asyncrl.protocol.identity import peer_id_from_public_key
from asyncrl.tasks import Prompt


@dataclass
class Lease:
    lease_id: str
    prompt: Prompt
    client: bytes
    expires_at: float
    prompt_token_ids: bytes | None = None  # as granted (LeaseDesk); ingest compares bytes instead of re-encoding
    granted_at: float = 0.0  # renewals never push expires_at past granted_at + lease_max_s
    holds: int = 0  # batches answering it that ingest is verifying now: it does not expire under them


RETIRE_FLOOR, RETIRE_FRACTION = 8, 0.01
"""At most max(RETIRE_FLOOR, RETIRE_FRACTION x lease grants) records are retired: reports come from volunteers,
so keys that call everything unscorable (a broken verifier install, or Sybil keys) can cost at most that
much of the dataset; past it, reports are only counted (`retire_capped`), for the operator to look at."""
RETIRE_SHARE = 0.25
"""...and never more than this share (at least 1) of the task's distinct records: its size when the source knows
it (`records`), else the distinct records handed out so far (a task of 4 records loses at most 1)."""
FRESH_REPORTS_WEIGHT = 1.0
"""What all reports of keys without accepted batches weigh together (each proven key's report weighs 1)."""
REPORTERS_KEPT = 64
"""Reporting keys kept per record (beyond this only proven keys are added: their reports are the weight)."""
DISTINCT_TRACKED = 1 << 20
"""Distinct records counted (by content key) for RETIRE_SHARE; a larger dataset's share is past any cap anyway."""
SOURCE_SKIP_BOUND = 256
"""Retired records one lease call may skip in all before it gives up (granting fewer prompts): a call costs
O(prompts asked + this), never a scan of the dataset."""
RETIRED_KEPT = 64
"""Retired prompt ids kept (the newest) for summary.json; the count has them all."""


REQUEUE_SCAN = 64
"""Requeued prompts a lease call looks through for one its caller has not reported unscorable."""


class LeaseRejected(Exception):
    pass


class TaskBoard:
    def __init__(self, prompts: Iterator[Prompt], *, lease_timeout_s: float, max_leases_per_client: int,
                 lease_max_s: float | None = None, prompt_max_failures: int = 3, clock=time.time, standing=None, records: int = 0):
        self._source = prompts
        self.standing = standing or (lambda key: True)  # key -> proven (accepted batches, no ban); the hub sets it
        self._requeued: deque[Prompt] = deque()
        self._outstanding: dict[str, Lease] = {}
        self._held: Counter[bytes] = Counter()  # client -> outstanding leases (kept in step with _outstanding)
        self._expiry: list[tuple[float, str]] = []  # heap of (expires_at, lease_id); stale entries skipped
        self._lock = threading.Lock()
        self._clock = clock
        self.lease_timeout_s = lease_timeout_s
        self.lease_max_s = lease_max_s if lease_max_s is not None else lease_timeout_s  # None: no renewals
        self.max_leases_per_client = max_leases_per_client
        self.leased = 0          # lease grants (a re-leased prompt counts again)
        self.completed = 0       # groups accepted
        self.expired = 0         # leases that timed out (their prompt was requeued)
        self.dropped = 0         # groups explicitly dropped (e.g. stale) after acceptance
        self.released = 0        # grants of a requeued (expired or returned) prompt to someone else
        self.returned = 0        # leases given back unfinished by their holder (release)
        self.trained = 0         # accepted groups the learner trained on
        self.renewals = 0        # lease renewals granted (not part of the balance: a renewed lease is still one lease)
        self.retired = 0         # leases of reported-unscorable prompts not requeued: poison (module docstring);
        # counts() also gives "retired_records", the distinct records retired (two copies of one record may be out)
        self.prompt_max_failures = prompt_max_failures  # 0: never retire
        self._failures: dict[str, set[str]] = {}  # content_key -> keys (hex) that could not score it
        self.retired_ids: deque[str] = deque(maxlen=RETIRED_KEPT)
        self._retired_content: dict[str, list[str]] = {}  # content_key of every retired record -> its proven reporters
        self._distinct: set[str] = set()  # content keys the source handed out (<= DISTINCT_TRACKED)
        self._distinct_floor = records  # the task's size when the source knows it, or the count a checkpoint had
        self.unretired = 0  # retirements undone by `restore` (their evidence no longer stood)
        self.skipped_retired = 0  # source prompts skipped because their content was retired (not leased)
        self.retire_capped = 0  # retirements refused by the cap (RETIRE_FRACTION): see summary.json
        self._skip: set[str] = set()  # prompt ids settled by a journal replay before the source reached them
        self._seq = itertools.count()

    def lease(self, client: bytes, max_prompts: int) -> list[Lease]:
        with self._lock:
            self._expire_locked()
            n = max(0, min(max_prompts, self.max_leases_per_client - self._held[client]))
            out = []
            skips = [SOURCE_SKIP_BOUND]  # for the whole call
            for _ in range(n):
                prompt = self._requeued_for_locked(client)
                if prompt is not None:
                    self.released += 1
                else:
                    prompt = self._next_from_source_locked(skips)
                    if prompt is None:
                        break
                now = self._clock()
                lease = Lease(f"{next(self._seq)}-{secrets.token_hex(4)}", prompt, client,
                              now + self.lease_timeout_s, granted_at=now)
                self._outstanding[lease.lease_id] = lease
                self._held[client] += 1
                heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
                out.append(lease)
            self.leased += len(out)
            return out

    def _requeued_for_locked(self, client: bytes) -> Prompt | None:
        """The first of the first REQUEUE_SCAN requeued prompts that `client` has not reported unscorable, taken
        off the requeue; None when there is none. A reporter would fail that record again, and a poison record is
        retired only on another key's report, so it waits for someone else (module docstring)."""
        if not self._failures:
            return self._requeued.popleft() if self._requeued else None
        me = client.hex()
        for i, prompt in enumerate(itertools.islice(self._requeued, REQUEUE_SCAN)):
            if me not in self._failures.get(content_key(prompt), ()):
                del self._requeued[i]
                return prompt
        return None

    def _next_from_source_locked(self, skips: list[int]) -> Prompt | None:
        """The source's next prompt that is neither settled by a journal replay nor retired; None once the
        call's skip budget `skips[0]` is spent (a dataset of nothing but poison must not spin here)."""
        while skips[0] > 0:
            prompt = next(self._source)
            key = content_key(prompt)
            if len(self._distinct) < DISTINCT_TRACKED:
                self._distinct.add(key)
            if prompt.prompt_id in self._skip:
                self._skip.discard(prompt.prompt_id)
            elif key in self._retired_content:
                self.skipped_retired += 1
                skips[0] -= 1
            else:
                return prompt
        return None

    def _retire_cap_locked(self) -> int:
        """Records that may be retired at most (module docstring)."""
        distinct = max(len(self._distinct), self._distinct_floor)
        share = max(1, int(RETIRE_SHARE * distinct)) if distinct else 0
        return min(max(RETIRE_FLOOR, int(RETIRE_FRACTION * self.leased)), share)

    def _evidence_locked(self, keys) -> tuple[float, list[str]]:
        """The weight of `keys`' reports (module docstring) and the proven ones among them, standing as of now."""
        proven = sorted(k for k in keys if self.standing(bytes.fromhex(k)))
        fresh = len(keys) - len(proven)
        return len(proven) + min(FRESH_REPORTS_WEIGHT, float(fresh)), proven

    def complete(self, lease_id: str, client: bytes) -> Lease:
        """Mark a lease fulfilled; raises LeaseRejected for unknown, expired or someone else's lease."""
        with self._lock:
            self._expire_locked()
            lease = self._held_locked(lease_id, client)
            self._pop_locked(lease_id)
            self._scored_locked(lease.prompt)
            self.completed += 1
            return lease

    def _held_locked(self, lease_id: str, client: bytes) -> Lease:
        """The outstanding lease `lease_id` if `client` holds it; LeaseRejected otherwise (lock held)."""
        lease = self._outstanding.get(lease_id)
        if lease is None:
            raise LeaseRejected(f"lease {lease_id} is unknown or expired (its prompt was re-leased)")
        if lease.client != client:
            raise LeaseRejected(f"lease {lease_id} belongs to another volunteer")
        return lease

    def complete_all(self, lease_ids, client: bytes, unscored=()) -> list[Lease]:
        """Complete every lease of one batch, or none: raises LeaseRejected (and changes nothing) when any
        of them is unknown, expired or someone else's — so a group whose lease expired mid-batch can
        never leave the others completed but untrained."""
        with self._lock:
            self._expire_locked()
            leases = []
            for lid in lease_ids:
                leases.append(self._held_locked(lid, client))
            if len({l.lease_id for l in leases}) != len(leases):
                raise LeaseRejected("the same lease twice in one batch")
            for lease in leases:
                self._pop_locked(lease.lease_id)
                if lease.lease_id not in unscored:  # `unscored`: groups ingest could not score (note_unscorable)
                    self._scored_locked(lease.prompt)
            self.completed += len(leases)
            return leases

    def _scored_locked(self, prompt: Prompt) -> None:
        if self._failures:
            self._failures.pop(content_key(prompt), None)  # a group of it came back: not poison after all

    def reopen(self, leases: list[Lease]) -> None:
        """Undo `complete_all` (the batch could not be queued after all): the leases are outstanding
        again, unchanged, so the volunteer's retry of the same batch is accepted."""
        with self._lock:
            for lease in leases:
                self._outstanding[lease.lease_id] = lease
                self._held[lease.client] += 1
                heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))  # it still expires when it did
            self.completed -= len(leases)

    def peek(self, lease_id: str, client: bytes) -> Lease:
        """Check a lease without completing it (ingest validates the whole batch first)."""
        with self._lock:
            self._expire_locked()
            return self._held_locked(lease_id, client)

    def renew(self, lease_ids, client: bytes) -> dict[str, float]:
        """Extend the holder's leases: expires_at = now + lease_timeout_s, never beyond granted_at +
        lease_max_s. Returns seconds left per id asked about (0.0: unknown, expired or someone else's —
        the volunteer drops that group instead of sending a batch that would be refused)."""
        with self._lock:
            self._expire_locked()
            now, out = self._clock(), {}
            for lid in lease_ids:
                lease = self._outstanding.get(lid)
                if lease is None or lease.client != client:
                    out[lid] = 0.0
                    continue
                new = min(now + self.lease_timeout_s, lease.granted_at + self.lease_max_s)
                if new > lease.expires_at:
                    lease.expires_at = new
                    heapq.heappush(self._expiry, (new, lid))  # the old entry no longer matches: skipped
                    self.renewals += 1
                out[lid] = max(0.0, lease.expires_at - now)
            return out

    def hold(self, lease_ids, client: bytes) -> list[str]:
        """Ingest is verifying a batch that answers these leases (held by `client`): they do not expire until
        `unhold`, so our own scoring time (a verifier queue, a slow check) never turns a batch that arrived
        in time into UNKNOWN_LEASE. Returns the ids held (unknown or others' leases are skipped)."""
        with self._lock:
            held = self._owned_locked(lease_ids, client)
            for lid in held:
                self._outstanding[lid].holds += 1
            return held

    def unhold(self, lease_ids) -> None:
        """End `hold` (the batch was committed, refused or failed); a lease past its time expires at the next
        expiry pass."""
        with self._lock:
            for lid in lease_ids:
                lease = self._outstanding.get(lid)
                if lease is not None and lease.holds > 0:
                    lease.holds -= 1

    def abandon(self, lease_ids, client: bytes) -> int:
        """The holder's batch for these leases was refused: end them now, as if they had expired (their
        prompts are requeued for someone else). Unknown ids and other clients' leases are ignored."""
        with self._lock:
            gone = self._take_locked(lease_ids, client)
            self._requeued.extend(gone)
            self.expired += len(gone)
            return len(gone)

    def report_unscorable(self, lease_ids, client: bytes) -> int:
        """The holder could not score these leases' groups (its reward check did not finish): end them now
        (counted as returned) and count the report against each prompt; a prompt reported by
        prompt_max_failures distinct keys is retired instead of requeued. Others' and unknown ids are ignored."""
        with self._lock:
            gone = self._take_locked(lease_ids, client)
            for prompt in gone:
                if not self._note_unscorable_locked(prompt, client):
                    self._requeued.append(prompt)
            self.returned += len(gone)
            return len(gone)

    def note_unscorable(self, prompts, client: bytes) -> None:
        """Ingest could not score these (completed, now dropped) groups of `client`'s batch: count it."""
        with self._lock:
            for prompt in prompts:
                self._note_unscorable_locked(prompt, client, settled=True)

    def _note_unscorable_locked(self, prompt: Prompt, client: bytes, settled: bool = False) -> bool:
        """Count `client`'s report on `prompt`; True when that retires it. `settled`: the lease was completed
        (its group dropped at ingest), so the retirement is of the record only (nothing to take off a queue)."""
        key = content_key(prompt)
        if key in self._retired_content:  # another copy of a record retired meanwhile
            if not settled:
                self.retired += 1
            return True
        keys = self._failures.setdefault(key, set())
        if len(keys) < REPORTERS_KEPT or self.standing(client):
            keys.add(client.hex())
        if not self.prompt_max_failures or len(keys) < self.prompt_max_failures:
            return False
        weight, proven = self._evidence_locked(keys)
        if not proven or weight < self.prompt_max_failures:
            return False  # not enough evidence yet: fresh keys alone never retire a record
        if len(self._retired_content) >= self._retire_cap_locked():
            self.retire_capped += 1  # reports beyond the cap: a broken verifier install or Sybil keys, not data
            return False
        del self._failures[key]
        self._retired_content[key] = proven
        self.retired_ids.append(prompt.prompt_id)
        if not settled:
            self.retired += 1
        return True

    def release(self, lease_ids, client: bytes) -> int:
        """The holder gives these leases back unfinished (it paused): requeue their prompts now, first in
        line (they waited already), counted as `returned` rather than expired. Unknown ids and other
        clients' leases are ignored."""
        with self._lock:
            back = self._take_locked(lease_ids, client)
            self._requeued.extendleft(reversed(back))
            self.returned += len(back)
            return len(back)

    def _take_locked(self, lease_ids, client: bytes) -> list:
        """End `client`'s leases among `lease_ids` (others' and unknown ids are ignored); their prompts."""
        return [self._pop_locked(lid).prompt for lid in self._owned_locked(lease_ids, client)]

    def _owned_locked(self, lease_ids, client: bytes) -> list[str]:
        """The ids among `lease_ids` that are outstanding and held by `client` (others' and unknown ones dropped)."""
        return [lid for lid in lease_ids if lid in self._outstanding and self._outstanding[lid].client == client]

    def mark_dropped(self, n: int = 1) -> None:
        with self._lock:
            self.dropped += n

    def mark_trained(self, n: int = 1) -> None:
        with self._lock:
            self.trained += n

    def balanced(self, queued_groups: int) -> bool:
        """The books balance: see the module docstring. `queued_groups`: accepted but not yet trained."""
        c = self.counts()
        return (c["leased"] == c["completed"] + c["expired"] + c["returned"] + c["outstanding"]
                and c["expired"] + c["returned"] == c["released"] + c["requeued_waiting"] + c["retired"]
                and c["completed"] == c["trained"] + c["dropped"] + queued_groups)

    def settle_replayed(self, prompt_id: str) -> None:
        """A group accepted before a crash but after the checkpoint came back from the ingest journal:
        account for it as completed, wherever the restored board thinks its prompt is."""
        with self._lock:
            for lid, lease in self._outstanding.items():
                if lease.prompt.prompt_id == prompt_id:
                    self._pop_locked(lid)
                    self.completed += 1
                    return
            for i, prompt in enumerate(self._requeued):
                if prompt.prompt_id == prompt_id:
                    del self._requeued[i]
                    self.released += 1
                    break
            else:
                self._skip.add(prompt_id)  # leased after the checkpoint: the source must not hand it out again
            self.leased += 1
            self.completed += 1

    def state(self) -> dict:
        """JSON-able snapshot (client keys hex-encoded)."""
        with self._lock:
            source_state = self._source.state() if hasattr(self._source, "state") else None
            return {
                "format": 1,
                "outstanding": [{"lease_id": l.lease_id, "prompt": _prompt_dict(l.prompt), "client": l.client.hex(),
                                 "expires_at": l.expires_at} for l in self._outstanding.values()],
                "requeued": [_prompt_dict(p) for p in self._requeued],
                "counters": {k: getattr(self, k) for k in _COUNTERS},
                "skip": sorted(self._skip),
                "failures": {pid: sorted(keys) for pid, keys in self._failures.items()},
                "retired_ids": list(self.retired_ids),
                "retired_content": sorted(self._retired_content),
                "retired_evidence": {k: v for k, v in sorted(self._retired_content.items())},
                "distinct_records": max(len(self._distinct), self._distinct_floor),
                "seq": next(self._seq),
                "source": source_state,
            }

    def restore(self, state: dict) -> None:
        """Inverse of `state()`. Restored leases get a fresh timeout (and a fresh renewal allowance): the
        volunteers holding them could not deliver or renew while the coordinator was down, and a batch for
        a checkpointed lease must still be accepted."""
        with self._lock:
            if state.get("source") is not None:
                if not hasattr(self._source, "restore"):
                    raise ValueError("the checkpoint holds a task position but this task source is not resumable")
                self._source.restore(state["source"])
            now = self._clock()
            fresh = now + self.lease_timeout_s
            self._outstanding = {d["lease_id"]: Lease(d["lease_id"], Prompt(**d["prompt"]), bytes.fromhex(d["client"]),
                                                      max(float(d["expires_at"]), fresh), granted_at=now)
                                 for d in state["outstanding"]}
            self._held = Counter(l.client for l in self._outstanding.values())
            self._expiry = [(l.expires_at, lid) for lid, l in self._outstanding.items()]
            heapq.heapify(self._expiry)
            self._requeued = deque(Prompt(**d) for d in state["requeued"])
            for k in _COUNTERS:
                setattr(self, k, int(state["counters"].get(k, 0)))
            self._failures = {pid: set(keys) for pid, keys in state.get("failures", {}).items()}
            self.retired_ids = deque(state.get("retired_ids", ()), maxlen=RETIRED_KEPT)
            self._distinct_floor = max(self._distinct_floor, int(state.get("distinct_records", 0)))
            evidence = state.get("retired_evidence", {})  # none in a checkpoint written before evidence was kept
            self._retired_content = {key: list(evidence.get(key, ())) for key in state.get("retired_content", ())}
            self._recheck_retired_locked(weigh=False)  # standing is weighed once the access books are back
            self._skip = set(state.get("skip", ()))
            self._seq = itertools.count(int(state["seq"]))

    def recheck_retired(self) -> int:
        """Weigh every retirement's evidence again with `standing` as it is now (the hub calls it once the access
        books are loaded after --resume); how many records came back into the dataset."""
        with self._lock:
            return self._recheck_retired_locked()

    def _recheck_retired_locked(self, weigh: bool = True) -> int:
        """Keep the retirements whose evidence still stands, within the cap; the rest are leased again (a poison
        record among them is reported again by proven keys). A checkpoint without evidence keeps none.
        `weigh=False`: only the evidence's size counts (`standing` is not known yet)."""
        kept: dict[str, list[str]] = {}
        cap = self._retire_cap_locked()
        for key, reporters in self._retired_content.items():
            weight, proven = self._evidence_locked(reporters) if weigh else (len(reporters), list(reporters))
            if proven and weight >= max(1, self.prompt_max_failures) and len(kept) < cap:
                kept[key] = proven
        back = len(self._retired_content) - len(kept)
        self._retired_content = kept
        self.unretired += back
        return back

    def expire(self) -> int:
        with self._lock:
            return self._expire_locked()

    def _expire_locked(self) -> int:
        """O(expired) per call, not O(outstanding): a heap by expiry (entries of leases already completed or
        abandoned are dropped as they come up)."""
        now = self._clock()
        dead, held = 0, []
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, lid = heapq.heappop(self._expiry)
            lease = self._outstanding.get(lid)
            if lease is None or lease.expires_at != expires_at:
                continue
            if lease.holds:  # its batch is being verified: looked at again on the next pass
                held.append((expires_at, lid))
                continue
            self._requeued.append(self._pop_locked(lid).prompt)
            dead += 1
        for entry in held:
            heapq.heappush(self._expiry, entry)
        if len(self._expiry) > 4 * len(self._outstanding) + 64:  # many settled leases: rebuild, bounded memory
            self._expiry = [(l.expires_at, lid) for lid, l in self._outstanding.items()]
            heapq.heapify(self._expiry)
        self.expired += dead
        return dead

    def _pop_locked(self, lease_id: str) -> Lease:
        lease = self._outstanding.pop(lease_id)
        self._held[lease.client] -= 1
        if self._held[lease.client] <= 0:
            del self._held[lease.client]
        return lease

    def held_by_client(self) -> dict[bytes, int]:
        """Outstanding leases per volunteer key (after expiring what is due): the lease desk's fair share."""
        with self._lock:
            self._expire_locked()
            return dict(self._held)

    def retired_prompt_ids(self) -> list[str]:
        """The newest RETIRED_KEPT retired prompt ids, oldest first."""
        with self._lock:
            return list(self.retired_ids)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"leased": self.leased, "completed": self.completed, "expired": self.expired,
                    "dropped": self.dropped, "outstanding": len(self._outstanding),
                    "requeued_waiting": len(self._requeued), "released": self.released, "trained": self.trained,
                    "renewals": self.renewals, "returned": self.returned, "retired": self.retired,
                    "skipped_retired": self.skipped_retired, "retire_capped": self.retire_capped,
                    "retired_records": len(self._retired_content), "unretired": self.unretired}


_COUNTERS = ("leased", "completed", "expired", "dropped", "released", "trained", "renewals", "returned", "retired",
             "skipped_retired", "retire_capped", "unretired")


def lease_holder(signer: bytes, peer: str) -> bytes:
    """Who holds the leases of a request signed by `signer` and sent by transport peer `peer`: the signer itself
    when it came from the signer's own peer id (a volunteer's peer id is its key) or from no peer (in-process
    callers); else the pair (signer, sender). A copy of a volunteer's lease request sent by someone else
    therefore leases for that sender only — never on her slots, never answerable by her batches — and a batch
    completes only leases granted to requests from the peer that delivers it."""
    if not peer or peer == peer_id_from_public_key(signer):
        return signer
    return signer + hashlib.sha256(peer.encode()).digest()[:8]


def content_key(p: Prompt) -> str:
    """What makes two prompts the same record (a dataset's later epochs give it a new prompt id)."""
    h = hashlib.sha256()
    for part in (p.text, p.answer, p.reward, p.columns):
        data = (part or "").encode()
        h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()[:32]


def _prompt_dict(p: Prompt) -> dict:
    return {"prompt_id": p.prompt_id, "text": p.text, "answer": p.answer, "reward": p.reward, "columns": p.columns}
