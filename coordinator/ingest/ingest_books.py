"""Ingest's books, bounded over a run of any length: who sent what, which batch ids were accepted, and the
reward trace the summary reports. Owned by ingest (coordinator/ingest/ingest.py); no network, no torch.

  ClientTable    per-key stats (name, accepted, rejected by code, last version, last seen), at most
                 `max_entries`; when full, the least recently seen key *without* accepted batches is
                 forgotten first (Sybil keys that only asked for work), else the least recently seen one.
  AcceptedRecord what the learner loop logs per accepted batch (scalars only: no tokens, no logprobs);
                 ingest keeps the newest few thousand in a deque, numbered, for the `batch` events.
  RewardTrace    running sums of per-batch mean rewards in at most `buckets` buckets whose width doubles
                 when they fill up: the summary's first/last-10 % reward in O(1) memory.
  SeenIds        accepted batch ids (DUPLICATE_BATCH), at most `max_ids` in memory (oldest forgotten:
                 a very late retry of a forgotten one finds its leases settled and gets UNKNOWN_LEASE,
                 so it is still never trained twice) and persisted *incrementally*: ids accepted since
                 the last write are appended to `<run_dir>/seen_ids.log` (32 bytes each, fsynced) by the
                 trust-state thread, outside the ingest lock; the file is compacted when it holds twice
                 what memory does.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.protocol.atomic import fsync_dir, write_atomic

ID_BYTES = 32


@dataclass
class ClientStats:
    name: str
    fingerprint: str
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    resent: int = 0  # DUPLICATE_BATCH: an accepted batch sent again (its ack was lost) — repeated, not a rejection
    last_version: int = -1
    last_seen: float = 0.0
    canary: str = ""  # the last adapter-identity canary it reported ("v5 ok", "v5 FAILED (...)"); "" = none
    canary_failures: int = 0

    def note_canary(self, report) -> None:
        """Its last canary result (messages.CanaryReport), as the swarm table shows it."""
        self.canary = (f"v{report.version} ok" if report.passed else
                       f"v{report.version} FAILED ({report.diff:.2f}/token; base model {report.base_diff:.2f})")
        self.canary_failures += 0 if report.passed else 1

    @classmethod
    def from_row(cls, row: dict) -> ClientStats:
        """Inverse of `ClientTable.rows` (a checkpoint's meta.json "clients")."""
        return cls(name=row["name"], fingerprint=row["fingerprint"], accepted=row["accepted"],
                   rejected=dict(row["rejected"]), resent=row.get("resent", 0), last_version=row["last_version"],
                   last_seen=row["last_seen"])


class ClientTable:
    """fingerprint -> ClientStats, bounded (see the module docstring). Callers hold ingest's lock."""

    SCAN = 64  # how far from the LRU end to look for a key without accepted batches

    def __init__(self, max_entries: int = 10_000):
        self.max_entries = max_entries
        self._d: OrderedDict[str, ClientStats] = OrderedDict()
        self.forgotten = 0

    def get(self, fp: str) -> ClientStats | None:
        return self._d.get(fp)

    def touch(self, fp: str, name: str = "") -> ClientStats:
        st = self._d.get(fp)
        if st is None:
            st = self._d[fp] = ClientStats(name=name or fp, fingerprint=fp)
            self._evict()
        else:
            self._d.move_to_end(fp)
            if name:
                st.name = name
        return st

    def _evict(self) -> None:
        while len(self._d) > self.max_entries:
            victim = None
            for i, (fp, st) in enumerate(self._d.items()):
                if i >= self.SCAN:
                    break
                if st.accepted == 0:
                    victim = fp
                    break
            if victim is None:
                victim = next(iter(self._d))
            del self._d[victim]
            self.forgotten += 1

    def replace(self, entries: list[ClientStats]) -> None:
        self._d = OrderedDict((st.fingerprint, st) for st in sorted(entries, key=lambda s: s.last_seen))
        self._evict()

    def rows(self) -> list[dict]:
        """Each key's stats as plain dicts, least recently seen first (what a checkpoint keeps)."""
        return [{"key": fp, "name": st.name, "fingerprint": st.fingerprint, "accepted": st.accepted,
                 "rejected": dict(st.rejected), "resent": st.resent, "last_version": st.last_version,
                 "last_seen": st.last_seen} for fp, st in self._d.items()]

    def values(self):
        return self._d.values()

    def items(self):
        return self._d.items()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, fp: str) -> bool:
        return fp in self._d

    def __eq__(self, other) -> bool:
        return dict(self._d) == (dict(other._d) if isinstance(other, ClientTable) else other)


