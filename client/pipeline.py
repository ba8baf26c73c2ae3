"""The volunteer's pipeline: the engine never waits for the network or the reward checks.

Three threads, each with one job, joined by bounded hand-offs (client/worker.py wires them):

  engine thread  (Volunteer.run)  adapter hot-swap between works -> take the leases fetched ahead ->
                                  ask for the next ones (LeaseAhead) -> generate -> hand the work on
  LeaseAhead     one lease request in flight while the engine generates, so the next prompts are in
                 hand when a generation ends. At most ONE grant is held ahead (the back-pressure bound:
                 a volunteer never holds more than the work it generates plus the next one), and its
                 leases are renewed from the moment they are granted (client/lease_keeper.py).
  Stage          score + build + spool, off the engine thread; a queue of at most `depth` works (a
                 full queue blocks the engine: scoring may never fall behind by more than that).
  Uploader       uploads the outbox whenever something was spooled (and on a back-off after a failure).
                 The outbox on disk is the only place a finished batch lives until it is acked, so a
                 kill -9 at any point loses at most the work being generated or scored (its leases
                 expire and go to someone else), never a finished batch.

Stopping: the engine thread finishes its generation, the Stage drains (every finished work is spooled),
leases fetched ahead and not started are returned to the coordinator, and the outbox gets one last flush.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class LeaseAhead:
    """At most one `fetch()` running in the background; `take()` waits for its result."""

    def __init__(self, fetch: Callable[[], object]):
        self._fetch = fetch
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease-ahead")
        self._pending: Future | None = None

    @property
    def asked(self) -> bool:
        return self._pending is not None

    def ask(self) -> None:
        if self._pending is None:
            self._pending = self._pool.submit(self._fetch)

    def take(self):
        """The fetched result (re-raising what the fetch raised); None when nothing was asked."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self):
        """Stop; returns what an unfinished ask fetched (to be returned to the coordinator), or None."""
        try:
            return self.take()
        except Exception:  # noqa: BLE001 - a failed ask holds no leases
            return None
        finally:
            self._pool.shutdown(wait=True)


class Stage:
    """A worker thread running `fn(item)` for each item put, in order; at most `depth` items waiting.
    An exception in `fn` is re-raised by the next `put` or by `close` (the engine thread's loop handles it)."""

    def __init__(self, fn: Callable[[object], None], *, depth: int = 1, name: str = "stage"):
        self._fn = fn
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._busy = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Items put and not yet done."""
        with self._lock:
            return self._busy

    def put(self, item) -> None:
        self._raise()
        with self._lock:
            self._busy += 1
        self._queue.put(item)

    def close(self) -> None:
        """Finish every item put, then stop (re-raises a failure)."""
        self._queue.put(None)
        self._thread.join()
        self._raise()

    def _raise(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._fn(item)
            except BaseException as exc:  # noqa: BLE001 - handed to the engine thread
                self._error = exc
            finally:
                with self._lock:
                    self._busy -= 1


class Uploader:
    """Runs `flush()` when kicked, and again after `retry_s` while the last flush left work or failed.
    `flush()` returns True when the outbox is empty; a raised exception (coordinator unreachable) is
    passed to `on_error`, which returns the back-off before the next try."""

    def __init__(self, flush: Callable[[], bool], *, on_error: Callable[[Exception], float], retry_s: float = 1.0):
        self._flush = flush
        self._on_error = on_error
        self._retry_s = retry_s
        self._kick = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="uploader", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._kick.set()

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        self._thread.join()

    def _run(self) -> None:
        wait: float | None = None  # None: until kicked
        while not self._stop.is_set():
            self._kick.wait(wait)
            self._kick.clear()
            if self._stop.is_set():
                return
            try:
                wait = None if self._flush() else self._retry_s
            except Exception as exc:  # noqa: BLE001 - unreachable, refused: back off, the batches stay spooled
                wait = self._on_error(exc)
