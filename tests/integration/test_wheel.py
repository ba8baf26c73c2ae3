"""`pip install <built wheel>` — not `-e` in a clone — gives working `asyncrl-client` and `asyncrl-coordinator`.

The wheel is built from a copy of this tree (`pip wheel --no-deps --no-build-isolation`, so nothing is
downloaded and the tree gets no build/ litter), checked for its contents — every module of every folder
pyproject maps into `asyncrl.*`, no subpackage forgotten, nothing from bench/ or tests/ — and installed
into a fresh venv. That venv reaches the heavy dependencies (torch, hivemind, ...) of the test venv
through a .pth file, but *our* code only from the wheel: the test asserts where `asyncrl` is imported
from, and runs from a directory outside the checkout with no PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from asyncrl.protocol.identity import Identity
from tests.conftest import REPO

pytestmark = pytest.mark.integration
SKIP_DIRS = {".venv", ".git", "__pycache__", "build", "runs", ".pytest_cache", ".hypothesis", "artifacts"}


def expected_modules() -> set[str]:
    """Every module the wheel must hold: each .py in each folder pyproject maps to an asyncrl.* package."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setuptools["package-dir"]
    assert set(setuptools["packages"]) == set(mapping), "every mapped folder is a listed package"
    modules = set()
    for package, folder in mapping.items():
        for path in (REPO / folder).glob("*.py"):
            modules.add(f"{package.replace('.', '/')}/{path.name}")
        for sub in (REPO / folder).iterdir():  # a subpackage nobody listed would silently be left out
            if sub.is_dir() and (sub / "__init__.py").exists():
                assert f"{package}.{sub.name}" in mapping, f"{sub} is a package missing from pyproject's packages"
    return modules


def build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=lambda d, names: [n for n in names if n in SKIP_DIRS or n.endswith(".egg-info")])
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300, cwd=tmp_path)
    [wheel] = out.glob("asyncrl-*.whl")
    return wheel


def fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # The heavy dependencies, not our code: every site-packages directory this interpreter sees (its own
    # and any a .pth added). Their .pth files are not processed from there, so no editable install of
    # asyncrl is activated; the asserts below check that.
    deps = [sysconfig.get_paths()["purelib"], *(p for p in sys.path if p.endswith("site-packages"))]
    (site / "zz_test_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300, env=clean_env(), cwd=tmp_path)
    return venv


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_the_wheel_installs_working_commands(tmp_path, free_port):
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {n for n in names if n.endswith(".py")}
    assert expected_modules() <= modules, expected_modules() - modules
    assert not [n for n in names if n.startswith(("bench/", "tests/", "asyncrl/tests", "asyncrl/bench"))]
    assert not [n for n in modules if not n.startswith("asyncrl/")], "only the asyncrl namespace is installed"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "asyncrl-client = asyncrl.client.cli:main" in scripts and "asyncrl-coordinator = " in scripts

    venv = fresh_venv(tmp_path, wheel)
    run = lambda *cmd, **kw: subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600,
                                            env=clean_env(), cwd=tmp_path, **kw)
    where = run(venv / "bin" / "python", "-c", "import asyncrl.client.cli as m, asyncrl.protocol.codec as c; "
                "print(m.__file__); print(c.__file__)")
    assert where.returncode == 0, where.stderr
    assert all(Path(p).is_relative_to(venv) for p in where.stdout.split()), where.stdout  # from the wheel
    for command in ("asyncrl-client", "asyncrl-coordinator", "asyncrl"):
        helped = run(venv / "bin" / command, "--help")
        assert helped.returncode == 0 and helped.stdout, helped.stderr

    closed = f"/ip4/127.0.0.1/tcp/{free_port}/p2p/{Identity.generate().peer_id}"
    doc = run(venv / "bin" / "asyncrl-client", "doctor", closed, "--json", "--data-dir", tmp_path / "vol")
    assert doc.returncode == 1, doc.stderr[-2000:]
    rows = {r["id"]: r for r in json.loads(doc.stdout)["rows"]}
    assert rows["tcp"]["status"] == "fail" and rows["engine"]["status"] == "pass", rows
