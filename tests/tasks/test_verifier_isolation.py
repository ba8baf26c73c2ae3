"""One stuck reward check kills only its own worker (tasks/math_reward.py VerifierPool), with the real
pool and a stand-in verifier (module-level so spawned workers can import it): "STUCK" never returns."""

from __future__ import annotations

import threading
import time

import pytest

from asyncrl.tasks.math_reward import Unscorable, VerifierPool


def stand_in(completion: str, answer: str) -> float:
    if completion == "STUCK":
        time.sleep(600)
    return 1.0 if completion == answer else 0.0


def run_all(calls):
    """Run `calls` (fn, args, kwargs) on threads at once; results in order (an exception as its value)."""
    out = [None] * len(calls)

    def one(i, fn, args, kw):
        try:
            out[i] = fn(*args, **kw)
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i, *c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


@pytest.fixture
def pool():
    p = VerifierPool(stand_in, workers=4, per_key=2, timeout_s=3.0, acquire_s=30.0)
    assert p.score("warm", "warm") == 1.0  # one worker spawned before the clock matters
    yield p
    p.close()


def test_a_stuck_check_kills_only_its_own_worker(pool):
    honest = [(pool.score, (f"a{i}", f"a{i}" if i % 2 else "other"), {"key": "honest"}) for i in range(6)]
    results = run_all([(pool.score, ("STUCK", "1"), {"key": "mallory"})] + honest)
    assert isinstance(results[0], Unscorable)
    assert results[1:] == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]  # every honest check scored, none reset to 0
    assert pool.stats["timeouts"] == 1 and pool.stats["killed"] == 1


def test_one_key_cannot_take_the_whole_pool(pool):
    t0 = time.monotonic()
    calls = [(pool.score, ("STUCK", "1"), {"key": "mallory"}) for _ in range(4)]
    calls += [(pool.score, (f"b{i}", f"b{i}"), {"key": f"honest-{i}"}) for i in range(4)]
    results = run_all(calls)
    assert all(isinstance(r, Unscorable) for r in results[:4])
    assert results[4:] == [1.0] * 4  # mallory held at most per_key=2 of the 4 workers at any time
    assert time.monotonic() - t0 < 20


def test_the_check_time_limit_comes_from_the_environment(monkeypatch):
    from asyncrl.tasks.math_reward import _timeout_from_env

    monkeypatch.setenv("ASYNCRL_REWARD_TIMEOUT_S", "2.5")
    assert _timeout_from_env() == 2.5
    monkeypatch.delenv("ASYNCRL_REWARD_TIMEOUT_S")
    assert _timeout_from_env() == 10.0
    for bad in ("0", "-1", "soon", "1e9"):
        monkeypatch.setenv("ASYNCRL_REWARD_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="ASYNCRL_REWARD_TIMEOUT_S"):
            _timeout_from_env()
