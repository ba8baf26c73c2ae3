"""TokenBucket: the one rate limiter — request admission (all or nothing) and byte pacing (may queue).

`rate` tokens per second accumulate up to `burst`. Two ways to spend them:

  take(now, cost)     admission: spend `cost` if it is there and say yes, else spend nothing and say
                      no (the coordinator's per-key / per-peer / first-contact limits, coordinator/trust/access.py)
  reserve(cost, now)  pacing: always spend, running into debt, and return how long the caller must wait
                      before sending; concurrent senders queue up behind each other, so the long-run
                      rate never exceeds `rate` (a volunteer's `--max-upload-mbps`, swarm/serving.py)
  reserve(cost, now, max_wait)
                      bounded pacing: as above, but only if the wait would be at most `max_wait`;
                      otherwise spend nothing and return None (the caller refuses: swarm/serving.py
                      ServeBudget for peers without a track record)

`rate <= 0` means unlimited. No lock: each bucket is used from one thread or one event loop, or under
its owner's lock. Times are seconds on a monotonic clock.
"""

from __future__ import annotations

import asyncio
import time


class TokenBucket:
    __slots__ = ("rate", "burst", "tokens", "last")

    def __init__(self, rate: float, burst: float, now: float | None = None):
        self.rate, self.burst = float(rate), float(max(1.0, burst))
        self.tokens = self.burst
        self.last = time.monotonic() if now is None else now

    def _refill(self, now: float | None) -> None:
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now

    def take(self, now: float | None = None, cost: float = 1.0) -> bool:
        """Spend `cost` tokens if all of them are there (True); otherwise spend nothing (False)."""
        if self.rate <= 0:
            return True
        self._refill(now)
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False

    def reserve(self, cost: float, now: float | None = None, max_wait: float | None = None) -> float | None:
        """Spend `cost` tokens, into debt if need be; seconds to wait before using them. With `max_wait`,
        a wait longer than that spends nothing and returns None."""
        if self.rate <= 0:
            return 0.0
        self._refill(now)
        wait = max(0.0, (cost - self.tokens) / self.rate)
        if max_wait is not None and wait > max_wait:
            return None
        self.tokens -= cost
        return wait

    async def pace(self, cost: float) -> None:
        """Reserve `cost` and sleep until it may be used (on the caller's event loop)."""
        delay = self.reserve(cost)
        if delay > 0:
            await asyncio.sleep(delay)
