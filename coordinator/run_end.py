"""RunEnd: a run that ends says so, so volunteers exit with their summary instead of retrying forever.

A run is *finished* when `max_steps` is reached or the operator stops it for good:

    asyncrl-coordinator finish --run-dir runs/r1     # writes <run_dir>/finish.request; the learner loop ends

(Ctrl-C / SIGTERM still only stop: the run can be `--resume`d and volunteers wait for it.) On finishing,
the coordinator hub (coordinator/service.py) sets `finished`: the handshake says so, lease requests
and batches are refused with RUN_FINISHED (a volunteer drops what it still holds: it can no longer be
trained), and the final signed pointer (the last version again, `finished` set: protocol/swarm.py
`finish_pointer`) goes into the DHT and is pushed to live volunteers. The coordinator then lingers up to
`finish_grace_s` — less once every volunteer active in the last `lease_timeout_s` has been refused
once, i.e. told — so that the ones polling the DHT through it learn it too.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from asyncrl.protocol.atomic import write_atomic

REQUEST_NAME = "finish.request"


def request_finish(run_dir: Path) -> Path:
    """What `asyncrl-coordinator finish` does: ask the running coordinator to end the run for good."""
    return write_atomic(Path(run_dir) / REQUEST_NAME, f"{time.time()}\n")


class RunEnd:
    def __init__(self, run_dir: Path, *, active_window_s: float, clock=time.monotonic):
        self.request_path = Path(run_dir) / REQUEST_NAME
        self.active_window_s = active_window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._active: dict[str, float] = {}  # peer -> last lease/submit request (one entry per volunteer)
        self._told: set[str] = set()
        self._all_told = threading.Event()
        self.finished = False
        self.reason = ""

    def requested(self) -> bool:
        return self.request_path.exists()

    def seen(self, peer: str) -> None:
        with self._lock:
            self._active[peer] = self._clock()

    def finish(self, reason: str) -> None:
        with self._lock:
            self.finished, self.reason = True, reason
            self.request_path.unlink(missing_ok=True)  # a later run in this directory starts afresh
            self._check_locked()

    def told(self, peer: str) -> None:
        """`peer` was refused RUN_FINISHED (it knows)."""
        with self._lock:
            self._told.add(peer)
            self._check_locked()

    def _check_locked(self) -> None:
        now = self._clock()
        live = {p for p, t in self._active.items() if now - t <= self.active_window_s}
        if self.finished and live <= self._told:
            self._all_told.set()

    def linger(self, grace_s: float, stop: threading.Event) -> bool:
        """Wait until every live volunteer was told, `grace_s` passed or `stop` is set; True if all were told."""
        deadline = self._clock() + grace_s
        while not stop.is_set():
            with self._lock:
                self._check_locked()
            if self._all_told.wait(min(0.2, max(0.0, deadline - self._clock()))):
                return True
            if self._clock() >= deadline:
                return False
        return False
