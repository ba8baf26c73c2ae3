"""`asyncrl demo`: a real swarm on loopback — one coordinator and K volunteer processes.

Every process is a separate OS process talking over hivemind on 127.0.0.1; nothing is shared but
the built-in tiny model's on-disk cache. The demo starts the coordinator, reads the join address it
prints into `<run_dir>/join.txt`, starts K `asyncrl-client join` processes, shows progress, and when
the coordinator has done `--steps` optimizer steps stops the volunteers, prints a one-screen summary
and writes `<run_dir>/reward.png` (+ `--json-out`).

    asyncrl demo --clients 2 --json-out runs/demo.json            # refuses a non-empty --run-dir ...
    asyncrl demo --clients 2 --run-dir runs/demo --overwrite       # ... unless told to replace an earlier demo

--overwrite deletes only a directory an earlier demo created (its `.asyncrl-demo` marker) whose
coordinator.key and config.json, if any, are the ones that demo's coordinator wrote — never a real run's
directory or key, nor a real run started later in the demo's directory (`asyncrl-coordinator run` rewrites
config.json at every start, and reuses the key it finds).

Process hygiene (DemoProcesses): each child runs in its own session, so its process group (pgid == its
pid) holds it and everything it starts — the hivemind DHT fork and p2pd. The demo owns those groups and
nothing else. `<run_dir>/demo.pids` names them while they run. However the demo ends — max steps, a
crashed coordinator, the timeout, SIGTERM or Ctrl-C (SIGINT) — it stops the volunteers first (they flush
their outbox to a coordinator that is still up), then the coordinator (final checkpoint and summary.json),
then SIGKILLs whatever is left in each group. A volunteer never outlives the demo, so none retries a
vanished coordinator forever. After a signal the demo still prints the summary of what ran (from
summary.json, or from metrics.jsonl if the coordinator wrote none) and exits 128 + the signal number
(130 for Ctrl-C, 143 for SIGTERM), without a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from asyncrl.protocol.atomic import write_json_atomic
from asyncrl.runlog import read_events

EXIT_FAILED, EXIT_USAGE = 1, 2
VOLUNTEER_GRACE_S = 15.0  # a volunteer on SIGTERM finishes its batch and flushes its outbox
COORDINATOR_GRACE_S = 30.0  # the coordinator on SIGTERM writes its final checkpoint and summary.json


class RunDirInUse(Exception):
    """`--run-dir` holds an earlier run and `--overwrite` was not given."""


MARKER = ".asyncrl-demo"
"""Written by the demo into a run directory it created: {"coordinator_key_sha256", "config_sha256": the key
and the config.json its coordinator wrote there, or null before it did}. --overwrite deletes only a directory
with this marker whose coordinator.key and config.json (if any) are the ones recorded: never a real run's
directory or key. (Without a recorded config, e.g. from an older demo, the key decides.)"""


def prepare_run_dir(run: Path, *, overwrite: bool) -> None:
    """An empty run directory of the demo's own, never by deleting anything the demo did not create."""
    if run.exists() and not run.is_dir():
        raise RunDirInUse(f"{run} exists and is not a directory")
    if run.exists() and any(run.iterdir()):
        if not overwrite:
            raise RunDirInUse(f"{run} already holds a run; pass --overwrite to replace it, or choose another --run-dir")
        problem = _not_ours(run)
        if problem:
            raise RunDirInUse(f"{run} {problem}: --overwrite deletes only a directory an earlier demo created; "
                              "choose another --run-dir (or delete it yourself)")
        shutil.rmtree(run)
    run.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run / MARKER, {"coordinator_key_sha256": None, "config_sha256": None})


def _not_ours(run: Path) -> str | None:
    """Why `run` is not a directory this demo may delete, or None."""
    try:
        marker = json.loads((run / MARKER).read_text())
    except (OSError, ValueError):
        return "was not created by the demo"
    key, config = run / "coordinator.key", run / "config.json"
    if key.exists() and marker.get("coordinator_key_sha256") != _sha256(key):
        return "holds a coordinator key the demo did not write"
    if marker.get("config_sha256") and config.exists() and marker["config_sha256"] != _sha256(config):
        return "holds a run the demo did not start (its config.json is not the demo's)"
    return None


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def record_coordinator_key(run: Path) -> None:
    """After the demo's coordinator wrote its key and config: remember both, so --overwrite knows they are the
    demo's."""
    key, config = run / "coordinator.key", run / "config.json"
    if key.exists():
        write_json_atomic(run / MARKER, {"coordinator_key_sha256": _sha256(key),
                                         "config_sha256": _sha256(config) if config.exists() else None})


