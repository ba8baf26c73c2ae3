"""A burst of inbound streams while the server's event loop is busy gets an answer on every stream.

Why: p2pd hands each inbound stream to the serving process by dialing its handler socket; with hivemind's
default accept queue (100) a burst larger than that during a stall of the loop (a GIL-starved coordinator,
a crowd of volunteers) made p2pd reset the extra streams, and their callers read 0 bytes: no answer, no
code (CI runs of 2026-12-01: `IncompleteReadError: 0 bytes read on a total of 1 expected bytes` on leases
and submits). Every stream now reaches the inbound gate, which answers it or refuses it with a code
(swarm/hivemind_private.py `_listen_backlog_patch`). Two real nodes in two processes (tests/integration/
stream_burst.py), their real p2pd, on loopback; the server's loop blocks for 3 s while 150 streams arrive."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, wait_for
from tests.integration.lab import alive, events

pytestmark = pytest.mark.integration

BURST = 150  # more than hivemind's default backlog of 100


def test_a_burst_of_streams_during_a_stalled_loop_is_answered_on_every_stream(procs):
    server = procs.start("server", ["-m", "tests.integration.stream_burst", "serve", "--stall-s", "3"], cwd=REPO)
    ready = wait_for(lambda: (alive(server), events(server, "ready"))[1], 120, "the server node")[0]
    client = procs.start("burst", ["-m", "tests.integration.stream_burst", "burst", ready["join"], ready["peer_id"],
                                   "--streams", str(BURST)], cwd=REPO)
    assert client.wait(300) == 0, client.log_path.read_text()[-3000:]
    outcomes = events(client, "outcomes")[0]["outcomes"]
    assert sum(outcomes.values()) == BURST
    assert set(outcomes) <= {"OK", "RATE_LIMITED"}, outcomes  # answered, or refused with a code: never hung up on
    assert outcomes.get("OK", 0) >= 1, outcomes
