"""Telemetry: everything the operator watches, behind one object the coordinator hub wires in.

Components (one job each; none references the Coordinator — they get events and a snapshot function):
  RunStats       (coordinator/operator/metrics.py)   counters and curves from RunLog events
  Reporters      (coordinator/operator/reporters.py) optional TensorBoard / W&B / trackio sinks
  PlotOnDemand   (coordinator/operator/plots.py)         reward.png on SIGUSR1; a final one at close()
  Dashboard      (coordinator/operator/dashboard.py) status page, /api/status, /metrics, /plot.png over HTTP

The hub calls `observe(event, fields)` for every metrics.jsonl event (RunLog listener),
`start_dashboard(snapshot)` once the swarm is up, `snapshot_part(...)` from its own `snapshot()`,
and `close()` at shutdown.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

from ..config import CoordinatorConfig
from .metrics import RunStats, make_registry, merge_presence, volunteer_rows
from .plots import PlotOnDemand, plot_run
from .reporters import Reporters


class Telemetry:
    def __init__(self, cfg: CoordinatorConfig, run_dir: Path, *, out=print):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.out = out
        self.started_at = time.time()
        self.stats = RunStats(group_size=cfg.group_size)
        self.reporters = Reporters(cfg.report_to, run_dir=self.run_dir, run_id=cfg.run_id,
                                   config=json.loads(cfg.to_json()), out=out)
        self.plots = PlotOnDemand(self.run_dir)
        self.dashboard = None
        self.registry = None
        self._observe_failed = False

    def observe(self, event: str, fields: dict) -> None:
        """RunLog listener (learner thread). Watching must never stop training: errors are reported once."""
        try:
            self.stats.observe(event, fields)
            self.reporters.observe(event, fields)
        except Exception as exc:
            if not self._observe_failed:
                self._observe_failed = True
                self.out(f"warning: telemetry could not digest a {event!r} event: {exc.__class__.__name__}: {exc}")

    def request_plot(self) -> None:
        """Redraw <run_dir>/reward.png soon (safe to call from a signal handler)."""
        self.plots.request()

    def start_dashboard(self, snapshot: Callable[[], dict]) -> str | None:
        self.registry = make_registry(snapshot)
        if not self.cfg.dashboard:
            return None
        from .dashboard import Dashboard

        self.dashboard = Dashboard(snapshot=snapshot, registry=self.registry, run_dir=self.run_dir,
                                   host=self.cfg.dashboard_host, port=self.cfg.dashboard_port)
        url = self.dashboard.start()
        self.out(f"dashboard {url}  (Prometheus: {url}metrics)")
        return url

    def snapshot_part(self, *, version: int, steps: int, clients: list, leases: dict, queued_groups: int,
                      identity: dict, presence: list[dict] = (), publisher: dict | None = None,
                      waiting: dict | None = None, contributors: list[dict] = (), audit: dict | None = None,
                      completions: list[dict] = (), reward_errors: dict | None = None,
                      handshake_refusals: dict | None = None,
                      capacity: dict | None = None) -> dict:
        """The read-only status dict (the schema of /api/status). No key material ever enters it."""
        now = time.time()
        stats = self.stats.snapshot()
        clients = merge_presence([c if isinstance(c, dict) else dataclasses.asdict(c) for c in clients],
                                 list(presence))
        rows = volunteer_rows(clients, version=version, rollouts_by_client=stats["rollouts_by_client"], now=now)
        cfg = self.cfg
        join = identity.get("join_address")
        return {
            "time": now,
            "run": {"run_id": cfg.run_id, "model": identity.get("model", cfg.model), "task": cfg.task,
                    "fingerprint": identity.get("fingerprint"), "peer_id": identity.get("peer_id"),
                    "join_address": join, "join_command": f"asyncrl-client join {join}" if join else None,
                    "started_at": self.started_at, "uptime_s": now - self.started_at, "max_steps": cfg.max_steps,
                    "dashboard_url": self.dashboard.url if self.dashboard else None},
            "learner": {"steps": steps, "version": version, "max_staleness": cfg.max_staleness,
                        "queued_groups": queued_groups, "groups_per_step": cfg.groups_per_step,
                        "waiting_for_volunteers": waiting},  # {"needed", "joined"} until --wait-for-volunteers is met
            "leases": dict(leases),
            # PublishWorker.stats(): published_version, superseded, queue_depth, in_flight(_s), last_latency_s
            "publisher": dict(publisher or {}),
            "volunteers": rows,
            # capacity.py: learner idle fraction, rollouts/s needed vs delivered, more volunteers needed
            "capacity": dict(capacity or {}),
            # name, fingerprint, accepted batches/tokens (receipts), trained groups and share: publishable
            "contributors": list(contributors),
            # generation audit: per engine class (kind/dtype) "learning" (samples/needed) or "learned", its tolerance
            "audit": audit,
            "stats": stats,
            # coordinator/operator/reward_log.py: the latest sampled completions with their rewards, and what
            # volunteers' reward functions raised
            "completions": list(completions),
            "reward_errors": dict(reward_errors or {"total": 0, "recent": []}),
            # volunteers the handshake turned away (version gate, a missing reward package): client = its release
            "handshake_refusals": dict(handshake_refusals or {"total": 0, "recent": []}),
        }

    def close(self) -> None:
        """Stop serving, write the final plot, close trackers. Never raises."""
        for what, fn in (("dashboard", self.dashboard.stop if self.dashboard else None),
                         ("plot thread", self.plots.close), ("final plot", lambda: plot_run(self.run_dir)),
                         ("reporters", self.reporters.close)):
            if fn is None:
                continue
            try:
                fn()
            except Exception as exc:
                self.out(f"warning: {what}: {exc.__class__.__name__}: {exc}")
