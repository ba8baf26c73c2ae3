"""The layering, read straight off the import statements (ast only: nothing is imported or executed).

    protocol  <-  swarm  <-  coordinator, client          protocol imports nothing of ours
    protocol  <-  models, tasks  <-  envs  <-  coordinator, client    coordinator and client never import each other

Every top-level folder that installs is one subsystem under `asyncrl.` (pyproject's package-dir), so
the folder list is the architecture diagram; benchmarks and test fixtures stay out of the package.

Inside coordinator/ the same holds one level down (coordinator/__init__.py draws it):

    learner, leasing  <-  trust  <-  ingest  <-  shared (config, checkpoint, publisher, ...)  <-  hub (cli, service)
    shared  <-  operator  <-  hub                           only the hub imports operator surfaces

Inside client/ the volunteer hub (worker.py `Volunteer`, started by cli.py) is built from its parts (session,
lease_rpc, rollout, delivery) and the components beside them; none of them imports the hub or the CLI back.

No module of ours imports itself back through others, module-level or inside a function: a circle means
one of its modules owns two things, and the shared one belongs in a module both can import.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
# asyncrl.<subsystem> -> folder; the shared root `asyncrl` is the umbrella CLI and the demo launcher
SUBSYSTEMS = {name.split(".")[1]: REPO / folder for name, folder in PACKAGE_DIRS.items() if name.count(".") == 1}

ALLOWED = {  # subsystem -> what of ours it may import ("root": the shared asyncrl/*.py modules)
    "protocol": set(),
    "swarm": {"protocol"},
    "models": {"protocol"},
    "tasks": {"protocol"},
    "envs": {"protocol", "tasks"},
    "coordinator": {"protocol", "swarm", "models", "tasks", "envs", "root"},
    "client": {"protocol", "swarm", "models", "tasks", "envs", "root"},
}


# coordinator/'s parts -> the parts of coordinator/ each may import. A part is a sub-package (its folder
# name), "hub" (coordinator/cli.py, service.py, __init__.py: they wire everything, nothing imports them) or
# "shared" (every other coordinator/*.py: config, checkpoint, publisher, run_end, base_model).
COORDINATOR_HUB = {"cli", "service", "__init__"}
COORDINATOR_ALLOWED = {
    "learner": set(),                                # the GRPO step knows groups of rows, not where they came from
    "leasing": set(),
    "trust": {"learner"},                            # the audit recomputes log-probs with the learner's code
    "ingest": {"learner", "trust", "leasing"},       # TrainGroup, strike rules + audit worker, whose leases
    "operator": {"shared"},                          # reads the config and the run's files, never a component
    "shared": {"learner", "ingest", "trust", "leasing"},
    "hub": {"learner", "ingest", "trust", "leasing", "operator", "shared"},
}


def _module_name(path: Path, folder: Path, package: str) -> str:
    rel = path.relative_to(folder).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([package, *parts])


def imported_modules(path: Path, module: str) -> set[str]:
    """Absolute names of every module `path` (module `module`) imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return out


def read_in_a_fresh_interpreter(jobs: list[tuple[Path, str]]) -> list[set[str]]:
    """`imported_modules` of each (path, module), computed by a child Python that runs no other thread.
    CPython 3.11 keeps the AST constructor's recursion depth in interpreter-wide state, so ast.parse in a
    pytest worker whose earlier in-process tests left threads running can fail with `SystemError: AST
    constructor recursion depth mismatch` (python/cpython#106905)."""
    code = ("import json, sys; from pathlib import Path; from tests.test_layering import imported_modules; "
            "print(json.dumps([sorted(imported_modules(Path(p), m)) for p, m in json.load(sys.stdin)]))")
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps([[str(p), m] for p, m in jobs]), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [set(mods) for mods in json.loads(done.stdout)]


ROOT = REPO / PACKAGE_DIRS["asyncrl"]


def _our_modules() -> dict[Path, str]:
    """file -> module name, for every module of ours: the shared root asyncrl/*.py and each subsystem's tree."""
    files = {path: _module_name(path, ROOT, "asyncrl") for path in sorted(ROOT.glob("*.py"))}
    files.update((path, _module_name(path, folder, f"asyncrl.{name}"))
                 for name, folder in sorted(SUBSYSTEMS.items()) for path in sorted(folder.rglob("*.py")))
    return files


@functools.lru_cache(maxsize=None)
def _imports_of_every_file() -> dict[Path, set[str]]:
    jobs = list(_our_modules().items())
    return dict(zip((path for path, _ in jobs), read_in_a_fresh_interpreter(jobs)))


