"""TaskBoard: which prompt each volunteer works on, and what became of it.

The coordinator chooses prompts (volunteers cannot cherry-pick easy ones). A lease expires after
`lease_timeout_s`; its prompt then goes back to the front of the queue and is leased to someone else
("re-leased"). Invariant, checked by `counts()`: every prompt ever leased is exactly one of
outstanding, completed (its group was accepted), requeued-and-waiting, or dropped — none vanishes.
Thread-safe: the P2P loop leases and completes, the learner loop only reads counters.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from asyncrl.tasks import Prompt


@dataclass
class Lease:
    lease_id: str
    prompt: Prompt
    client: bytes
    expires_at: float


class LeaseRejected(Exception):
    pass


class TaskBoard:
    def __init__(self, prompts: Iterator[Prompt], *, lease_timeout_s: float, max_leases_per_client: int,
                 clock=time.time):
        self._source = prompts
        self._requeued: deque[Prompt] = deque()
        self._outstanding: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self.lease_timeout_s = lease_timeout_s
        self.max_leases_per_client = max_leases_per_client
        self.leased = 0          # lease grants (a re-leased prompt counts again)
        self.completed = 0       # groups accepted
        self.expired = 0         # leases that timed out (their prompt was requeued)
        self.dropped = 0         # groups explicitly dropped (e.g. stale) after acceptance
        self._seq = itertools.count()

    def lease(self, client: bytes, max_prompts: int) -> list[Lease]:
        with self._lock:
            self._expire_locked()
            held = sum(1 for l in self._outstanding.values() if l.client == client)
            n = max(0, min(max_prompts, self.max_leases_per_client - held))
            out = []
            for _ in range(n):
                prompt = self._requeued.popleft() if self._requeued else next(self._source)
                lease = Lease(f"{next(self._seq)}-{secrets.token_hex(4)}", prompt, client,
                              self._clock() + self.lease_timeout_s)
                self._outstanding[lease.lease_id] = lease
                out.append(lease)
            self.leased += len(out)
            return out

    def complete(self, lease_id: str, client: bytes) -> Lease:
        """Mark a lease fulfilled; raises LeaseRejected for unknown, expired or someone else's lease."""
        with self._lock:
            self._expire_locked()
            lease = self._outstanding.get(lease_id)
            if lease is None:
                raise LeaseRejected(f"lease {lease_id} is unknown or expired (its prompt was re-leased)")
            if lease.client != client:
                raise LeaseRejected(f"lease {lease_id} belongs to another volunteer")
            del self._outstanding[lease_id]
            self.completed += 1
            return lease

    def peek(self, lease_id: str, client: bytes) -> Lease:
        """Check a lease without completing it (ingest validates the whole batch first)."""
        with self._lock:
            self._expire_locked()
            lease = self._outstanding.get(lease_id)
            if lease is None:
                raise LeaseRejected(f"lease {lease_id} is unknown or expired (its prompt was re-leased)")
            if lease.client != client:
                raise LeaseRejected(f"lease {lease_id} belongs to another volunteer")
            return lease

    def mark_dropped(self, n: int = 1) -> None:
        with self._lock:
            self.dropped += n

    def expire(self) -> int:
        with self._lock:
            return self._expire_locked()

    def _expire_locked(self) -> int:
        now = self._clock()
        dead = [lid for lid, l in self._outstanding.items() if l.expires_at <= now]
        for lid in dead:
            self._requeued.append(self._outstanding.pop(lid).prompt)
        self.expired += len(dead)
        return len(dead)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"leased": self.leased, "completed": self.completed, "expired": self.expired,
                    "dropped": self.dropped, "outstanding": len(self._outstanding),
                    "requeued_waiting": len(self._requeued)}
