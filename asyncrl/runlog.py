"""The run log: `<run_dir>/metrics.jsonl`, written by the coordinator and read by everyone else.

One module owns the format so that the coordinator (writer), the operator's `status`, the demo launcher,
the benchmarks and the tests read it the same way:

- one JSON object per line, `{"event": <kind>, "t": <unix seconds>, ...fields}`, appended and flushed
  line by line (`RunLog.write`); readers run while the coordinator writes;
- a reader skips the last line when it has no newline yet (it is being written), and skips a complete
  line that is not a JSON object (a torn write after a crash), counting it, rather than stopping there:
  every later event is still read.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


class RunLog:
    """Append-only JSONL metrics (one event per line, flushed) in the run directory."""

    def __init__(self, path: Path, listeners: Iterable[Callable[[str, dict], None]] = ()):
        self.path = path
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()
        self.listeners = list(listeners)  # fn(event, record) after each line, e.g. Telemetry.observe

    def write(self, event: str, **fields) -> None:
        with self._lock:
            record = {"event": event, "t": time.time(), **fields}
            self._f.write(json.dumps(record) + "\n")
            for listener in self.listeners:
                listener(event, record)

    def close(self) -> None:
        self._f.close()


class Events(list):
    """The events read from a run log, in order; `.skipped` counts complete lines that were not events."""

    skipped: int = 0


def read_events(path: str | Path, kind: str | None = None) -> Events:
    """Every event in a metrics.jsonl (only those of `kind` when given); a missing file reads as none.
    `path` may be the run directory itself."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    out = Events()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    lines = text.split("\n")
    for line in lines[:-1]:  # the last piece has no newline: empty, or a line still being written
        try:
            event = json.loads(line)
        except ValueError:
            out.skipped += 1
            continue
        if not isinstance(event, dict) or "event" not in event:
            out.skipped += 1
            continue
        if kind is None or event["event"] == kind:
            out.append(event)
    return out