def subsystem_imports(name: str) -> dict[str, set[str]]:
    """file -> what of ours outside `asyncrl.<name>` it imports: other subsystems by name, shared-root
    modules (asyncrl/*.py, e.g. `asyncrl.signals`) as "root"."""
    folder = SUBSYSTEMS[name]
    found = {}
    every = _imports_of_every_file()
    for path in sorted(folder.rglob("*.py")):
        ours = set()
        for mod in every[path]:
            parts = mod.split(".")
            if parts[0] != "asyncrl" or len(parts) < 2 or parts[1] == name:
                continue
            ours.add(parts[1] if parts[1] in SUBSYSTEMS else "root")
        found[str(path.relative_to(REPO))] = ours
    return found


def test_every_subsystem_is_a_top_level_folder():
    assert set(ALLOWED) == set(SUBSYSTEMS), "a new subsystem needs its row in ALLOWED (and in the README's Map)"
    for name, folder in SUBSYSTEMS.items():
        assert folder.parent == REPO, f"asyncrl.{name} lives in {folder}, not in a top-level folder"
        assert (folder / "__init__.py").exists(), f"{folder.name}/ has no __init__.py (hub docstring)"


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_layering(name):
    bad = {f: sorted(o - ALLOWED[name]) for f, o in subsystem_imports(name).items() if o - ALLOWED[name]}
    assert not bad, f"asyncrl.{name} may import only {sorted(ALLOWED[name]) or 'nothing of ours'}; found {bad}"


def coordinator_part(module: str) -> str | None:
    """The part of coordinator/ that `asyncrl.coordinator.<...>` belongs to; None for the package itself."""
    parts = module.split(".")
    if parts[:2] != ["asyncrl", "coordinator"] or len(parts) < 3:
        return None
    if (SUBSYSTEMS["coordinator"] / parts[2]).is_dir():
        return parts[2]
    return "hub" if parts[2] in COORDINATOR_HUB else "shared"


def coordinator_imports() -> dict[str, tuple[str, set[str]]]:
    """file -> (its part, the other parts of coordinator/ it imports)."""
    folder = SUBSYSTEMS["coordinator"]
    every = _imports_of_every_file()
    found = {}
    for path in sorted(folder.rglob("*.py")):
        own = coordinator_part(_module_name(path, folder, "asyncrl.coordinator")) or "hub"
        others = {p for m in every[path] if (p := coordinator_part(m)) not in (None, own)}
        found[str(path.relative_to(REPO))] = (own, others)
    return found


def test_every_coordinator_sub_package_has_its_row_and_says_what_it_owns():
    folder = SUBSYSTEMS["coordinator"]
    subs = {d.name for d in folder.iterdir() if d.is_dir() and d.name != "__pycache__"}
    assert subs == set(COORDINATOR_ALLOWED) - {"hub", "shared"}, "a new coordinator/ sub-package needs its row"
    for name in sorted(subs):
        init = folder / name / "__init__.py"
        assert init.exists(), f"coordinator/{name}/ is not a package"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "Imports" in doc, f"coordinator/{name}/__init__.py must open with what it owns and imports"


def test_the_coordinator_tests_mirror_its_sub_packages():
    """tests/coordinator/<part>/ holds the tests of coordinator/<part>/; the hub's and shared modules' at its top."""
    subs = {d.name for d in SUBSYSTEMS["coordinator"].iterdir() if (d / "__init__.py").exists()}
    tests = {d.name for d in (REPO / "tests" / "coordinator").iterdir() if d.is_dir() and d.name != "__pycache__"}
    assert tests <= subs, f"tests/coordinator/ folders with no coordinator/ sub-package: {sorted(tests - subs)}"
    assert all((REPO / "tests" / "coordinator" / name / "__init__.py").exists() for name in tests)


def test_coordinator_layering():
    bad = {f: (own, sorted(o - COORDINATOR_ALLOWED[own])) for f, (own, o) in coordinator_imports().items()
           if o - COORDINATOR_ALLOWED[own]}
    assert not bad, f"file: (its part, parts of coordinator/ it may not import) {bad}; rules: {COORDINATOR_ALLOWED}"


CLIENT_HUB = {"worker", "cli"}  # client/worker.py wires the volunteer; client/cli.py starts it


def test_no_client_module_imports_the_volunteer_hub():
    folder = SUBSYSTEMS["client"]
    every = _imports_of_every_file()
    hub = {f"asyncrl.client.{name}" for name in CLIENT_HUB}
    assert all((folder / f"{name}.py").exists() for name in CLIENT_HUB)
    bad = {}
    for path in sorted(folder.rglob("*.py")):
        if path.stem in CLIENT_HUB:
            continue
        found = {m for m in every[path] if any(m == h or m.startswith(h + ".") for h in hub)}
        if found:
            bad[str(path.relative_to(REPO))] = sorted(found)
    assert not bad, f"only {sorted(CLIENT_HUB)} may import the volunteer hub; found {bad}"


