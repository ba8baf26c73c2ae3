"""--duty-cycle: the rest after each batch is busy * (1 - F) / F, measured, interruptible."""

from __future__ import annotations

import threading

import pytest

from asyncrl.client.pacing import DutyCycle


class RecordingStop:
    """Stands in for the volunteer's stop event: records each requested wait and advances a fake clock."""

    def __init__(self, clock):
        self.clock = clock
        self.waits: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.clock.now += timeout
        return False


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rest_is_busy_times_one_minus_f_over_f():
    clock = FakeClock()
    stop = RecordingStop(clock)
    pacer = DutyCycle(0.2, clock=clock)
    assert pacer.rest_after(1.5, stop) == pytest.approx(6.0)
    assert pacer.rest_after(0.5, stop) == pytest.approx(2.0)
    assert stop.waits == pytest.approx([6.0, 2.0])
    assert pacer.busy_s == pytest.approx(2.0) and pacer.rested_s == pytest.approx(8.0)
    assert pacer.achieved == pytest.approx(0.2)


def test_full_duty_never_rests():
    clock = FakeClock()
    stop = RecordingStop(clock)
    pacer = DutyCycle(1.0, clock=clock)
    assert pacer.rest_after(3.0, stop) == 0.0
    assert stop.waits == [] and pacer.achieved == 1.0


def test_stop_interrupts_the_rest():
    stop = threading.Event()
    stop.set()
    pacer = DutyCycle(0.01)
    rested = pacer.rest_after(100.0, stop)  # would be 9900 s
    assert rested < 9900.0
    assert pacer.busy_s == 100.0


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.01])
def test_fraction_must_be_in_0_1(bad):
    with pytest.raises(ValueError):
        DutyCycle(bad)


def test_idle_backoff_follows_the_coordinators_retry_with_jitter_and_backs_off_alone_otherwise():
    import random

    from asyncrl.client.pacing import MAX_IDLE_WAIT_S, IdleBackoff

    idle = IdleBackoff(0.5, rng=random.Random(1))
    waits = [idle.after_empty(10.0) for _ in range(50)]
    assert all(8.0 <= w <= 12.0 for w in waits) and len({round(w, 3) for w in waits}) > 10  # +-20 %, not lock-step
    idle.reset()
    own = [idle.after_empty(0.0) for _ in range(12)]  # no retry named: double from the pause, capped
    assert own[0] <= 0.6 and own[3] >= 0.5 * 8 * 0.8 and max(own) <= MAX_IDLE_WAIT_S * 1.2
    idle.reset()
    assert idle.after_empty(0.0) <= 0.6 and idle.requests == 63
