"""SyncRound: the synchronous baseline (`asyncrl-coordinator run --sync`), for benchmarks.

Owned by the staleness/benchmark work (issue 5, part B). The coordinator hub (service.py) asks it two
things and nothing else: whom to lease prompts to (`lease`) and when a step may happen (`take`).

Semantics — synchronous on-policy RL spread over volunteers:
- A round belongs to one adapter version v (the learner's current one). Each *live* volunteer gets
  one lease grant per round, and only while it serves version v (its LeaseRequest says which version
  it holds); a volunteer still on v-1 gets nothing until it has loaded v.
- "Live" = asked for a lease within `live_s` (the coordinator passes lease_timeout_s). A volunteer
  that sleeps between batches (duty cycle) stays live; one that died stops being live after `live_s`,
  and only then does the round go on without it.
- The step happens when every live volunteer has delivered its round's batch (at least one has). So
  every step waits for the slowest live volunteer: this is why sync is slower than the default
  asynchronous mode, which steps on whatever `groups_per_step` groups have arrived, whoever sent them
  (docs/staleness.md). Batches from another version (a late one from an earlier round) are dropped
  and counted in `dropped_groups`.
- A volunteer whose round batch was lost (rejected, lease expired) and that asks again is re-granted,
  so one bad batch cannot stall the swarm.
- With `--wait-for-volunteers N` (coordinator/leasing/quorum.py) the LeaseDesk still hands every request to
  `lease`, with want=0 until N volunteers are in: each one that waited is live when the first round
  starts, so that round waits for its batch as well.

Coupling, written down: `take` drains `Ingest.queue` itself and keeps ingest's queued-groups count right
through `Ingest.unqueue_groups` (batches it holds for an unfinished round still count as queued), and reads
the accepted-batch records (`Ingest.accepted_count`, `Ingest.accepted_since`).
"""

from __future__ import annotations

import queue
import threading
import time

from asyncrl.protocol.identity import fingerprint

from .taskboard import LeaseRejected

POLL_S = 0.2


class SyncRound:
    def __init__(self, ingest, board, *, live_s: float, clock=time.monotonic):
        self.ingest = ingest
        self.board = board
        self.live_s = live_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_seen: dict[str, float] = {}
        self.version = -1
        self._granted: dict[str, tuple[bytes, list[str]]] = {}  # fingerprint -> (signer, lease ids)
        self._log_start = 0
        self.rounds = 0
        self.dropped_groups = 0  # off-round groups dropped (they were generated with another version)
        self._pending: list = []  # batches taken off the ingest queue for the current round (learner thread)

    def held(self) -> list:
        """Batches taken off the ingest queue for the current round, not yet trained (a checkpoint keeps them)."""
        return list(self._pending)

    # ---- lease side (P2P handler threads) ----------------------------------------------------
    def lease(self, signer: bytes, client_version: int, current_version: int, want: int) -> list:
        """Lease up to `want` prompts to `signer` if it is due its one grant of this round, else []."""
        fp = fingerprint(signer)
        with self._lock:
            self._last_seen[fp] = self._clock()
            if current_version != self.version:
                self._begin_locked(current_version)
            if client_version != current_version or want <= 0:
                return []
            held = self._granted.get(fp)
            if held is not None and (self._outstanding(held) or self._delivered_locked(fp)):
                return []  # it owes (or already gave) this round's batch
            grants = self.board.lease(signer, want)
            if grants:
                self._granted[fp] = (signer, [g.lease_id for g in grants])
            return grants

    def _begin_locked(self, version: int) -> None:
        self.version = version
        self._granted.clear()
        self._log_start = self.ingest.accepted_count()
        self.rounds += 1

    def _outstanding(self, held: tuple[bytes, list[str]]) -> bool:
        signer, lease_ids = held
        for lid in lease_ids:
            try:
                self.board.peek(lid, signer)
                return True
            except LeaseRejected:
                continue
        return False

    def _delivered_locked(self, fp: str) -> bool:
        return any(b.signer == fp and b.version == self.version for b in self.ingest.accepted_since(self._log_start))

    def live(self) -> set[str]:
        now = self._clock()
        with self._lock:
            return {fp for fp, t in self._last_seen.items() if now - t <= self.live_s}

    # ---- learner side (main thread) ----------------------------------------------------------
    def take(self, version: int, stop, *, poll_s: float = POLL_S) -> list:
        """Block until every live volunteer delivered its batch for `version`; return those batches.

        Returns [] only when `stop` is set; batches taken so far stay pending for the next call."""
        self._drop_off_round(version)
        while not stop.is_set():
            try:
                item = self.ingest.queue.get(timeout=poll_s)
            except queue.Empty:
                item = None
            if item is not None:
                self._pending.append(item)
                self._drop_off_round(version)
            delivered = {b.signer for b in self._pending}
            if delivered and self.live() <= delivered:
                got, self._pending = self._pending, []
                self._unqueue(got)
                return got
        return []

    def _unqueue(self, items: list) -> None:
        # Pending batches still count as queued (the board's books: completed = trained + dropped + queued).
        self.ingest.unqueue_groups(sum(len(b.groups) for b in items))

    def _drop_off_round(self, version: int) -> None:
        """Drop pending batches generated with another version than the round's (late ones)."""
        late = [b for b in self._pending if b.version != version]
        if late:
            self._pending = [b for b in self._pending if b.version == version]
            self._unqueue(late)
            n = sum(len(b.groups) for b in late)
            self.dropped_groups += n
            self.board.mark_dropped(n)
