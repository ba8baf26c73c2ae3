"""HeldAdapters: EXPERIMENT-ONLY `asyncrl-client join --hold-version K`.

Owned by the staleness/benchmark work (issue 5, part B). It exists to measure how the learner copes
with stale rollouts (bench/staleness.py, docs/staleness.md): the volunteer keeps the last K+1 adapter
versions it has seen and generates with the one K behind the newest, so every batch it sends is at
least K versions stale. A real volunteer never wants this: it wastes the coordinator's effort (with a
bounded `max_staleness` such batches are simply dropped).

`select(newest)` is called with each newer verified adapter (from AdapterSync.poll) and answers the
version to serve: newest - K when it is held or can still be fetched from the coordinator (which keeps
its last few versions), else the held version closest below it (or the oldest held). None means "keep
serving what you serve". Versions older than what is served are forgotten (only K+1 stay in memory).
"""

from __future__ import annotations

from collections import OrderedDict


class HeldAdapters:
    def __init__(self, sync, k: int):
        if k < 0:
            raise ValueError("hold-version must be >= 0")
        self.sync = sync  # AdapterSync: .fetch(version, known) for versions we skipped
        self.k = k
        self.held: OrderedDict[int, object] = OrderedDict()  # version -> AdapterVersion, ascending
        self.serving: int | None = None
        self.fetch_failures = 0

    def select(self, newest):
        self.held[newest.version] = newest
        target = max(0, newest.version - self.k)
        if target not in self.held:
            try:
                self.held[target] = self.sync.fetch(target, known=dict(self.held))
            except Exception:  # no longer published, or unreachable: fall back to what we hold
                self.fetch_failures += 1
        self.held = OrderedDict(sorted(self.held.items()))
        below = [v for v in self.held if v <= target]
        chosen = below[-1] if below else next(iter(self.held))
        for v in [v for v in self.held if v < chosen]:
            del self.held[v]
        if chosen == self.serving:
            return None
        self.serving = chosen
        return self.held[chosen]