class Interrupted:
    """Records the first SIGTERM / SIGINT; the demo's loops look at it and wind down (asyncrl/signals.py)."""

    def __init__(self):
        self.signum: int | None = None

    def __call__(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None


class DemoProcesses:
    """The demo's children, each the leader of its own session and process group; stops them all."""

    def __init__(self, pid_file: Path):
        self.pid_file = pid_file
        self.coordinator: subprocess.Popen | None = None
        self.volunteers: list[subprocess.Popen] = []

    def spawn(self, args: list[str], log: Path, *, volunteer: bool) -> subprocess.Popen:
        """Start one child (log: its stdout + stderr) in a session of its own; demo.pids names its group."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(log, "w") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        if volunteer:
            self.volunteers.append(proc)
        else:
            self.coordinator = proc
        write_json_atomic(self.pid_file, {"demo": os.getpid(), "process_groups": self.groups()})
        return proc

    def all(self) -> list[subprocess.Popen]:
        return ([self.coordinator] if self.coordinator else []) + self.volunteers

    def groups(self) -> list[int]:
        return [p.pid for p in self.all()]

    def exit_codes(self) -> dict[str, int | None]:
        """How each child ended: 0 = it stopped on its own; -9 = it had to be killed."""
        out = {"coordinator": self.coordinator.returncode} if self.coordinator else {}
        out.update({f"volunteer-{i}": p.returncode for i, p in enumerate(self.volunteers)})
        return out

    def stop_all(self) -> None:
        """Volunteers first (they flush to a live coordinator), then the coordinator, then any leftovers."""
        _stop_group(self.volunteers, VOLUNTEER_GRACE_S)
        if self.coordinator is not None:
            _stop_group([self.coordinator], COORDINATOR_GRACE_S)
        for pgid in self.groups():  # p2pd / DHT forks whose leader already exited
            _killpg(pgid, signal.SIGKILL)
        self.pid_file.unlink(missing_ok=True)


def _stop_group(procs: list[subprocess.Popen], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _killpg(p.pid, signal.SIGKILL)  # our own child's session: it, its p2pd and DHT children
            p.wait(10)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_demo(*, clients: int, steps: int, run_dir: str, json_out: str | None, timeout_s: float,
             overwrite: bool = False) -> int:
    from asyncrl import signals

    t0 = time.time()
    run = Path(run_dir)
    try:
        prepare_run_dir(run, overwrite=overwrite)
    except RunDirInUse as exc:
        print(f"asyncrl demo: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    interrupted = Interrupted()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signals.install(interrupted)  # from here on SIGTERM / Ctrl-C wind the demo down instead of killing it
    try:
        return _run(run, clients=clients, steps=steps, json_out=json_out, t0=t0, timeout_s=timeout_s,
                    interrupted=interrupted)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(run: Path, *, clients: int, steps: int, json_out: str | None, t0: float, timeout_s: float,
         interrupted: Interrupted) -> int:
    kids = DemoProcesses(run / "demo.pids")
    try:
        failed = _drive(kids, run, clients=clients, steps=steps, t0=t0, timeout_s=timeout_s, interrupted=interrupted)
    finally:
        if interrupted.signum is not None:
            print(f"\ndemo: {interrupted.name} received; stopping the volunteers and the coordinator", flush=True)
        kids.stop_all()
    if failed and interrupted.signum is None:
        return EXIT_FAILED
    summary = _read_summary(run)
    if summary is None:
        print(_tail(run / "coordinator.log"))
        print("demo: the coordinator wrote no summary and no metrics", file=sys.stderr)
        return 128 + interrupted.signum if interrupted.signum is not None else EXIT_FAILED
    summary.update(wall_s=time.time() - t0, clients=clients, interrupted=interrupted.name,
                   client_versions_loaded=_client_versions(run, clients), exit_codes=kids.exit_codes())
    from asyncrl.coordinator.operator.plots import plot_run

    plot_path = plot_run(run)
    summary["plot"] = str(plot_path) if plot_path else None
    print_summary(summary)
    if json_out:
        Path(json_out).write_text(json.dumps(summary, indent=2))
    return 128 + interrupted.signum if interrupted.signum is not None else 0


def _drive(kids: DemoProcesses, run: Path, *, clients: int, steps: int, t0: float, timeout_s: float,
           interrupted: Interrupted) -> bool:
    """Start everything and wait for the coordinator to finish; True when the demo failed (logs printed)."""
    py = sys.executable
    coord = kids.spawn([py, "-m", "asyncrl.coordinator.cli", "run", "--model", "tiny", "--run-id", "demo",
                        "--run-dir", str(run),
                        "--max-steps", str(steps), "--threads", "1"], run / "coordinator.log", volunteer=False)
    join = run / "join.txt"
    while not join.exists():
        if interrupted.signum is not None:
            return False
        if coord.poll() is not None:
            print(_tail(run / "coordinator.log"))
            print("demo: the coordinator exited before it was ready", file=sys.stderr)
            return True
        if time.time() - t0 > 180:
            print("demo: coordinator did not start within 180 s", file=sys.stderr)
            return True
        time.sleep(0.2)
    address = join.read_text().strip()
    record_coordinator_key(run)  # its key is in the run dir by now (written before it serves)
    print(f"coordinator up at {address}", flush=True)
    for i in range(clients):
        kids.spawn([py, "-m", "asyncrl.client.cli", "join", address, "--name", f"volunteer-{i}",
                    "--data-dir", str(run / f"client-{i}"), "--seed", str(i), "--threads", "1"],
                   run / f"client-{i}.log", volunteer=True)
    print(f"{clients} volunteers started; logs in {run}/", flush=True)
    last = 0.0
    while coord.poll() is None and interrupted.signum is None:
        if time.time() - t0 > timeout_s:
            print("demo: timed out", file=sys.stderr)
            return True
        if time.time() - last > 10:
            last = time.time()
            print(_progress_line(run / "metrics.jsonl", steps, t0), flush=True)
        time.sleep(0.2)
    if interrupted.signum is None and coord.returncode != 0:
        print(_tail(run / "coordinator.log"))
        print(f"demo: the coordinator exited with status {coord.returncode}", file=sys.stderr)
        return True
    return False


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else f"(no {path.name})"


def _read_summary(run: Path) -> dict | None:
    """summary.json when the coordinator wrote it, else what metrics.jsonl shows (an interrupted start-up)."""
    path = run / "summary.json"
    if path.exists():
        return json.loads(path.read_text())
    events = read_events(run)
    if not events:
        return None
    steps = [e for e in events if e["event"] == "step"]
    batches = [e for e in events if e["event"] == "batch"]
    k = max(1, len(batches) // 10)
    mean = lambda xs: float(sum(xs) / len(xs)) if xs else 0.0
    return {"trainer_steps": steps[-1]["step"] if steps else 0,
            "adapter_versions_published": sum(e["event"] == "publish" for e in events),
            "batches_accepted": len(batches), "batches_by_client": dict(Counter(b["client"] for b in batches)),
            "reward_first": mean([b["reward_mean"] for b in batches[:k]]),
            "reward_last": mean([b["reward_mean"] for b in batches[-k:]]),
            "lora_delta_norm": None, "leases": None, "from": "metrics.jsonl"}


def _client_versions(run: Path, clients: int) -> dict[str, int]:
    out = {}
    for i in range(clients):
        status = run / f"client-{i}" / "status.json"
        if status.exists():
            st = json.loads(status.read_text())
            out[st["name"]] = len(set(st["versions_loaded"]))
    return out


def _progress_line(metrics: Path, steps: int, t0: float) -> str:
    step, reward, batches = 0, float("nan"), 0
    for ev in read_events(metrics):
        if ev["event"] == "step":
            step, reward = ev["step"], ev["reward_mean"]
        elif ev["event"] == "batch":
            batches += 1
    return f"[{time.time() - t0:5.0f}s] step {step}/{steps}  batches {batches}  reward {reward:.3f}"


def print_summary(s: dict) -> None:
    fmt = lambda x, spec: "–" if x is None else format(x, spec)
    print()
    print("=" * 64)
    print(f" asyncrl demo — {s['clients']} volunteers, {s['wall_s']:.0f} s"
          + (f" — stopped by {s['interrupted']}" if s.get("interrupted") else ""))
    print("=" * 64)
    print(f" trainer steps               {s['trainer_steps']}")
    print(f" adapter versions published  {s['adapter_versions_published']}")
    print(f" batches accepted            {s['batches_accepted']}")
    for name, n in sorted(s["batches_by_client"].items()):
        loaded = s.get("client_versions_loaded", {}).get(name, "?")
        print(f"   {name:<24} {n:5d} batches, {loaded} adapter versions loaded")
    print(f" reward first 10% → last 10%  {s['reward_first']:.3f} → {s['reward_last']:.3f}")
    print(f" LoRA change (L2)            {fmt(s.get('lora_delta_norm'), '.4f')}")
    print(f" leases                      {fmt(s.get('leases'), '')}")
    if s.get("plot"):
        print(f" plot                        {s['plot']}")
    print("=" * 64, flush=True)
