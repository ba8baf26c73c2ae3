"""VolunteerQuorum: hold the start of training until N distinct volunteers are in (`--wait-for-volunteers N`).

Who wants it: a sync baseline (`--sync`) whose first round must include every machine of the benchmark,
a small closed swarm whose operator wants every member training from step 1, and the integration tests
that assert on "every volunteer contributed" (docs/testing.md). The default, 0, waits for nobody: an open
swarm should never stall on a volunteer that may not come.

"In" means: asked for a lease with a valid signed LeaseRequest that access control admitted — so the
volunteer has fetched the adapter and loaded its model, and is ready to work. Volunteers are counted by
key (fingerprint of the signing key), so one machine re-dialling, or one key under two names, counts once.

While the quorum is short the LeaseDesk answers every request with an empty grant (the volunteer polls
again, as it does when back-pressure says "full"), so nobody generates work before the others are in, and
the learner loop does not take its first step (a resumed run's journalled batches wait too). Once open it
stays open for the life of the process: a volunteer leaving later is the ordinary dropout case. A restarted
(or `--resume`d) coordinator counts afresh.

The coordinator logs a `waiting_for_volunteers` event to metrics.jsonl when it starts waiting, a
`volunteer_in` event per new key, and `volunteers_ready` when the quorum is reached; `status()` feeds the
dashboard and `asyncrl-coordinator status` ("waiting for 1/2 volunteers").
"""

from __future__ import annotations

import threading
from typing import Callable

from asyncrl.protocol.identity import fingerprint


class VolunteerQuorum:
    def __init__(self, needed: int, *, on_event: Callable[..., None] = lambda event, **fields: None):
        if needed < 0:
            raise ValueError("needed must be >= 0")
        self.needed = needed
        self._on_event = on_event  # RunLog.write-shaped: (event, **fields)
        self._lock = threading.Lock()
        self._keys: dict[str, str] = {}  # fingerprint -> the name it first gave
        self.ready = threading.Event()
        if needed == 0:
            self.ready.set()

    def start(self) -> None:
        """Log that the run is waiting (no-op when nobody is awaited)."""
        if not self.ready.is_set():
            self._on_event("waiting_for_volunteers", needed=self.needed, joined=0)

    def admit(self, signer: bytes, name: str = "") -> bool:
        """Count `signer` in; True once the quorum is reached (this call may be the one that reaches it)."""
        if self.ready.is_set():
            return True
        fp = fingerprint(signer)
        with self._lock:
            if self.ready.is_set():
                return True
            if fp not in self._keys:
                self._keys[fp] = name
                self._on_event("volunteer_in", fingerprint=fp, name=name, joined=len(self._keys), needed=self.needed)
                if len(self._keys) >= self.needed:
                    self._on_event("volunteers_ready", needed=self.needed, names=sorted(self._keys.values()))
                    self.ready.set()
        return self.ready.is_set()

    def wait(self, stop: threading.Event, poll_s: float = 0.2) -> bool:
        """Block until the quorum is reached (True) or `stop` is set (False)."""
        while not self.ready.wait(poll_s):
            if stop.is_set():
                return False
        return True

    def status(self) -> dict | None:
        """{"needed": N, "joined": k} while waiting; None once training may start (or nobody was awaited)."""
        if self.ready.is_set():
            return None
        with self._lock:
            return {"needed": self.needed, "joined": len(self._keys)}
