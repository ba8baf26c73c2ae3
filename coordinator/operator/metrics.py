"""Metrics: learner and swarm numbers for the dashboard, `/metrics` (Prometheus) and `status`.

Two pieces, one job each:
  RunStats         consumes the coordinator's RunLog events (`step`, `publish`, `batch`, `dropped`) and
                   keeps counters plus bounded curves (reward, staleness) and throughput windows.
                   It never looks at the coordinator: the events are its only input.
  SwarmCollector   a prometheus_client custom collector. At each scrape it calls a snapshot function
                   (the Coordinator's read-only `snapshot()`) and turns the dict into metric families,
                   so nothing is double-counted and no gauge can go stale between scrapes.

Metric names (all prefixed `asyncrl_`): learner_steps_total, adapter_version,
adapter_versions_published_total, adapter_publish_bytes_total{kind}, adapter_last_publish_timestamp_seconds,
adapter_published_version, adapter_versions_superseded_total, adapter_publish_queue_depth,
adapter_publish_latency_seconds, adapter_publish_in_flight_seconds,
learner_reward_mean, learner_reward_moving_avg, learner_loss, learner_clip_fraction, learner_is_ess,
learner_masked_fraction, learner_log_ratio_m2, learner_is_weight_m2, learner_step_seconds,
learner_grad_norm, learner_token_entropy, learner_lr, learner_step_tokens_per_second,
learner_staleness_versions (histogram over trained groups), learner_groups_trained_total,
learner_groups_dropped_stale_total, learner_queued_groups, learner_tokens_per_second, swarm_batches_accepted_total,
swarm_batches_rejected_total{code}, swarm_rollouts_total, swarm_rollouts_per_second,
swarm_volunteers{state=live|known}, swarm_volunteer_version_lag{volunteer}, leases{state}.

The registry is private to each coordinator (never prometheus_client's global one), so several
coordinators in one process (tests) do not collide.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Callable

from .plots import SMOOTH_WINDOW, moving_average
from .reward_log import per_reward_table

LIVE_WINDOW_S = 120.0
"""A volunteer counts as live when it leased or uploaded within this many seconds."""
THROUGHPUT_WINDOW_S = 60.0
CURVE_POINTS = 400
"""Most points per curve handed to the dashboard (older history is thinned, not dropped)."""
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
OFF_POLICY_FIELDS = ("ess", "masked_fraction", "log_ratio_m2", "is_weight_m2")
"""Per-step off-policy figures of the loss (coordinator/learner/corrections.py `off_policy_stats`)."""
OFF_POLICY_WINDOW = 50
"""Steps averaged for the dashboard's masked-by-staleness breakdown."""


