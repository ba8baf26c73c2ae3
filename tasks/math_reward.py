"""`math` reward: math-verify, each check isolated in its own worker process with a hard time limit.

math-verify bounds parsing/verification with SIGALRM, which only works in a process's main thread —
and the coordinator re-scores on many handler threads at once. So every check runs in a worker
*process* of a `VerifierPool`, one check per worker at a time: a caller checks a worker out, sends it
one (completion, answer), and waits at most `timeout_s`. A check that does not finish in time kills
*that* worker only (it is replaced lazily) and raises `Unscorable`; every other check in flight, on
its own worker, is untouched. (Before: one shared worker, and a timeout reset it under everyone.)

`Unscorable` is not a score: the coordinator drops that group without striking the volunteer
(the failure is ours), and a volunteer leaves the group out of its batch (its lease expires and the
prompt goes to someone else). Inside the worker math-verify's own timeouts are off, so a result is
never a silent 0 produced by a slow machine: it is the verdict, or `Unscorable`.

Fairness: at most `per_key` workers serve one caller key at a time (the coordinator passes the batch's
signer), so one volunteer's pathological completions can occupy only its share of the pool.
"""

from __future__ import annotations

import contextlib
import contextvars
import multiprocessing as mp
import os
import threading
import time
from collections import defaultdict
from typing import Callable

def _timeout_from_env(default: float = 10.0) -> float:
    raw = os.environ.get("ASYNCRL_REWARD_TIMEOUT_S", "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise ValueError(f"ASYNCRL_REWARD_TIMEOUT_S={raw!r}: expected seconds in (0, 3600]")
    return value


TIMEOUT_S = _timeout_from_env()
"""Longest one check may take (wall clock) before its worker is killed: 10 s, or ASYNCRL_REWARD_TIMEOUT_S
(the same on the coordinator and its volunteers is best: a check one side finishes and the other cuts
drops that group)."""
ACQUIRE_S = 30.0
"""Longest a caller waits for a free worker before the check counts as unscorable."""
STARTUP_S = 120.0
"""Longest a fresh worker may take to start (spawn, imports) before its first check; not part of TIMEOUT_S,
so a loaded machine's slow start never turns an honest check into a timeout."""


class Unscorable(Exception):
    """The reward could not be computed (timeout, crashed worker, pool exhausted): not a score."""


def verify_math(completion: str, answer: str) -> float:
    """The check itself (runs in a worker): 1.0 when math-verify finds the answers equal, else 0.0."""
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$", parsing_timeout=None)
    pred = parse(completion, parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


def _warm_math() -> None:
    import math_verify  # noqa: F401 - the import is the slow part of a fresh worker's first check


verify_math.warm = _warm_math


def _worker_main(conn, verify_fn) -> None:
    warm = getattr(verify_fn, "warm", None)
    try:
        if warm is not None:
            warm()
    except Exception:  # noqa: BLE001 - the first check reports the real error
        pass
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        try:
            conn.send(("ok", float(verify_fn(*job))))
        except Exception as exc:  # a verifier error is "unscorable", reported, never a silent 0
            conn.send(("error", f"{exc.__class__.__name__}: {str(exc)[:200]}"))


class _Worker:
    def __init__(self, ctx, verify_fn):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, verify_fn), daemon=True, name="asyncrl-verifier")
        self.proc.start()
        child.close()
        self.ready = False  # set once the worker said it started (STARTUP_S)

    def kill(self) -> None:
        try:
            self.proc.kill()  # our own child, by handle
            self.proc.join(5)
        except Exception:
            pass
        self.conn.close()


class VerifierPool:
    """Up to `workers` verifier processes; each check has one to itself (see the module docstring)."""

    def __init__(self, verify_fn: Callable[[str, str], float] = verify_math, *, workers: int | None = None,
                 timeout_s: float = TIMEOUT_S, acquire_s: float = ACQUIRE_S, per_key: int | None = None):
        self.verify_fn = verify_fn
        self.workers = workers or max(2, min(8, os.cpu_count() or 2))
        self.per_key = per_key or max(1, self.workers // 2)
        self.timeout_s, self.acquire_s = timeout_s, acquire_s
        self._ctx = mp.get_context("spawn")
        self._idle: list[_Worker] = []
        self._busy = 0
        self._by_key: dict[object, int] = defaultdict(int)
        self._cond = threading.Condition()
        self.stats = {"checks": 0, "timeouts": 0, "errors": 0, "killed": 0, "acquire_timeouts": 0}

    def score(self, completion: str, answer: str, *, key: object = None) -> float:
        worker = self._acquire(key)
        ok = False
        try:
            try:
                if not worker.ready:  # a fresh worker: its start-up is not the check's time
                    if not worker.conn.poll(STARTUP_S):
                        raise OSError(f"no start within {STARTUP_S:.0f}s")
                    worker.conn.recv()
                    worker.ready = True
                worker.conn.send((completion, answer))
                ready = worker.conn.poll(self.timeout_s)
                status, value = worker.conn.recv() if ready else ("timeout", None)
            except (EOFError, OSError) as exc:  # the worker died under us
                status, value = "error", f"worker died: {exc.__class__.__name__}"
            self.stats["checks"] += 1
            if status == "ok":
                ok = True
                return value
            self.stats["timeouts" if status == "timeout" else "errors"] += 1
            raise Unscorable(f"math check {'timed out after %.0fs' % self.timeout_s if status == 'timeout' else value}")
        finally:
            self._release(worker, key, keep=ok)

    def _acquire(self, key) -> _Worker:
        deadline = time.monotonic() + self.acquire_s
        with self._cond:
            while self._busy >= self.workers or (key is not None and self._by_key[key] >= self.per_key):
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stats["acquire_timeouts"] += 1
                    raise Unscorable("no verifier free (all busy)")
                self._cond.wait(left)
            self._busy += 1
            if key is not None:
                self._by_key[key] += 1
            worker = self._idle.pop() if self._idle else None
        if worker is None or not worker.proc.is_alive():
            try:
                worker = _Worker(self._ctx, self.verify_fn)
            except BaseException:
                self._release(None, key, keep=False)
                raise
        return worker

    def _release(self, worker: _Worker | None, key, *, keep: bool) -> None:
        if worker is not None and not keep:
            worker.kill()  # a stuck or broken check takes only its own worker with it
            self.stats["killed"] += 1
        with self._cond:
            self._busy -= 1
            if key is not None:
                self._by_key[key] -= 1
                if not self._by_key[key]:
                    del self._by_key[key]
            if worker is not None and keep:
                self._idle.append(worker)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


_pool: VerifierPool | None = None
_pool_lock = threading.Lock()
_scoring_key: contextvars.ContextVar[object] = contextvars.ContextVar("asyncrl_scoring_key", default=None)


@contextlib.contextmanager
def scoring_for(key: object):
    """Attribute the checks made inside this block to `key` (its fair share of the pool): the coordinator
    wraps re-scoring of one batch in it with the batch's signer."""
    token = _scoring_key.set(key)
    try:
        yield
    finally:
        _scoring_key.reset(token)


def default_pool() -> VerifierPool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = VerifierPool()
        return _pool


def math_reward(completion: str, answer: str) -> float:
    """1.0 when math-verify finds the completion's final answer equal to `answer`, else 0.0; raises
    Unscorable when the check cannot finish (see the module docstring)."""
    return default_pool().score(completion, answer, key=_scoring_key.get())
