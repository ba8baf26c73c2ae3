"""Every command in README.md and docs/ runs as written, or says on its own line why it cannot run here.

The convention (docs/testing.md, "Commands in the docs"): shell commands sit in ```bash fences, one per line
(a trailing `\\` continues it). A command is **runnable** unless
- its trailing comment says `needs: WORD[, WORD...]` (the words are `NEEDS`' keys), or
- it is a template, visibly not meant to run as written: it holds `...`, a `<placeholder>` or an optional
  `[--flag]`.

Each page's runnable commands run in page order, each with `bash -c`, in one scratch directory per page that
stands for a clone (every top-level entry of the repository linked in, the project's venv as `.venv`) with a
fresh HOME, the venv's bin first on PATH (as after `. .venv/bin/activate`), `EDITOR=true`, and the network
closed to pip and the Hugging Face hub. A command must exit 0 and, where its comment says `prints: TEXT`, print
TEXT. A ```toml fence whose first line is `# NAME.toml` (the page tells the reader to save it under that name)
is written into the scratch directory first. So a command of the docs that a reader copies either works on a
fresh `make install` or carries its reason.

Every `asyncrl-coordinator` / `asyncrl-client` command, templates included (`[--flag]` parsed as given, `...`
ones skipped), also parses with the real argument parsers: a renamed flag fails here even where the command
cannot run. The configs the guides show start in tests/coordinator/test_doc_recipes.py."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROGRAMS = ("asyncrl-coordinator", "asyncrl-client")
NEEDS = {
    "gpu": "a CUDA GPU",
    "internet": "the network: PyPI, the Hugging Face hub",
    "swarm": "a coordinator to join, or a volunteer that has joined one",
    "files": "files of your own the page describes but does not create: a dataset, a reward package, a wheel",
    "run": "what an earlier long command wrote: a run directory's checkpoints or metrics, a test's artifacts",
    "long": "more than a few seconds here: a server that runs until stopped, a training run, a benchmark, the suite",
}
COMMAND_TIMEOUT_S = 120  # a guard against a hang; the commands that run take about a second each


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str       # the command as bash gets it (continuations joined, the comment cut off)
    comment: str

    @property
    def needs(self) -> list[str]:
        m = re.search(r"\bneeds: ([a-z]+(?:, [a-z]+)*)", self.comment)
        return m.group(1).split(", ") if m else []

    @property
    def prints(self) -> str | None:
        m = re.search(r"\bprints: (.+?)(?: — |$)", self.comment)
        return m.group(1) if m else None

    @property
    def template(self) -> bool:
        return "..." in self.text or bool(re.search(r"<[A-Za-z][^<>]*>|\[--", self.text))

    @property
    def runnable(self) -> bool:
        return not self.needs and not self.template

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def split_comment(line: str) -> tuple[str, str]:
    """(command, trailing comment): a `#` after whitespace and outside quotes starts the comment, as in bash."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def fences(page: Path) -> list[tuple[str, int, list[str]]]:
    """(info string, line number of the first body line, body lines) of every fenced block."""
    out, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        m = re.match(r"\s*```(\S*)", lines[i])
        if m:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            out.append((m.group(1), i + 2, lines[i + 1:end]))
            i = end
        i += 1
    return out


def page_commands(page: Path) -> list[Command]:
    out = []
    for info, first, body in fences(page):
        if info != "bash":
            continue
        start, pending = None, ""
        for n, raw in enumerate(body, first):
            start = n if start is None else start
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            text, comment = split_comment(pending + raw)
            pending, line = "", start
            start = None
            if text.strip():
                out.append(Command(str(page.relative_to(REPO)), line, " ".join(text.split()), comment))
    return out


def page_files(page: Path) -> dict[str, str]:
    """The files a page asks the reader to save: ```toml fences opening with `# NAME.toml`."""
    out = {}
    for info, _, body in fences(page):
        m = re.match(r"# ([\w.-]+\.toml)\b", body[0]) if info == "toml" and body else None
        if m:
            out[m.group(1)] = "\n".join(body) + "\n"
    return out