class RunStats:
    """Counters and curves built from RunLog events. Thread-safe (events arrive on the learner and the
    publisher threads, snapshots are taken on the dashboard's)."""

    def __init__(self, *, group_size: int, history: int = 20000, clock: Callable[[], float] = time.time):
        self.group_size = group_size
        self.clock = clock
        self._lock = threading.Lock()
        self.steps: deque[dict] = deque(maxlen=history)
        self.publishes: deque[dict] = deque(maxlen=50)
        self.versions_published = 0
        self.versions_superseded = 0  # never published: a newer version replaced them on the publisher thread
        self.publish_bytes = 0
        self.publish_raw_bytes = 0
        self.groups_trained = 0
        self.groups_dropped_stale = 0
        self.staleness_counts: Counter[int] = Counter()
        self.rollouts_by_client: Counter[str] = Counter()
        self.rollouts_total = 0
        self._rollout_times: deque[tuple[float, int]] = deque()
        self._step_times: deque[tuple[float, int]] = deque()  # (time, tokens trained)

    def observe(self, event: str, fields: dict) -> None:
        now = fields.get("t", self.clock())
        with self._lock:
            if event == "step":
                stale = list(fields.get("staleness") or [])
                self.steps.append({
                    "step": fields["step"], "t": now, "version": fields.get("version"),
                    "reward": fields.get("reward_mean"), "loss": fields.get("loss"),
                    "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
                    "staleness_max": max(stale) if stale else 0,
                    "groups": fields.get("groups", 0), "clip_fraction": fields.get("clip_fraction"),
                    "seconds": fields.get("seconds"), "grad_norm": fields.get("grad_norm"),
                    "entropy": fields.get("entropy_mean"), "lr": fields.get("lr"),
                    "tokens_per_s": fields.get("tokens_per_s"), "episode_replay_ms": fields.get("episode_replay_ms"),
                    **{k: fields.get(k) for k in OFF_POLICY_FIELDS},
                    "masked_by_staleness": dict(fields.get("masked_by_staleness") or {}),
                    "rewards": per_reward_table(fields)})  # {name: {"mean", "std"}} (reward_log.py)
                self.groups_trained += fields.get("groups", 0)
                self.groups_dropped_stale += fields.get("dropped_stale", 0)
                self.staleness_counts.update(stale)
                self._step_times.append((now, fields.get("tokens") or 0))
            elif event == "publish":
                self.versions_published += 1
                self.publish_bytes += fields.get("compressed_bytes", 0)
                self.publish_raw_bytes += fields.get("raw_bytes", 0)
                self.publishes.append({"version": fields.get("version"), "t": now, "codec": fields.get("codec"),
                                       "compressed_bytes": fields.get("compressed_bytes"),
                                       "raw_bytes": fields.get("raw_bytes"), "latency_s": fields.get("latency_s")})
                self.versions_superseded = fields.get("superseded_total", self.versions_superseded)
            elif event == "batch":
                n = fields.get("groups", 0) * self.group_size
                self.rollouts_by_client[fields.get("client", "?")] += n
                self.rollouts_total += n
                self._rollout_times.append((now, n))
            elif event == "dropped":
                self.groups_dropped_stale += fields.get("groups", 0)
            self._prune(now)  # bounded even when nobody ever takes a snapshot (no dashboard open)

    def _prune(self, now: float) -> None:
        while self._rollout_times and self._rollout_times[0][0] < now - THROUGHPUT_WINDOW_S:
            self._rollout_times.popleft()
        while self._step_times and self._step_times[0][0] < now - THROUGHPUT_WINDOW_S:
            self._step_times.popleft()

    def snapshot(self) -> dict:
        now = self.clock()
        with self._lock:
            self._prune(now)
            steps = list(self.steps)
            last = steps[-1] if steps else None
            rewards = [s["reward"] for s in steps]
            avg = moving_average(rewards)
            stride = max(1, -(-len(steps) // CURVE_POINTS))
            keep = list(range(len(steps) - 1, -1, -stride))[::-1]
            by_gap: dict[str, list[float]] = {}
            for st in steps[-OFF_POLICY_WINDOW:]:
                for gap, frac in st["masked_by_staleness"].items():
                    by_gap.setdefault(gap, []).append(frac)
            return {
                "steps": last["step"] if last else 0,
                "last_step": last,
                "reward_moving_avg": avg[-1] if avg else None,
                "per_reward": last["rewards"] if last else {},  # the last step's {name: {"mean", "std"}}
                "smooth_window": SMOOTH_WINDOW,
                "groups_trained": self.groups_trained,
                "groups_dropped_stale": self.groups_dropped_stale,
                "versions_published": self.versions_published,
                "versions_superseded": self.versions_superseded,
                "publish_bytes": self.publish_bytes,
                "publish_raw_bytes": self.publish_raw_bytes,
                "publishes": list(self.publishes)[-20:][::-1],
                "staleness_counts": {str(k): v for k, v in sorted(self.staleness_counts.items())},
                "rollouts_total": self.rollouts_total,
                "rollouts_by_client": dict(self.rollouts_by_client),
                "throughput": {
                    "window_s": THROUGHPUT_WINDOW_S,
                    "rollouts_per_s": sum(n for _, n in self._rollout_times) / THROUGHPUT_WINDOW_S,
                    "steps_per_min": len(self._step_times) * 60.0 / THROUGHPUT_WINDOW_S,
                    "tokens_per_s": sum(n for _, n in self._step_times) / THROUGHPUT_WINDOW_S,
                },
                "off_policy": {
                    "window_steps": OFF_POLICY_WINDOW,
                    "masked_by_staleness": {g: sum(by_gap[g]) / len(by_gap[g]) for g in sorted(by_gap, key=_band_low)},
                },
                "curves": {
                    "step": [steps[i]["step"] for i in keep],
                    **{k: [steps[i][k] for i in keep] for k in ("ess", "masked_fraction")},
                    "reward": [rewards[i] for i in keep],
                    "reward_avg": [avg[i] for i in keep],
                    "staleness": [steps[i]["staleness_mean"] for i in keep],
                    "staleness_max": [steps[i]["staleness_max"] for i in keep],
                },
            }


def _band_low(label: str) -> int:
    """The lowest version gap of a masked-by-staleness band label ("2", "3-4", "129+"), for ordering."""
    return int(label.split("-")[0].rstrip("+"))


class SwarmCollector:
    """prometheus_client custom collector over the coordinator's `snapshot()` dict."""

    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def describe(self):
        return []  # do not call snapshot() at registration time

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snap = self.snapshot()
        run, learner, stats = snap["run"], snap["learner"], snap["stats"]
        last = stats.get("last_step") or {}

        def gauge(name, doc, value, labels=None, **kw):
            fam = GaugeMetricFamily(f"asyncrl_{name}", doc, labels=list(labels or {}) or None, **kw)
            if value is not None:
                fam.add_metric(list((labels or {}).values()), value)
            return fam

        def counter(name, doc, value):
            return CounterMetricFamily(f"asyncrl_{name}", doc, value=value)

        info = GaugeMetricFamily("asyncrl_run_info", "Static facts about this run (value is always 1).",
                                 labels=["run_id", "model", "fingerprint"])
        info.add_metric([run["run_id"], run["model"], run["fingerprint"]], 1)
        yield info
        yield counter("learner_steps", "Optimizer steps taken.", learner["steps"])
        yield gauge("adapter_version", "The learner's adapter version (the newest exported).", learner["version"])
        yield counter("adapter_versions_published", "Adapter versions published.", stats["versions_published"])
        pub = CounterMetricFamily("asyncrl_adapter_publish_bytes", "Adapter bytes published (compressed payload, "
                                  "raw tensors).", labels=["kind"])
        pub.add_metric(["compressed"], stats["publish_bytes"])
        pub.add_metric(["raw"], stats["publish_raw_bytes"])
        yield pub
        publishes = stats.get("publishes") or []
        yield gauge("adapter_last_publish_timestamp_seconds", "Unix time of the latest publish.",
                    publishes[0]["t"] if publishes else None)
        publisher = snap.get("publisher") or {}
        yield gauge("adapter_published_version", "Newest adapter version volunteers can fetch.",
                    publisher.get("published_version"))
        yield counter("adapter_versions_superseded", "Versions replaced by a newer one before they were published.",
                      publisher.get("superseded", stats.get("versions_superseded", 0)))
        yield gauge("adapter_publish_queue_depth", "Exported versions waiting for the publisher thread (0 or 1).",
                    publisher.get("queue_depth"))
        yield gauge("adapter_publish_latency_seconds", "Export to pointer stored, latest publish.",
                    publisher.get("last_latency_s"))
        yield gauge("adapter_publish_in_flight_seconds", "How long the publish in progress has taken so far.",
                    publisher.get("in_flight_s"))
        yield gauge("learner_reward_mean", "Mean reward of the groups in the latest step.", last.get("reward"))
        yield gauge("learner_reward_moving_avg", "Moving average of the per-step mean reward.",
                    stats.get("reward_moving_avg"))
        yield gauge("learner_loss", "Loss of the latest step.", last.get("loss"))
        yield gauge("learner_clip_fraction", "Fraction of tokens clipped in the latest step.", last.get("clip_fraction"))
        yield gauge("learner_is_ess", "Normalised effective sample size of the latest step's token IS weights "
                    "pi/mu (1 = on-policy).", last.get("ess"))
        yield gauge("learner_masked_fraction", "Fraction of the latest step's completion tokens the off-policy "
                    "correction left without gradient (clipped, capped or masked).",
                    last.get("masked_fraction"))
        yield gauge("learner_log_ratio_m2", "Mean squared log importance ratio log(pi/mu) of the latest step "
                    "(M2PO's second moment).", last.get("log_ratio_m2"))
        yield gauge("learner_is_weight_m2", "Second moment of the latest step's token IS weights pi/mu.",
                    last.get("is_weight_m2"))
        yield gauge("learner_step_seconds", "Wall time of the latest optimizer step.", last.get("seconds"))
        yield gauge("learner_grad_norm", "Gradient norm of the latest step, before clipping.", last.get("grad_norm"))
        yield gauge("learner_token_entropy", "Mean policy entropy (nats) over the latest step's completion tokens.",
                    last.get("entropy"))
        yield gauge("learner_lr", "Learning rate used by the latest step.", last.get("lr"))
        yield gauge("ingest_episode_replay_ms", "Median time ingest spent replaying one multi-turn episode "
                    "(coordinator/ingest/episodes.py), recent episodes; absent without episodes.",
                    last.get("episode_replay_ms"))
        yield gauge("learner_step_tokens_per_second", "Tokens (prompt + completion) through forward and backward "
                    "per second of the latest step.", last.get("tokens_per_s"))
        hist = HistogramMetricFamily("asyncrl_learner_staleness_versions",
                                     "Staleness (versions behind) of each trained group.")
        counts = {int(k): v for k, v in stats["staleness_counts"].items()}
        cumulative, buckets = 0, []
        for bound in STALENESS_BUCKETS:
            cumulative = sum(v for k, v in counts.items() if k <= bound)
            buckets.append((str(float(bound)), cumulative))
        total = sum(counts.values())
        buckets.append(("+Inf", total))
        hist.add_metric([], buckets, sum_value=float(sum(k * v for k, v in counts.items())))
        yield hist
        yield counter("learner_groups_trained", "Prompt groups used by optimizer steps.", stats["groups_trained"])
        yield counter("learner_groups_dropped_stale", "Groups dropped for exceeding max_staleness.",
                      stats["groups_dropped_stale"])
        yield gauge("learner_queued_groups", "Groups accepted and waiting for the learner.", learner["queued_groups"])

        vols = snap["volunteers"]
        yield counter("swarm_batches_accepted", "Rollout batches accepted from volunteers.",
                      sum(v["accepted"] for v in vols))
        rejected = CounterMetricFamily("asyncrl_swarm_batches_rejected", "Rollout batches rejected, by reject code.",
                                       labels=["code"])
        by_code: Counter[str] = Counter()
        for v in vols:
            by_code.update(v["rejected"])
        for code, n in sorted(by_code.items()):
            rejected.add_metric([code], n)
        yield rejected
        yield gauge("learner_tokens_per_second", f"Completion tokens trained per second over the last "
                    f"{THROUGHPUT_WINDOW_S:.0f} s.", stats["throughput"]["tokens_per_s"])
        yield counter("swarm_rollouts", "Completions in accepted batches.", stats["rollouts_total"])
        yield gauge("swarm_rollouts_per_second", f"Accepted completions per second over the last "
                    f"{THROUGHPUT_WINDOW_S:.0f} s.", stats["throughput"]["rollouts_per_s"])
        state = GaugeMetricFamily("asyncrl_swarm_volunteers", "Volunteers seen (live = within "
                                  f"{LIVE_WINDOW_S:.0f} s).", labels=["state"])
        state.add_metric(["live"], sum(1 for v in vols if v["live"]))
        state.add_metric(["known"], len(vols))
        yield state
        lag = GaugeMetricFamily("asyncrl_swarm_volunteer_version_lag",
                                "Versions between the published adapter and the one a volunteer holds.",
                                labels=["volunteer", "fingerprint"])
        for v in vols:
            if v["lag"] is not None:
                lag.add_metric([v["name"], v["fingerprint"]], v["lag"])
        yield lag
        leases = GaugeMetricFamily("asyncrl_leases", "Task-board lease counters.", labels=["state"])
        for k, n in sorted(snap["leases"].items()):
            leases.add_metric([k], n)
        yield leases


def make_registry(snapshot: Callable[[], dict]):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(snapshot))
    return registry


def merge_presence(clients: list[dict], presence: list[dict]) -> list[dict]:
    """Fold the volunteers' DHT presence records (transport's PresenceTracker: peer_id, name,
    adapter_version, last_seen, ...) into ingest's per-key stats, matched by key fingerprint. The
    presence record's adapter_version becomes `version_held`; a volunteer known only from presence
    (announced, nothing uploaded yet) gets a row of its own."""
    from asyncrl.protocol.identity import fingerprint, public_key_from_peer_id

    rows = {c["fingerprint"]: dict(c) for c in clients}
    for rec in presence:
        try:
            fp = fingerprint(public_key_from_peer_id(rec["peer_id"]))
        except Exception:  # not an Ed25519 peer id: nothing to match it with
            continue
        row = rows.setdefault(fp, {"name": rec.get("name") or fp, "fingerprint": fp, "accepted": 0,
                                   "rejected": {}, "last_version": -1, "last_seen": 0.0})
        if rec.get("adapter_version") is not None and rec["adapter_version"] >= 0:
            row["version_held"] = rec["adapter_version"]
        row["last_seen"] = max(row.get("last_seen") or 0.0, rec.get("last_seen") or 0.0)
    return list(rows.values())


def volunteer_rows(clients: list[dict], *, version: int, rollouts_by_client: dict[str, int],
                   now: float) -> list[dict]:
    """The swarm table: one row per volunteer (ingest's ClientStats as dicts, after merge_presence).

    "version held" is the volunteer's announced adapter version (`version_held`, from its presence
    record) or, without one, the version of its latest accepted batch."""
    rows = []
    for c in clients:
        held = c.get("version_held")
        if held is None:
            held = c.get("last_version", -1)
        held = None if held is None or held < 0 else int(held)
        seen = c.get("last_seen") or 0.0
        rows.append({
            "name": c["name"], "fingerprint": c["fingerprint"],
            "version_held": held, "lag": None if held is None else max(0, version - held),
            "rollouts": int(rollouts_by_client.get(c["name"], 0)),
            "accepted": int(c.get("accepted", 0)), "rejected": dict(c.get("rejected") or {}),
            "last_seen": seen, "age_s": max(0.0, now - seen) if seen else None,
            "live": bool(seen) and now - seen <= LIVE_WINDOW_S,
            "canary": c.get("canary", ""),  # its last adapter-identity check (models/canary.py)
        })
    rows.sort(key=lambda r: -(r["last_seen"] or 0))
    return rows
