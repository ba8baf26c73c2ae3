"""What a volunteer sees: a live rich table, JSON log lines for headless hosts, or nothing (--quiet).

The worker reports events (`adapter`, `batch`, `rejected`, `warning`, `info`) and a status snapshot;
the display decides how to show them. Only this module imports rich.
"""

from __future__ import annotations

import json
import sys
import threading
import time

_LINE_LOCK = threading.Lock()


def write_json_line(obj: dict) -> None:
    """One JSON object per line on stdout, whole: one write, under a lock, then a flush. print() writes the
    object and its newline as two writes, and TextIOWrapper is not thread-safe: two threads' lines (the
    volunteer's worker and its helpers; the lab's presence watcher and control loop) interleaved mid-line
    and every reader of the log lost both (bench/swarmlab.py's emit, tests/transport/test_lab_events.py)."""
    line = json.dumps(obj) + "\n"
    with _LINE_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


class Display:
    def __init__(self, mode: str = "live"):
        if mode not in ("live", "plain", "json", "quiet"):
            raise ValueError(f"unknown display mode {mode!r}")
        if mode == "live" and not sys.stdout.isatty():
            mode = "plain"  # a log file or a pipe: no cursor tricks
        self.mode = mode
        self._live = None
        self._t0 = time.time()

    def event(self, kind: str, message: str, **fields) -> None:
        if self.mode == "json":
            write_json_line({"t": time.time(), "event": kind, "message": message, **fields})
        elif self.mode == "quiet":
            if kind in ("warning", "error"):
                print(message, file=sys.stderr, flush=True)
        elif self._live is not None:
            self._live.console.print(message)
        else:
            print(message, flush=True)

    def status(self, st, *, version: int | None, latest: int | None, outbox: int) -> None:
        if self.mode != "live":
            return
        from rich.live import Live
        from rich.table import Table

        elapsed = max(1e-6, time.time() - self._t0)
        table = Table(title=f"asyncrl volunteer {st.name} ({st.fingerprint})", show_header=False)
        lag = (latest - version) if (latest is not None and version is not None) else None
        rows = [
            ("adapter version", f"v{version}" + (f"  (lag {lag})" if lag is not None else "")),
            ("rollouts/s", f"{st.rollouts / elapsed:.1f}"),
            ("tokens/s", f"{st.tokens / elapsed:.0f}"),
            ("batches sent / acked", f"{st.batches_sent} / {st.batches_acked}"),
            ("rejected", ", ".join(f"{k}: {v}" for k, v in st.batches_rejected.items()) or "none"),
            ("mean reward", f"{st.reward_sum / st.rollouts:.3f}" if st.rollouts else "-"),
            ("outbox", str(outbox)),
        ]
        for k, v in rows:
            table.add_row(k, v)
        if self._live is None:
            self._live = Live(table, refresh_per_second=2, transient=False)
            self._live.start()
        else:
            self._live.update(table)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
