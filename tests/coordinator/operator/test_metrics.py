"""RunStats from RunLog events, the swarm table, and the Prometheus exposition built from a snapshot."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.coordinator.config import ConfigError
from asyncrl.coordinator.operator.metrics import LIVE_WINDOW_S, RunStats, make_registry, merge_presence, volunteer_rows
from asyncrl.coordinator.operator.reporters import Reporters, check_available


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def feed(stats: RunStats, clock: FakeClock) -> None:
    stats.observe("publish", {"t": clock.t, "version": 0, "codec": "k", "compressed_bytes": 100, "raw_bytes": 400})
    for step in range(1, 4):
        clock.t += 1
        stats.observe("batch", {"t": clock.t, "client": "alice", "groups": 2, "version": step - 1})
        stats.observe("batch", {"t": clock.t, "client": "bob", "groups": 1, "version": step - 1})
        stats.observe("step", {"t": clock.t, "step": step, "version": step - 1, "reward_mean": 0.1 * step,
                               "loss": -0.5, "groups": 3, "dropped_stale": 0, "staleness": [0, 1, 2],
                               "clip_fraction": 0.1, "seconds": 0.2, "tokens": 20, "grad_norm": 0.5 * step,
                               "entropy_mean": 2.0, "lr": 1e-3, "tokens_per_s": 100.0, "ess": 1.0 - 0.1 * step,
                               "masked_fraction": 0.05 * step, "log_ratio_m2": 0.01 * step, "is_weight_m2": 1.5,
                               "masked_by_staleness": {"0": 0.0, "129+": 0.3, "3-4": 0.05 * step,
                                                       "2": 0.1 * step}})
        stats.observe("publish", {"t": clock.t, "version": step, "codec": "d", "compressed_bytes": 10,
                                  "raw_bytes": 400})
    stats.observe("dropped", {"t": clock.t, "groups": 2, "reason": "stale"})


def test_run_stats_counts_events():
    clock = FakeClock()
    stats = RunStats(group_size=4, clock=clock)
    feed(stats, clock)
    s = stats.snapshot()
    assert s["steps"] == 3 and s["versions_published"] == 4
    assert s["publish_bytes"] == 130 and s["publish_raw_bytes"] == 1600
    assert s["groups_trained"] == 9 and s["groups_dropped_stale"] == 2
    assert s["rollouts_by_client"] == {"alice": 24, "bob": 12} and s["rollouts_total"] == 36
    assert s["staleness_counts"] == {"0": 3, "1": 3, "2": 3}
    assert s["curves"]["step"] == [1, 2, 3]
    assert s["curves"]["reward"] == pytest.approx([0.1, 0.2, 0.3])
    assert s["curves"]["reward_avg"] == pytest.approx([0.1, 0.15, 0.2])
    assert s["curves"]["staleness"] == pytest.approx([1.0, 1.0, 1.0])
    assert s["publishes"][0]["version"] == 3  # newest first
    assert s["curves"]["ess"] == pytest.approx([0.9, 0.8, 0.7])
    assert s["curves"]["masked_fraction"] == pytest.approx([0.05, 0.1, 0.15])
    assert s["last_step"]["log_ratio_m2"] == pytest.approx(0.03) and s["last_step"]["is_weight_m2"] == 1.5
    # masked-by-staleness: each gap's fraction averaged over the recent steps
    # (the learner's band labels, STALENESS_BAND_LABELS, in order of their version gap)
    assert s["off_policy"]["masked_by_staleness"] == pytest.approx({"0": 0.0, "2": 0.2, "3-4": 0.1, "129+": 0.3})
    assert list(s["off_policy"]["masked_by_staleness"]) == ["0", "2", "3-4", "129+"]
    assert s["throughput"]["rollouts_per_s"] == pytest.approx(36 / 60)
    assert s["throughput"]["tokens_per_s"] == pytest.approx(60 / 60)
    clock.t += 3600  # the throughput window forgets, the totals do not
    s = stats.snapshot()
    assert s["throughput"]["rollouts_per_s"] == 0 and s["rollouts_total"] == 36


def test_curves_are_thinned_to_a_bounded_size_but_keep_the_latest_step():
    clock = FakeClock()
    stats = RunStats(group_size=2, clock=clock)
    for step in range(1, 2001):
        stats.observe("step", {"t": clock.t, "step": step, "reward_mean": 0.5, "staleness": [0]})
    curves = stats.snapshot()["curves"]
    assert len(curves["step"]) <= 400 and curves["step"][-1] == 2000


def test_volunteer_rows_compute_lag_and_liveness():
    now = 5000.0
    clients = [
        {"name": "alice", "fingerprint": "aa", "accepted": 3, "rejected": {}, "last_version": 7, "last_seen": now - 1},
        {"name": "bob", "fingerprint": "bb", "accepted": 0, "rejected": {"STALE_VERSION": 2}, "last_version": -1,
         "last_seen": now - LIVE_WINDOW_S - 5},
        {"name": "carol", "fingerprint": "cc", "accepted": 1, "rejected": {}, "last_version": 2, "version_held": 9,
         "last_seen": now},
    ]
    rows = {r["name"]: r for r in volunteer_rows(clients, version=9, rollouts_by_client={"alice": 48}, now=now)}
    assert rows["alice"]["version_held"] == 7 and rows["alice"]["lag"] == 2 and rows["alice"]["live"]
    assert rows["alice"]["rollouts"] == 48
    assert rows["bob"]["version_held"] is None and rows["bob"]["lag"] is None and not rows["bob"]["live"]
    assert rows["carol"]["version_held"] == 9 and rows["carol"]["lag"] == 0  # a presence record wins


def test_presence_records_supply_the_version_held():
    from asyncrl.protocol.identity import Identity

    alice, bob = Identity.from_seed(b"a" * 32), Identity.from_seed(b"b" * 32)
    clients = [{"name": "alice", "fingerprint": alice.fingerprint, "accepted": 4, "rejected": {},
                "last_version": 3, "last_seen": 100.0}]
    presence = [{"peer_id": alice.peer_id, "name": "alice", "adapter_version": 6, "last_seen": 120.0},
                {"peer_id": bob.peer_id, "name": "bob", "adapter_version": 5, "last_seen": 119.0},
                {"peer_id": "not-a-peer-id", "name": "mallory", "adapter_version": 1, "last_seen": 1.0}]
    rows = {r["name"]: r for r in volunteer_rows(merge_presence(clients, presence), version=7,
                                                 rollouts_by_client={}, now=120.0)}
    assert set(rows) == {"alice", "bob"}
    assert rows["alice"]["version_held"] == 6 and rows["alice"]["lag"] == 1 and rows["alice"]["accepted"] == 4
    assert rows["alice"]["last_seen"] == 120.0
    assert rows["bob"]["fingerprint"] == bob.fingerprint and rows["bob"]["lag"] == 2 and rows["bob"]["accepted"] == 0


def snapshot_for(stats: RunStats, clients: list[dict], version: int) -> dict:
    s = stats.snapshot()
    return {"time": 0, "run": {"run_id": "r", "model": "m", "fingerprint": "ff"},
            "learner": {"steps": s["steps"], "version": version, "queued_groups": 5},
            "leases": {"outstanding": 2, "completed": 9}, "stats": s,
            "volunteers": volunteer_rows(clients, version=version, rollouts_by_client=s["rollouts_by_client"],
                                         now=clients[0]["last_seen"])}


def test_prometheus_exposition_has_learner_and_swarm_metrics():
    clock = FakeClock()
    stats = RunStats(group_size=4, clock=clock)
    feed(stats, clock)
    clients = [{"name": "alice", "fingerprint": "aa", "accepted": 3, "rejected": {"REWARD_MISMATCH": 1},
                "last_version": 2, "last_seen": clock.t},
               {"name": "bob", "fingerprint": "bb", "accepted": 3, "rejected": {"REWARD_MISMATCH": 2, "NONCE_REUSED": 1},
                "last_version": 3, "last_seen": clock.t}]
    registry = make_registry(lambda: snapshot_for(stats, clients, version=3))
    text = generate_latest(registry).decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("asyncrl_learner_steps_total", ())] == 3
    assert samples[("asyncrl_adapter_version", ())] == 3
    assert samples[("asyncrl_adapter_versions_published_total", ())] == 4
    assert samples[("asyncrl_adapter_publish_bytes_total", (("kind", "compressed"),))] == 130
    assert samples[("asyncrl_learner_reward_mean", ())] == pytest.approx(0.3)
    assert samples[("asyncrl_learner_loss", ())] == pytest.approx(-0.5)
    assert samples[("asyncrl_learner_is_ess", ())] == pytest.approx(0.7)
    assert samples[("asyncrl_learner_masked_fraction", ())] == pytest.approx(0.15)
    assert samples[("asyncrl_learner_log_ratio_m2", ())] == pytest.approx(0.03)
    assert samples[("asyncrl_learner_is_weight_m2", ())] == pytest.approx(1.5)
    assert samples[("asyncrl_learner_staleness_versions_bucket", (("le", "1.0"),))] == 6
    assert samples[("asyncrl_learner_staleness_versions_count", ())] == 9
    assert samples[("asyncrl_learner_queued_groups", ())] == 5
    assert samples[("asyncrl_swarm_batches_accepted_total", ())] == 6
    assert samples[("asyncrl_swarm_batches_rejected_total", (("code", "REWARD_MISMATCH"),))] == 3
    assert samples[("asyncrl_swarm_batches_rejected_total", (("code", "NONCE_REUSED"),))] == 1
    assert samples[("asyncrl_swarm_rollouts_total", ())] == 36
    assert samples[("asyncrl_learner_tokens_per_second", ())] == pytest.approx(1.0)
    assert samples[("asyncrl_learner_grad_norm", ())] == pytest.approx(1.5)  # the latest step's
    assert samples[("asyncrl_learner_token_entropy", ())] == pytest.approx(2.0)
    assert samples[("asyncrl_learner_lr", ())] == pytest.approx(1e-3)
    assert samples[("asyncrl_learner_step_tokens_per_second", ())] == pytest.approx(100.0)
    assert samples[("asyncrl_swarm_volunteers", (("state", "live"),))] == 2
    assert samples[("asyncrl_swarm_volunteer_version_lag", (("fingerprint", "aa"), ("volunteer", "alice")))] == 1
    assert samples[("asyncrl_leases", (("state", "outstanding"),))] == 2


def nothing_installed(module: str):
    return None


def test_trackers_asked_for_but_missing_are_config_errors():
    with pytest.raises(ConfigError):
        check_available(["wandb"], find_spec=nothing_installed)
    with pytest.raises(ConfigError):
        check_available(["tensorboard", "trackio"], find_spec=nothing_installed)
    with pytest.raises(ConfigError):
        check_available(["mlflow"])
    check_available([], find_spec=nothing_installed)


class BrokenSink:
    """A tracker that fails on every log call: it must be switched off, never raise into training."""

    def __init__(self):
        self.calls = 0

    def log(self, row, step):
        self.calls += 1
        raise RuntimeError("tracker down")


class RecordingSink:
    def __init__(self):
        self.rows = []

    def log(self, row, step):
        self.rows.append((step, row))


def test_trackers_get_grad_norm_entropy_lr_and_tokens_per_s(tmp_path):
    reporters = Reporters([], run_dir=tmp_path, run_id="r", config={}, out=lambda s: None)
    sink = RecordingSink()
    reporters.sinks["rec"] = (sink.log, lambda: None)
    reporters.observe("step", {"step": 4, "reward_mean": 0.5, "staleness": [0], "grad_norm": 0.25,
                               "entropy_mean": 1.5, "lr": 2e-3, "tokens_per_s": 900.0})
    (step, row), = sink.rows
    assert step == 4 and row["grad_norm"] == 0.25 and row["entropy"] == 1.5 and row["lr"] == 2e-3
    assert row["tokens_per_s"] == 900.0


def test_a_failing_tracker_is_switched_off(tmp_path):
    reporters = Reporters([], run_dir=tmp_path, run_id="r", config={}, out=lambda s: None)
    sink = BrokenSink()
    reporters.sinks["broken"] = (sink.log, lambda: None)
    for step in (1, 2):
        reporters.observe("step", {"step": step, "reward_mean": 0.5, "staleness": [0]})
    assert sink.calls == 1 and not reporters.sinks