@dataclass(frozen=True)
class AcceptedRecord:
    seq: int
    batch_id: bytes
    client: str
    signer: str  # key fingerprint
    version: int
    reward_mean: float
    groups: int
    prompt_ids: tuple[str, ...]
    received_at: float


class RewardTrace:
    """Per-batch mean rewards as (sum, count) buckets; each bucket covers `width` consecutive batches."""

    def __init__(self, buckets: int = 2048):
        self.max_buckets = buckets - buckets % 2
        self.width = 1
        self.sums: list[float] = []
        self.counts: list[int] = []
        self.n = 0

    def add(self, value: float) -> None:
        if self.counts and self.counts[-1] < self.width:
            self.sums[-1] += value
            self.counts[-1] += 1
        else:
            if len(self.counts) == self.max_buckets:  # merge pairs: half the buckets, twice as wide
                self.sums = [self.sums[i] + self.sums[i + 1] for i in range(0, len(self.sums), 2)]
                self.counts = [self.counts[i] + self.counts[i + 1] for i in range(0, len(self.counts), 2)]
                self.width *= 2
            self.sums.append(value)
            self.counts.append(1)
        self.n += 1

    def mean_of(self, first: bool, fraction: float = 0.1) -> float:
        """Mean over the first (or last) `fraction` of batches, to bucket resolution."""
        if not self.n:
            return 0.0
        want = max(1, int(self.n * fraction))
        order = range(len(self.counts)) if first else range(len(self.counts) - 1, -1, -1)
        total = count = 0
        for i in order:
            total += self.sums[i]
            count += self.counts[i]
            if count >= want:
                break
        return float(total / count)


class SeenIds:
    """Accepted batch ids: bounded in memory, appended to disk incrementally (module docstring)."""

    def __init__(self, max_ids: int = 2_000_000, path: Path | None = None):
        self.max_ids = max_ids
        self.path = Path(path) if path is not None else None
        self._set: set[bytes] = set()
        self._order: deque[bytes] = deque()
        self._unsaved: list[bytes] = []
        self._io = threading.Lock()  # one writer of the file at a time (callers hold ingest's lock for the rest)
        self.forgotten = 0

    def __contains__(self, batch_id: bytes) -> bool:
        return batch_id in self._set

    def __len__(self) -> int:
        return len(self._set)

    def __iter__(self):
        return iter(self._set)

    def add(self, batch_id: bytes) -> None:
        if batch_id in self._set:
            return
        self._set.add(batch_id)
        self._order.append(batch_id)
        self._unsaved.append(batch_id)
        while len(self._order) > self.max_ids:
            self._set.discard(self._order.popleft())
            self.forgotten += 1

    def update(self, ids) -> None:
        for b in ids:
            self.add(b)

    def take_unsaved(self) -> list[bytes]:
        """The ids added since the last call (O(new), under ingest's lock); `append` them outside it."""
        out, self._unsaved = self._unsaved, []
        return out

    def append(self, ids: list[bytes]) -> None:
        """Persist `ids` (from `take_unsaved`): append + fsync; compact the file when it is twice the cap."""
        if self.path is None or not ids:
            return
        with self._io:
            new = not self.path.exists()
            with open(self.path, "ab") as f:
                f.write(b"".join(ids))
                f.flush()
                os.fsync(f.fileno())
            if new:
                fsync_dir(self.path.parent)
            if self.path.stat().st_size > 2 * self.max_ids * ID_BYTES:
                self._compact()

    def _compact(self) -> None:
        data = self.path.read_bytes()
        keep = data[-self.max_ids * ID_BYTES:]
        write_atomic(self.path, keep)

    def load(self) -> int:
        """Merge the ids on disk (a torn tail from a crash mid-append is ignored)."""
        if self.path is None or not self.path.exists():
            return 0
        with self._io:
            data = self.path.read_bytes()
        whole = len(data) - len(data) % ID_BYTES
        before = len(self._set)
        for i in range(max(0, whole - self.max_ids * ID_BYTES), whole, ID_BYTES):
            b = data[i:i + ID_BYTES]
            if b not in self._set:
                self._set.add(b)
                self._order.append(b)
        while len(self._order) > self.max_ids:
            self._set.discard(self._order.popleft())
        return len(self._set) - before
