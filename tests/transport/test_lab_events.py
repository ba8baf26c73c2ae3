"""JSON event lines stay whole when several threads write at once: the lab's (bench/swarmlab.py emit) and a
volunteer's `--display json` (client/display.py), which share `write_json_line`.

A publisher's presence watcher is a thread beside its control loop; with print() the ~60 KB presence map and
the stats interleaved mid-line and tests/adversarial/test_sybil_presence.py timed out waiting for a stats line
that was in the log, torn. This runs the emitter in a child with stdout on a file, as the tests run the lab.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

WRITERS = {
    "lab emit": "from bench.swarmlab import emit",
    "volunteer display": "from asyncrl.client.display import Display\nemit = Display('json').event",
}
CHILD = """
import threading
WRITER

def burst(name):
    for i in range(200):
        emit(name, i=i, message="x" * 60_000)

threads = [threading.Thread(target=burst, args=(f"t{n}",)) for n in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_events_from_four_threads_are_whole_lines(tmp_path, writer):
    log = tmp_path / "events.log"
    child = CHILD.replace("WRITER", WRITERS[writer])
    with log.open("wb") as out:
        subprocess.run([sys.executable, "-c", child], cwd=REPO, stdout=out, check=True, timeout=120)
    lines = log.read_text().splitlines()
    events = [json.loads(line) for line in lines]  # a torn line raises here
    assert len(events) == 4 * 200
    for n in range(4):
        assert sorted(e["i"] for e in events if e["event"] == f"t{n}") == list(range(200))
