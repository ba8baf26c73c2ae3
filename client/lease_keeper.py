"""LeaseKeeper: keeps the leases a volunteer is working on alive while its engine generates.

A lease expires `lease_timeout_s` after its grant unless renewed (coordinator/leasing/taskboard.py `renew`). A
1024-token group on a slow GPU can take longer than that, so while the volunteer generates (client/rollout.py), this
thread sends renewal-only LeaseRequests (`max_prompts=0, renew=ids`) on the lease stream:

  * the first one after `first_s` (a third of what the grant's `expires_at` suggests, at most
    FIRST_RENEW_MAX_S: the coordinator's clock may differ from ours, so the hint is only trusted downwards);
  * then a third of the time the coordinator says is left (`LeaseRenewal.expires_in_s`, its own clock);
  * a lease the coordinator reports gone (0 s left: expired, or renewed up to `lease_max_s`) goes into
    `lost`: the volunteer leaves its group out of the batch instead of having the whole batch refused;
  * network errors are retried after RETRY_S; they never stop the work.

Work that ends before the first renewal costs nothing. `finish()` stops the thread and, when the work
ran long enough to have needed a renewal, asks once more, so `lost` is current when the batch is built.

    with LeaseKeeper(renew_fn, leases) as keeper:
        samples = engine.generate(...)
    send only groups whose lease_id not in keeper.lost
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable

FIRST_RENEW_MAX_S = 5.0
MIN_RENEW_S = 0.2
MAX_RENEW_S = 120.0
RETRY_S = 1.0


class LeaseKeeper:
    def __init__(self, renew: Callable[[list[str]], dict[str, float]], leases: Iterable, *,
                 clock=time.time, monotonic=time.monotonic):
        """`renew(ids) -> {id: seconds left}` sends one renewal; `leases` are TaskLeases (lease_id, expires_at)."""
        leases = list(leases)
        self._renew = renew
        self.ids = [l.lease_id for l in leases]
        hint = min((l.expires_at for l in leases), default=0.0) - clock()
        self.first_s = min(FIRST_RENEW_MAX_S, max(MIN_RENEW_S, hint / 3))
        self.lost: set[str] = set()
        self.renewals = 0   # renewal requests answered
        self.errors = 0     # renewal requests that failed (network, rate limit)
        self._monotonic = monotonic
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._started = 0.0

    def __enter__(self) -> "LeaseKeeper":
        self._started = self._monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.finish()

    def finish(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        if self._monotonic() - self._started >= self.first_s:
            self._once()  # the work outlived a renewal interval: learn what is still ours before sending

    def _live(self) -> list[str]:
        with self._lock:
            return [i for i in self.ids if i not in self.lost]

    def _once(self) -> float:
        """One renewal; returns how long to wait before the next."""
        live = self._live()
        if not live:
            return MAX_RENEW_S
        try:
            left = self._renew(live)
        except Exception:  # TransportError, RATE_LIMITED, a coordinator restarting: try again soon
            self.errors += 1
            return RETRY_S
        self.renewals += 1
        with self._lock:
            self.lost.update(i for i in live if left.get(i, 0.0) <= 0.0)
        remaining = [left[i] for i in live if left.get(i, 0.0) > 0.0]
        return min(MAX_RENEW_S, max(MIN_RENEW_S, min(remaining) / 3)) if remaining else MAX_RENEW_S

    def _run(self) -> None:
        wait = self.first_s
        while not self._stop.wait(wait):
            wait = self._once()