def write_package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A throwaway package `pkg` under tmp_path holding `files` (name -> source), for the checkers' self-tests."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for name, source in files.items():
        (pkg / name).write_text(source)
    return pkg


def test_the_import_reader_sees_relative_and_absolute_imports(tmp_path):
    """The checker itself: it must resolve relative imports, or the layering test could never fail."""
    pkg = write_package(tmp_path, {
        "__init__.py": "from . import a\n",
        "b.py": "from .a import x\nfrom asyncrl.client import worker\nimport asyncrl.protocol.codec\n"})
    init, got = read_in_a_fresh_interpreter([(pkg / "__init__.py", "asyncrl.coordinator"),
                                             (pkg / "b.py", "asyncrl.coordinator.b")])
    assert init >= {"asyncrl.coordinator.a"}
    assert {"asyncrl.coordinator.a", "asyncrl.client", "asyncrl.client.worker", "asyncrl.protocol.codec"} <= got


def import_cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The circles in `imports` (module -> what it imports, every import statement in the file): each
    strongly connected group of two or more modules, sorted. Only edges to modules in `imports` count, and
    not a module's edge to its own parent packages, which are already being imported when it runs."""
    graph = {m: sorted(t for t in targets if t in imports and t != m and not m.startswith(t + "."))
             for m, targets in imports.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph):  # Tarjan's algorithm, iterative (no recursion limit on a deep chain)
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        cycles.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(graph[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(cycles)


def test_no_import_cycles():
    every = _imports_of_every_file()
    cycles = import_cycles({module: every[path] for path, module in _our_modules().items()})
    assert not cycles, f"modules that import each other (module-level or function-local): {cycles}"


def test_the_cycle_check_finds_a_deliberate_circle(tmp_path):
    """The checker itself, on a package whose a -> b -> c -> a circle closes through a function-local import."""
    pkg = write_package(tmp_path, {
        "__init__.py": "from . import a\n",
        "a.py": "from .b import f\n",
        "b.py": "from . import c\n\ndef f():\n    return c\n",
        "c.py": "def g():\n    from .a import f\n    return f\n",
        "d.py": "from .a import f\nfrom . import b\n"})  # d imports the circle but is not in it
    names = {path: f"asyncrl.pkg{'.' + path.stem if path.stem != '__init__' else ''}" for path in sorted(pkg.iterdir())}
    imports = dict(zip(names.values(), read_in_a_fresh_interpreter(list(names.items()))))
    assert import_cycles(imports) == [["asyncrl.pkg.a", "asyncrl.pkg.b", "asyncrl.pkg.c"]]
    (pkg / "c.py").write_text("def g():\n    return None\n")  # the circle broken: none left
    after = dict(zip(names.values(), read_in_a_fresh_interpreter(list(names.items()))))
    assert import_cycles(after) == []


def test_shared_root_stays_small_and_holds_no_fixtures():
    root = REPO / PACKAGE_DIRS["asyncrl"]
    modules = sorted(p.name for p in root.glob("*.py"))
    assert len(modules) <= 8, f"asyncrl/ is a grab-bag again: {modules}"
    for fixture in ("swarmlab.py", "synthetic_adapter.py"):
        assert not (root / fixture).exists()
        assert not any(folder.joinpath(fixture).exists() for folder in SUBSYSTEMS.values())
    assert not any(name.startswith(("asyncrl.bench", "asyncrl.tests")) for name in PACKAGE_DIRS)


LONG_MODULE_LINES = 450  # issue 38: a module past this says at its top why it is one module ("Size: ...")


def long_modules_without_a_reason(folders) -> list[str]:
    out = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            text = path.read_text()
            if text.count("\n") + 1 <= LONG_MODULE_LINES:
                continue
            doc = ast.get_docstring(ast.parse(text)) or ""
            if not any(line.startswith("Size: ") for line in doc.splitlines()):
                out.append(f"{path.name}: {path} ({text.count(chr(10)) + 1} lines)")
    return out


def test_every_long_module_says_why_it_is_one_module():
    folders = [*SUBSYSTEMS.values(), REPO / PACKAGE_DIRS["asyncrl"]]
    assert long_modules_without_a_reason(folders) == [], "split it, or say why not in a 'Size:' paragraph"


def test_a_long_module_without_a_reason_is_found(tmp_path):
    (tmp_path / "big.py").write_text('"""Owns a lot."""\n' + "x = 1\n" * LONG_MODULE_LINES)
    (tmp_path / "said.py").write_text('"""Owns a lot.\n\nSize: because.\n"""\n' + "x = 1\n" * LONG_MODULE_LINES)
    (tmp_path / "small.py").write_text('"""Owns little."""\nx = 1\n')
    found = long_modules_without_a_reason([tmp_path])
    assert len(found) == 1 and "big.py" in found[0]
