"""Pacing the volunteer's lease loop: DutyCycle (lend part of a GPU) and IdleBackoff (no work to lease).

DutyCycle (`asyncrl-client join --duty-cycle F`) is owned by the staleness/benchmark work (issue 5,
part B); the volunteer hub (client/worker.py) calls `rest_after(busy_s, stop)` once per batch.

IdleBackoff (issue 16, docs/scale.md): after an empty lease grant the hub waits `after_empty(retry)`
seconds. The coordinator's `retry_after_s` decides (its waiting line puts volunteers with a record
first and spreads the rest out, coordinator/leasing/leasing.py), jittered by +-20 % so that volunteers told the
same thing do not come back in lock-step. A coordinator that names no retry (0: e.g. `--sync`, whose
rounds open at each new version) gets the hub's own pause, doubled after each further empty grant up to
MAX_IDLE_WAIT_S. Any grant with leases resets it.

Honest accounting: `busy_s` is the measured wall time of the batch's work (generate + score + seal +
spool; not the upload, which is network time, not GPU time). After it the volunteer rests
busy_s * (1 - F) / F, so over many batches busy / (busy + rest) = F. The rest is an interruptible
wait on the volunteer's stop event (Ctrl-C does not wait it out). Totals land in status.json
(`busy_s`, `rested_s`) so anyone can check the achieved fraction.
"""

from __future__ import annotations

import random
import threading
import time

MAX_IDLE_WAIT_S = 30.0
"""Longest the volunteer's own back-off waits between empty grants (when the coordinator names none)."""
MAX_RETRY_WAIT_S = 300.0
"""A coordinator's retry_after_s is honoured up to this (the wire allows an hour; a volunteer stays responsive)."""
JITTER = 0.2


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


class IdleBackoff:
    def __init__(self, pause_s: float, *, rng: random.Random | None = None):
        self.pause_s = pause_s
        self.rng = rng or random.Random()
        self.empty = 0  # consecutive empty grants
        self.requests = 0  # all empty grants so far (status.json: idle lease requests)

    def after_empty(self, retry_after_s: float) -> float:
        """Seconds to wait after an empty grant whose retry_after_s was `retry_after_s`."""
        self.empty += 1
        self.requests += 1
        if retry_after_s > 0:
            base = min(MAX_RETRY_WAIT_S, retry_after_s)
        else:
            base = min(MAX_IDLE_WAIT_S, self.pause_s * 2 ** (self.empty - 1))
        return base * self.rng.uniform(1 - JITTER, 1 + JITTER)

    def reset(self) -> None:
        self.empty = 0