COMMANDS = [c for page in DOCS for c in page_commands(page)]
RUNNABLE_PAGES = sorted({c.page for c in COMMANDS if c.runnable})


# ---- the convention itself -------------------------------------------------------------------------------
def test_every_needs_mark_names_a_known_need():
    unknown = [f"{c}  # {c.comment}" for c in COMMANDS if set(c.needs) - set(NEEDS)]
    assert not unknown, f"needs: takes only {sorted(NEEDS)}:\n" + "\n".join(unknown)


def test_shell_commands_sit_in_bash_fences():
    """A command in an untagged or `sh` fence would escape this test: the guides use ```bash for commands."""
    starts = ("asyncrl", "python", ".venv/", "make ", "pip ", "torchrun", "git ", "$V ")
    stray = [f"{page.relative_to(REPO)}:{first}: ```{info}" for page in DOCS for info, first, body in fences(page)
             if info != "bash" and body and body[0].lstrip().startswith(starts)]
    assert not stray, "commands outside a ```bash fence:\n" + "\n".join(stray)


def test_the_guides_have_runnable_commands_and_every_need_is_used():
    assert RUNNABLE_PAGES and {n for c in COMMANDS for n in c.needs} == set(NEEDS)


# ---- parsing: every asyncrl command, templates included ------------------------------------------------
def parse_words(command: Command) -> list[str]:
    line = re.sub(r"\[(--[^\]]*)\]", r"\1", command.text)  # `[--flag VALUE]`: an optional flag, shown
    words = shlex.split(line)
    cut = next((i for i, w in enumerate(words) if w in ("&&", "||", "|", ";", ">", "2>&1")), len(words))
    return words[:cut]


PARSED = [c for c in COMMANDS if c.text.startswith(PROGRAMS) and "..." not in c.text]


def test_the_guides_show_commands_of_both_programs():
    assert {c.text.split()[0] for c in PARSED} == set(PROGRAMS)


@pytest.mark.parametrize("command", PARSED, ids=[f"{c.page}:{c.line}" for c in PARSED])
def test_documented_command_parses(command):
    from asyncrl.client.cli import build_parser as client_parser
    from asyncrl.coordinator.cli import build_parser as coordinator_parser

    words = parse_words(command)
    parser = coordinator_parser() if words[0] == "asyncrl-coordinator" else client_parser()
    try:
        parser.parse_args(words[1:])
    except SystemExit as exc:
        pytest.fail(f"{command} does not parse (exit {exc.code})")


# ---- running: every runnable command, page by page ------------------------------------------------------
def scratch_clone(root: Path) -> Path:
    """A directory that stands for a clone: every top-level entry of the repository linked in (what a command
    writes lands here, not in the repository), and the venv running this test as `.venv`."""
    work = root / "clone"
    work.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in (".venv", "runs", "out", "dist", "data"):
            (work / entry.name).symlink_to(entry)
    (work / ".venv").symlink_to(Path(sys.prefix))
    return work


def command_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "VIRTUAL_ENV", "HF_", "XDG_"))}
    env.update(HOME=str(home), PATH=f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}", EDITOR="true",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PIP_NO_INDEX="1")
    return env


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_runnable_commands_run_as_written(page, tmp_path):
    work = scratch_clone(tmp_path)
    (tmp_path / "home").mkdir()
    for name, text in page_files(REPO / page).items():
        (work / name).write_text(text)
    for command in (c for c in COMMANDS if c.page == page and c.runnable):
        r = subprocess.run(["bash", "-c", command.text], cwd=work, env=command_env(tmp_path / "home"),
                           capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL)
        said = f"{command}\nexit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
        assert r.returncode == 0, f"fails as written (mark it `# needs: ...` if it cannot run here):\n{said}"
        if command.prints is not None:
            assert command.prints in r.stdout + r.stderr, f"does not print {command.prints!r}:\n{said}"
