"""Pacing the volunteer's loops: DutyCycle (lend part of a GPU), IdleBackoff (no work to lease) and
ReconnectBackoff (the coordinator did not answer).

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

ReconnectBackoff (docs/checkpoints.md, "While it restarts"): after a failed call to the coordinator the
hub's lease loop and its uploader each wait `after_failure(exc)` seconds, by what the failure says:

  unreachable  no answer (down, restarting, network): 1, 2, 4 ... MAX_BACKOFF_S seconds.
  starting     its node answered but serves no such stream yet (swarm/transport.py NotServed: p2pd's
               "protocols not supported"). A coordinator listens before its handlers are registered (it
               loads the model after its DHT forks), so this is a coordinator coming up: retry soon,
               STARTING_FIRST_S doubling up to STARTING_MAX_S, and the unreachable back-off starts over.
               After STARTING_GRACE_S of such waits since the last answer the peer is treated as
               unreachable (a coordinator of another run id never serves this run's streams).

Both are jittered by +-JITTER so that the volunteers of one coordinator, which all lost it at the same
moment, do not come back in lock-step. An answered call resets both (`reset`).
"""

from __future__ import annotations

import random
import threading
import time

from asyncrl.swarm.transport import NotServed

MAX_IDLE_WAIT_S = 30.0
"""Longest the volunteer's own back-off waits between empty grants (when the coordinator names none)."""
MAX_RETRY_WAIT_S = 300.0
"""A coordinator's retry_after_s is honoured up to this (the wire allows an hour; a volunteer stays responsive)."""
JITTER = 0.2
MAX_BACKOFF_S = 30.0
"""Longest wait between tries to reach a coordinator that does not answer."""
STARTING_FIRST_S, STARTING_MAX_S = 0.5, 4.0
"""Waits after "the coordinator is up but serves no such stream yet" (ReconnectBackoff's starting class)."""
STARTING_GRACE_S = 600.0
"""That long of starting-class waits in a row, and the peer is treated as unreachable instead."""


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


class ReconnectBackoff:
    """Seconds to wait after a failed call to the coordinator (see "ReconnectBackoff" above). One per thread
    that calls it (the lease loop, the uploader)."""

    def __init__(self, *, rng: random.Random | None = None):
        self.rng = rng or random.Random()
        self.unreachable = 0  # consecutive failures of the unreachable class
        self.starting = 0  # consecutive failures of the starting class
        self.starting_waited = 0.0  # what those asked to wait, in all
        self.last_class = ""  # "unreachable" | "starting": the class of the last failure (messages, tests)

    def after_failure(self, exc: BaseException) -> float:
        if isinstance(exc, NotServed) and self.starting_waited < STARTING_GRACE_S:
            self.starting += 1
            self.unreachable = 0  # it answered: a later outage starts from the shortest wait again
            base = min(STARTING_MAX_S, STARTING_FIRST_S * 2 ** (self.starting - 1))
            self.last_class = "starting"
        else:
            self.unreachable += 1
            base = min(MAX_BACKOFF_S, 2.0 ** (self.unreachable - 1))
            self.last_class = "unreachable"
        wait = base * self.rng.uniform(1 - JITTER, 1 + JITTER)
        if self.last_class == "starting":
            self.starting_waited += wait
        return wait

    def reset(self) -> None:
        self.unreachable = self.starting = 0
        self.starting_waited = 0.0
