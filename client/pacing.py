"""DutyCycle: a volunteer that lends only part of its GPU (`asyncrl-client join --duty-cycle F`).

Owned by the staleness/benchmark work (issue 5, part B); the volunteer hub (client/worker.py) calls
`rest_after(busy_s, stop)` once per batch.

Honest accounting: `busy_s` is the measured wall time of the batch's work (generate + score + seal +
spool; not the upload, which is network time, not GPU time). After it the volunteer rests
busy_s * (1 - F) / F, so over many batches busy / (busy + rest) = F. The rest is an interruptible
wait on the volunteer's stop event (Ctrl-C does not wait it out). Totals land in status.json
(`busy_s`, `rested_s`) so anyone can check the achieved fraction.
"""

from __future__ import annotations

import threading
import time


class DutyCycle:
    def __init__(self, fraction: float, *, clock=time.perf_counter):
        if not 0.0 < fraction <= 1.0:
            raise ValueError("duty cycle must be in (0, 1]")
        self.fraction = fraction
        self._clock = clock
        self.busy_s = 0.0
        self.rested_s = 0.0

    def rest_for(self, busy_s: float) -> float:
        """Seconds to rest after `busy_s` seconds of work."""
        return max(0.0, busy_s) * (1.0 - self.fraction) / self.fraction

    def rest_after(self, busy_s: float, stop: threading.Event) -> float:
        """Account `busy_s`, then rest (interruptibly) for rest_for(busy_s); return the time rested."""
        self.busy_s += max(0.0, busy_s)
        want = self.rest_for(busy_s)
        if want <= 0.0:
            return 0.0
        t0 = self._clock()
        stop.wait(want)
        rested = self._clock() - t0
        self.rested_s += rested
        return rested

    @property
    def achieved(self) -> float:
        """busy / (busy + rest) so far (1.0 before any rest)."""
        total = self.busy_s + self.rested_s
        return self.busy_s / total if total > 0 else 1.0
