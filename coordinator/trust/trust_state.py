"""Trust state on disk: what the coordinator must not forget across restarts, and what it shows.

Every `every_s` seconds (and once more at shutdown) a daemon thread writes, each file atomically
(temp name + os.replace), no pickle:
  <run_dir>/replay.bin   Ingest.state_bytes(): the replay guard's nonces (bounded by the timestamp
                         window), so a restarted coordinator still refuses replays;
  <run_dir>/seen_ids.log the accepted batch ids, *appended* (only the new ones, outside the ingest lock:
                         coordinator/ingest/ingest_books.py SeenIds), so a restarted coordinator refuses
                         duplicates and the cost of a write does not grow with the run;
  <run_dir>/access.bin   AccessControl.state_bytes(): automatic bans, strikes and track records;
  <run_dir>/lease_replay.bin  LeaseDesk.state_bytes(): the lease requests' nonces (a copy replayed after a
                         restart is refused);
  <run_dir>/audit_engines.json  each engine class's learned audit tolerance and samples
                         (coordinator/trust/audit_policy.py), read back by --resume;
  <run_dir>/trust.json   a read-only view for operators and tests: per-key accepted/rejected/strikes,
                         bans, access counters, audit statistics (incl. its cost as a fraction of
                         learner time) and the most recent verdicts (batch id -> code; a refused
                         copy sent by another peer than the signer's is booked on that peer instead).
`load()` merges replay.bin, seen_ids.log and access.bin back at start (after a checkpoint restore, if
any: the union never forgets a nonce, an accepted id or a ban). trust.json lists the 1000 most recently
seen keys (the ingest table itself is bounded too).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from asyncrl.protocol.atomic import write_atomic
from asyncrl.protocol.errors import ProtocolError

MAX_LISTED = 1000  # keys listed in trust.json (the most recently seen)


class TrustState:
    def __init__(self, run_dir: Path, *, ingest, access=None, auditor=None, lease_desk=None, every_s: float = 2.0,
                 out=print, engines_file: str = "audit_engines.json"):
        self.engines_file = engines_file
        self.run_dir = Path(run_dir)
        self.ingest, self.access, self.auditor, self.lease_desk = ingest, access, auditor, lease_desk
        self.every_s = every_s
        self.out = out
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()

    def load(self) -> dict:
        loaded = {}
        for name, target in (("replay.bin", self.ingest), ("access.bin", self.access),
                             ("lease_replay.bin", self.lease_desk)):
            path = self.run_dir / name
            if target is None or not path.exists():
                continue
            try:
                target.load_state(path.read_bytes())
                loaded[name] = path.stat().st_size
            except ProtocolError as exc:  # a torn or foreign file: say so, start without it
                self.out(f"warning: ignoring {path}: {exc}")
        loaded["seen_ids"] = self.ingest.load_seen()
        return loaded

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trust-state", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.write()
            except Exception as exc:  # never take the coordinator down for a status file
                self.out(f"warning: trust state not written: {exc}")

    def write(self) -> None:
        with self._write_lock:
            self.ingest.save_seen()
            write_atomic(self.run_dir / "replay.bin", self.ingest.state_bytes())
            if self.access is not None:
                write_atomic(self.run_dir / "access.bin", self.access.state_bytes())
            if self.lease_desk is not None:
                write_atomic(self.run_dir / "lease_replay.bin", self.lease_desk.state_bytes())
            if self.auditor is not None and self.auditor.enabled:
                write_atomic(self.run_dir / self.engines_file, json.dumps(self.auditor.policy.state()).encode())
            write_atomic(self.run_dir / "trust.json", json.dumps(self.status(), indent=1).encode())

    def status(self) -> dict:
        view = self.ingest.trust_view(MAX_LISTED)
        books = dict(view.books)
        board = self.ingest.board  # its own lock, taken after the ingest lock is released
        if board is not None:
            leases = board.counts()
            books.update(prompts_retired=leases["retired_records"], retired_prompt_ids=board.retired_prompt_ids(),
                         leases_expired=leases["expired"])
        return {
            "clients": view.clients,
            "access": self.access.status() if self.access is not None else None,
            "audit": self.auditor.status() if self.auditor is not None else None,
            "verdicts": view.verdicts,
            "books": books,
        }

    def stop(self) -> None:
        self._stop.set()
        try:
            self.write()
        except Exception as exc:
            self.out(f"warning: trust state not written at exit: {exc}")
