"""`math` reward: math-verify, with a hard time limit.

math-verify bounds parsing/verification with SIGALRM, which only works in a process's main thread —
and the coordinator re-scores on worker threads. So every verification runs in a dedicated worker
*process* (spawned once, reused), where math-verify's own signal timeouts work, and the caller
waits at most `timeout_s` for it: a pathological answer (a sympy blow-up) costs a worker restart and
scores 0, never a hung volunteer or coordinator.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

TIMEOUT_S = 10.0

_pool: ProcessPoolExecutor | None = None
_lock = threading.Lock()


def _verify_in_worker(completion: str, answer: str) -> float:
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$", parsing_timeout=5)
    pred = parse(completion, parsing_timeout=5)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=5) else 0.0


def _get_pool() -> ProcessPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))
        return _pool


def _reset_pool() -> None:
    global _pool
    with _lock:
        if _pool is not None:
            workers = list((getattr(_pool, "_processes", None) or {}).values())
            _pool.shutdown(wait=False, cancel_futures=True)
            for proc in workers:  # our own worker, by handle: a stuck sympy call would never return
                proc.kill()
        _pool = None


def math_reward(completion: str, answer: str, *, timeout_s: float = TIMEOUT_S) -> float:
    """1.0 when math-verify finds the completion's final answer equal to `answer`, else 0.0."""
    future = _get_pool().submit(_verify_in_worker, completion, answer)
    try:
        return float(future.result(timeout=timeout_s))
    except FutureTimeout:
        _reset_pool()
        return 0.0
    except Exception:  # a crashed worker (BrokenProcessPool) or a math-verify error: no credit
        _reset_pool()
        return 0.0
