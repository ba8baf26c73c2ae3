"""LeaseKeeper: renews while the engine works, learns which leases are gone, never stops the work."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from asyncrl.client.lease_keeper import LeaseKeeper


@dataclass
class Lease:
    lease_id: str
    expires_at: float


class Coordinator:
    """Answers renewals like TaskBoard.renew: `left` seconds for held ids, 0 for the ones it dropped."""

    def __init__(self, left: float, dropped=(), fail_first: int = 0):
        self.left, self.dropped, self.fail_first = left, set(dropped), fail_first
        self.calls: list[list[str]] = []
        self.renewed = threading.Event()

    def renew(self, ids):
        self.calls.append(list(ids))
        if len(self.calls) <= self.fail_first:
            raise ConnectionError("coordinator restarting")
        self.renewed.set()
        return {i: 0.0 if i in self.dropped else self.left for i in ids}


def test_short_work_sends_no_renewal():
    coord = Coordinator(left=10.0)
    with LeaseKeeper(coord.renew, [Lease("a", time.time() + 60)]) as keeper:
        pass
    assert coord.calls == [] and keeper.lost == set()


def test_long_work_is_renewed_and_a_dropped_lease_is_reported_lost():
    coord = Coordinator(left=0.6, dropped={"b"})
    leases = [Lease("a", time.time() + 0.6), Lease("b", time.time() + 0.6)]
    with LeaseKeeper(coord.renew, leases) as keeper:
        assert keeper.first_s == 0.2  # a third of what the grant said, at least MIN_RENEW_S
        deadline = time.time() + 30
        while len(coord.calls) < 3 and time.time() < deadline:  # the work goes on while renewals flow
            time.sleep(0.05)
    assert len(coord.calls) >= 3
    assert coord.calls[0] == ["a", "b"] and all(c == ["a"] for c in coord.calls[1:])  # "b" is not asked again
    assert keeper.lost == {"b"} and keeper.renewals == len(coord.calls)


def test_renewal_errors_are_retried_and_do_not_stop_the_work():
    coord = Coordinator(left=5.0, fail_first=1)
    with LeaseKeeper(coord.renew, [Lease("a", time.time() + 0.6)]) as keeper:
        assert coord.renewed.wait(30)  # first call failed, the retry (RETRY_S later) went through
    assert keeper.errors >= 1 and keeper.renewals >= 1 and keeper.lost == set()
