"""One place for the command lines of the processes integration tests start, and for waiting until they serve.

    coord = start_coordinator(procs, run, groups_per_step=4, lease_timeout_s=3600)   # tiny model, 1 thread
    vol = start_volunteer(procs, coord.join, tmp_path / "vol", name="vol", prompts_per_batch=2)

Keyword options become flags (`groups_per_step=4` -> `--groups-per-step 4`; `True` -> the bare flag; `False`
or `None` -> left out), so a test names only what its scenario is about; the defaults below are what every
integration test runs with unless it says otherwise. A coordinator's `--resume` twin reuses its flags:
`start_coordinator(procs, run, name="coordinator-2", resume=True, **same)`.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import wait_for_join

COORDINATOR = ("-m", "asyncrl.coordinator.cli", "run")
VOLUNTEER = ("-m", "asyncrl.client.cli", "join")
COORDINATOR_DEFAULTS = {"model": "tiny", "max_steps": 0, "threads": 1, "no_dashboard": True}
"""A coordinator that trains the built-in tiny model until stopped, on one thread, without a dashboard server."""
VOLUNTEER_DEFAULTS = {"threads": 1}


def flags(**opts) -> list[str]:
    out: list[str] = []
    for key, value in opts.items():
        if value is None or value is False:
            continue
        out.append("--" + key.replace("_", "-"))
        if value is not True:
            out.append(str(value))
    return out


def coordinator_args(run: Path, **opts) -> list[str]:
    return [*COORDINATOR, "--run-dir", str(run), *flags(**{**COORDINATOR_DEFAULTS, **opts})]


def volunteer_args(join: str, data: Path, *, name: str, **opts) -> list[str]:
    return [*VOLUNTEER, join, "--name", name, "--data-dir", str(data), *flags(**{**VOLUNTEER_DEFAULTS, **opts})]


@dataclass
class Coordinator:
    proc: subprocess.Popen
    run: Path
    join: str


def start_coordinator(procs, run: Path, *, name: str = "coordinator", timeout: float = 180, **opts) -> Coordinator:
    """Start a coordinator and wait until it serves (its join address); fails at once, with its log, if it
    exits first."""
    proc = procs.start(name, coordinator_args(run, **opts))
    return Coordinator(proc, run, wait_for_join(run, timeout, proc))


def with_fault(args: list[str], fault: str) -> list[str]:
    """A volunteer command line run by the fault double instead (tests/fault_volunteer.py: slow-prompt:S,
    slow-generate:S, hold-uploads): the same flags, one real Volunteer subclass with one fault."""
    assert list(args[:2]) == ["-m", "asyncrl.client.cli"], args[:2]
    return ["-m", "tests.fault_volunteer", fault, *args[2:]]


def start_volunteer(procs, join: str, data: Path, *, name: str, fault: str | None = None, **opts) -> subprocess.Popen:
    args = volunteer_args(join, data, name=name, **opts)
    return procs.start(name, with_fault(args, fault) if fault else args)
