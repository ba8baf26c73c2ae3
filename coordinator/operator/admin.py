"""Operator subcommands that do not train: `status`, `keys`, `example-config`, `export`, `eval`.

    asyncrl-coordinator status --run-dir runs/demo        # asks the running coordinator's dashboard
    asyncrl-coordinator status --config coordinator.toml --json
    asyncrl-coordinator keys --run-dir runs/demo          # fingerprint + peer id of the run's key
    asyncrl-coordinator keys --run-dir runs/new --new     # create a key (never overwrites one)
    asyncrl-coordinator example-config > configs/coordinator.example.toml
    asyncrl-coordinator export --run-dir runs/r1 --out out/adapter [--merge]   # coordinator/operator/export.py
    asyncrl-coordinator eval --run-dir runs/r1 --n 200    # greedy accuracy on the eval split (operator/evaluate.py)
    asyncrl-coordinator finish --run-dir runs/demo        # end the run for good: volunteers exit with their summary

`status` reads the dashboard URL from <run_dir>/dashboard.txt (or --url) and GETs /api/status; when
no coordinator answers it falls back to what the run directory holds (summary.json, metrics.jsonl)
and exits 3. None of these commands imports torch or hivemind, and none prints private key material.

Exit codes: 0 ok · 1 nothing to show / refused · 2 bad arguments or config · 3 not running (offline view).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from asyncrl.runlog import read_events

from ..config import ConfigError, CoordinatorConfig

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_NOT_RUNNING = 0, 1, 2, 3
KEY_NAME = "coordinator.key"


def add_subcommands(sub) -> None:
    for name, helptext in (("status", "show a running coordinator's state (via its dashboard) or a run dir's"),
                           ("keys", "show the run's coordinator key (fingerprint, peer id); --new creates one"),
                           ("finish", "end the running coordinator's run for good (unlike Ctrl-C, which it can "
                                      "--resume): it tells volunteers, who exit with their summary")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--config", default=None, help="coordinator TOML file (its run_dir is used)")
        p.add_argument("--run-dir", default=None, help=f"run directory (default: {CoordinatorConfig.run_dir})")
        if name == "status":
            p.add_argument("--url", default=None, help="dashboard URL (default: read <run_dir>/dashboard.txt)")
            p.add_argument("--json", action="store_true", help="print the raw /api/status JSON")
        elif name == "keys":
            p.add_argument("--key", default=None, help=f"key file (default: <run_dir>/{KEY_NAME})")
            p.add_argument("--new", action="store_true", help="create a new key; refuses to overwrite one")
    sub.add_parser("example-config", help="print an annotated TOML config with every field at its default")
    from .export import add_subcommand

    add_subcommand(sub)
    from .evaluate import add_subcommand as add_eval

    add_eval(sub)


def run_dir_of(args) -> Path:
    if args.run_dir:
        return Path(args.run_dir)
    if args.config:
        from ..config_file import load_configs, resolve_config

        values, source = load_configs([args.config])
        return Path(resolve_config(values, source=source).run_dir)
    return Path(CoordinatorConfig.run_dir)


def main(args) -> int:
    if args.command == "export":
        from .export import main as export_main

        return export_main(args)
    if args.command == "eval":
        from .evaluate import main as eval_main

        return eval_main(args)
    try:
        if args.command == "example-config":
            from ..config_file import example_toml

            sys.stdout.write(example_toml())
            return EXIT_OK
        run_dir = run_dir_of(args)
    except ConfigError as exc:
        print(f"asyncrl-coordinator: invalid config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "finish":
        from ..run_end import request_finish

        if not (run_dir / "config.json").exists():
            print(f"asyncrl-coordinator: {run_dir} is not a run directory (no config.json)", file=sys.stderr)
            return EXIT_FAIL
        print(f"asked the coordinator of {run_dir} to finish ({request_finish(run_dir)})")
        return EXIT_OK
    return keys(args, run_dir) if args.command == "keys" else status(args, run_dir)


# ---- keys -----------------------------------------------------------------------------------------
def keys(args, run_dir: Path) -> int:
    from asyncrl.protocol.errors import ProtocolError
    from asyncrl.protocol.identity import Identity

    path = Path(args.key) if args.key else run_dir / KEY_NAME
    if args.new:
        if path.exists():
            print(f"asyncrl-coordinator: {path} already exists; refusing to overwrite a coordinator key "
                  "(volunteers trust its peer id). Move it away first if you really mean it.", file=sys.stderr)
            return EXIT_FAIL
        ident = Identity.generate()
        ident.save(path)
        print(f"created {path} (mode 600)")
    else:
        if not path.exists():
            print(f"asyncrl-coordinator: no key at {path}; `asyncrl-coordinator keys --new` creates one "
                  "(and `run` creates one on first start)", file=sys.stderr)
            return EXIT_FAIL
        try:
            ident = Identity.load(path)
        except ProtocolError as exc:
            print(f"asyncrl-coordinator: {exc.detail}", file=sys.stderr)
            return EXIT_FAIL
    print(f"key          {path}")
    print(f"fingerprint  {ident.fingerprint}")
    print(f"peer id      {ident.peer_id}")
    print(f"join addresses end in /p2p/{ident.peer_id}")
    return EXIT_OK


# ---- status ---------------------------------------------------------------------------------------
def status(args, run_dir: Path) -> int:
    from .dashboard import fetch_status

    url = args.url
    if url is None and (run_dir / "dashboard.txt").exists():
        url = (run_dir / "dashboard.txt").read_text().strip()
    snap = None
    if url:
        try:
            snap = fetch_status(url)
        except Exception as exc:  # URLError, timeouts, a stale dashboard.txt after a crash
            print(f"asyncrl-coordinator: no answer from {url} ({exc.__class__.__name__}); "
                  "showing the run directory instead", file=sys.stderr)
    if snap is not None:
        print(json.dumps(snap, indent=2) if args.json else format_status(snap))
        return EXIT_OK
    return offline_status(run_dir, as_json=args.json)


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    return f"{seconds:.0f} s ago" if seconds < 90 else f"{seconds / 60:.0f} min ago"


def _waiting(learner: dict) -> str:
    w = learner.get("waiting_for_volunteers")  # --wait-for-volunteers not met yet (coordinator/leasing/quorum.py)
    return f" (waiting for {w['joined']}/{w['needed']} volunteers)" if w else ""


def format_status(snap: dict) -> str:
    run, learner, stats, vols = snap["run"], snap["learner"], snap["stats"], snap["volunteers"]
    last = stats.get("last_step") or {}
    pub = stats["publishes"][0] if stats["publishes"] else None
    fmt = lambda x, d=3: "–" if x is None else f"{x:.{d}f}"
    lines = [
        f"run {run['run_id']} · model {run['model']} · coordinator {run['fingerprint']} · up {run['uptime_s']:.0f} s",
        f"join: {run['join_command']}",
        f"adapter v{learner['version']} (published {_ago(snap['time'] - pub['t']) if pub else 'never'}) · "
        f"steps {learner['steps']}/{run['max_steps'] or '∞'}{_waiting(learner)} · reward {fmt(last.get('reward'))} "
        f"(avg {fmt(stats.get('reward_moving_avg'))}) · staleness {fmt(last.get('staleness_mean'), 2)}",
        f"throughput {stats['throughput']['rollouts_per_s']:.1f} rollouts/s · "
        f"{stats['throughput']['steps_per_min']:.1f} steps/min · leases {snap['leases'].get('outstanding', 0)} "
        f"outstanding, {snap['leases'].get('expired', 0)} expired",
        f"volunteers {sum(v['live'] for v in vols)} live of {len(vols)} seen",
    ]
    if vols:
        lines.append(f"  {'name':<20} {'fingerprint':<24} {'held':>5} {'lag':>4} {'rollouts':>8} {'accepted':>8}  "
                     f"{'rejected':<24} last seen")
        for v in vols:
            rej = ", ".join(f"{k}×{n}" for k, n in v["rejected"].items()) or "-"
            held = "-" if v["version_held"] is None else f"v{v['version_held']}"
            lag = "-" if v["lag"] is None else str(v["lag"])
            lines.append(f"  {v['name'][:20]:<20} {v['fingerprint'][:24]:<24} {held:>5} {lag:>4} {v['rollouts']:>8} "
                         f"{v['accepted']:>8}  {rej[:24]:<24} {_ago(v['age_s'])}")
    if snap.get("capacity"):
        from .capacity import capacity_line

        lines.append(capacity_line(snap["capacity"]))
    audit = snap.get("audit") or {}
    for cls, e in (audit.get("engines") or {}).items():  # a new engine kind shows here while it learns
        lines.append(f"audit engine {cls}: {e['state']} ({e['samples']}/{e['needed']} batches), tolerance "
                     f"{e['tolerance']:.2e}" + (f", {e['learning_misses']} rejected while learning" if e['learning_misses'] else ""))
    if run.get("dashboard_url"):
        lines.append(f"dashboard {run['dashboard_url']}")
    return "\n".join(lines)


def offline_status(run_dir: Path, *, as_json: bool) -> int:
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        print(json.dumps(summary, indent=2) if as_json else
              f"not running; finished run in {run_dir}: {summary.get('trainer_steps')} steps, "
              f"{summary.get('adapter_versions_published')} versions, reward "
              f"{summary.get('reward_first', 0):.3f} -> {summary.get('reward_last', 0):.3f}")
        return EXIT_NOT_RUNNING
    steps = read_events(run_dir, "step")
    if steps:
        last = steps[-1]
        print(json.dumps(last) if as_json else
              f"not running (no dashboard answered); last logged step {last['step']} at v{last.get('version')}, "
              f"reward {last['reward_mean']:.3f}, {time.time() - last['t']:.0f} s ago")
        return EXIT_NOT_RUNNING
    print(f"asyncrl-coordinator: nothing to show in {run_dir} (no dashboard.txt, summary.json or metrics)",
          file=sys.stderr)
    return EXIT_FAIL
