"""CapacityMeter: does the swarm keep the learner busy, and if not, how many more volunteers would?

The capacity rule of ECHO-2 (rollout throughput needed = samples per step / learner step time, adjusted for
staleness drops), measured here rather than assumed:

  step_s          the learner's compute time per step (smoothed: EWMA_WEIGHT)
  wait_s          the time the learner waited for data before each step (ingest.take); idle fraction =
                  wait / (wait + step), smoothed the same way
  rollouts/s      each volunteer's accepted rollouts over the last WINDOW_S seconds, or since its first accepted
                  batch (which starts the clock and is not counted) when that is sooner — from the accepted-batch
                  log, so a slow volunteer shows as slow whatever its lease size
  stale share     groups dropped as too stale / groups the learner was handed, smoothed
  needed          samples_per_step / step_s                 (rollouts/s that would keep the learner busy)
  effective       sum of volunteer rates x (1 - stale share)
  more_needed     ceil((needed - effective) / (mean volunteer rate x (1 - stale share))): volunteers of the
                  kinds seen so far to add; 0 when the swarm already keeps up

`snapshot()` is what /api/status (`capacity`), the dashboard card and `status` show. The learner thread
feeds `learner_step`, the same thread `accepted` (from ingest's accepted-batch log).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

EWMA_WEIGHT = 0.2  # weight of the newest step in the smoothed step time, wait and stale share
WINDOW_S = 120.0   # volunteer rates: rollouts accepted in this many seconds (or since the first, if sooner)
BUSY_IDLE_FRACTION = 0.1  # the learner counts as kept busy while it waits at most this share of the time


class CapacityMeter:
    def __init__(self, *, samples_per_step: int, group_size: int, clock=time.monotonic):
        self.samples_per_step = samples_per_step
        self.group_size = group_size
        self._clock = clock
        self._lock = threading.Lock()
        self.step_s = 0.0
        self.wait_s = 0.0
        self.stale_share = 0.0
        self.steps = 0
        self._accepted: deque[tuple[float, str, int]] = deque()  # (time, volunteer, rollouts)
        self._first_seen: dict[str, float] = {}

    def learner_step(self, *, wait_s: float, step_s: float, groups: int, stale_dropped: int) -> None:
        """One learner round: how long it waited for data, how long the step took, what went stale."""
        stale = stale_dropped / groups if groups else 0.0
        with self._lock:
            if not self.steps:
                self.step_s, self.wait_s, self.stale_share = step_s, wait_s, stale
            else:
                w = EWMA_WEIGHT
                self.step_s = w * step_s + (1 - w) * self.step_s
                self.wait_s = w * wait_s + (1 - w) * self.wait_s
                self.stale_share = w * stale + (1 - w) * self.stale_share
            self.steps += 1

    def accepted(self, volunteer: str, groups: int) -> None:
        now = self._clock()
        with self._lock:
            self._accepted.append((now, volunteer, groups * self.group_size))
            self._first_seen.setdefault(volunteer, now)
            while self._accepted and self._accepted[0][0] < now - WINDOW_S:
                self._accepted.popleft()

    def rates(self) -> dict[str, float]:
        """Rollouts/s per volunteer over the window (from its first accepted batch, if that is sooner; a volunteer
        with one accepted batch so far has no rate yet)."""
        now = self._clock()
        totals: dict[str, int] = {}
        with self._lock:
            first = dict(self._first_seen)
            for t, name, n in self._accepted:
                if t >= now - WINDOW_S and t > first[name]:  # the first batch starts the clock, not the count
                    totals[name] = totals.get(name, 0) + n
        return {name: n / max(1e-9, min(WINDOW_S, now - first[name])) for name, n in totals.items()
                if now - first[name] > 0}

    def snapshot(self) -> dict:
        rates = self.rates()
        with self._lock:
            step_s, wait_s, stale, steps = self.step_s, self.wait_s, self.stale_share, self.steps
        idle = wait_s / (wait_s + step_s) if steps and wait_s + step_s > 0 else None
        needed = self.samples_per_step / step_s if steps and step_s > 0 else None
        effective = sum(rates.values()) * (1 - stale)
        more = None
        if needed is not None and rates:
            per = (sum(rates.values()) / len(rates)) * (1 - stale)
            more = 0 if effective >= needed else (math.ceil((needed - effective) / per) if per > 0 else None)
        return {"learner_step_s": round(step_s, 4) if steps else None,
                "learner_wait_s": round(wait_s, 4) if steps else None,
                "learner_idle_fraction": None if idle is None else round(idle, 4),
                "keeps_learner_busy": None if idle is None else idle <= BUSY_IDLE_FRACTION,
                "stale_share": round(stale, 4), "rollouts_needed_per_s": None if needed is None else round(needed, 3),
                "swarm_rollouts_per_s": round(effective, 3),
                "volunteer_rollouts_per_s": {k: round(v, 3) for k, v in sorted(rates.items())},
                "more_volunteers_needed": more}


def capacity_line(cap: dict) -> str:
    """One line for `status` and the coordinator's console."""
    if cap.get("learner_idle_fraction") is None:
        return "capacity: no learner step yet"
    busy = "keeps the learner busy" if cap["keeps_learner_busy"] else "does NOT keep the learner busy"
    more = cap.get("more_volunteers_needed")
    tail = "" if not more else f"; ~{more} more volunteer{'s' if more != 1 else ''} of the kinds seen would"
    return (f"capacity: the swarm {busy} (learner idle {100 * cap['learner_idle_fraction']:.0f} %, step "
            f"{cap['learner_step_s']:.2f} s); needs {cap['rollouts_needed_per_s']:.1f} rollouts/s, delivers "
            f"{cap['swarm_rollouts_per_s']:.1f} after {100 * cap['stale_share']:.0f} % stale drops{tail}")
