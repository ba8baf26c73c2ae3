"""Every `asyncrl-coordinator` / `asyncrl-client` command in README.md and docs/ parses with the real argument
parsers: a flag renamed or removed in the code, or misspelt in a guide, fails here. Commands are taken from
```bash blocks as written (a trailing `\\` joins lines, `# ...` comments dropped); elided ones (holding `...`)
are skipped; `[--flag]` (optional) is parsed as given. Parsing runs nothing — no GPU, no network; the runnable recipes themselves run in
tests/coordinator/test_doc_recipes.py (configs started, docs/gpu-swarm.md's --dry-run)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROGRAMS = ("asyncrl-coordinator", "asyncrl-client")


def commands() -> list[tuple[str, list[str]]]:
    out = []
    for doc in DOCS:
        for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", doc.read_text(), re.S):
            joined = re.sub(r"\\\n\s*", " ", block)
            for line in joined.splitlines():
                line = line.strip()
                if not line.startswith(PROGRAMS) or "..." in line:
                    continue
                line = re.sub(r"\[(--[^\]]*)\]", r"\1", line)  # `[--flag VALUE]`: an optional flag, shown
                try:
                    words = shlex.split(line, comments=True)
                except ValueError:  # an unbalanced quote inside a trailing comment
                    words = shlex.split(line.split(" #")[0])
                cut = next((i for i, w in enumerate(words) if w in ("&&", "||", "|", ";", ">", "2>&1")), len(words))
                out.append((f"{doc.relative_to(REPO)}: {line[:80]}", words[:cut]))
    return out


COMMANDS = commands()


def test_the_guides_show_commands_of_both_programs():
    assert {words[0] for _, words in COMMANDS} == set(PROGRAMS)


@pytest.mark.parametrize("where, words", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_parses(where, words):
    from asyncrl.client.cli import build_parser as client_parser
    from asyncrl.coordinator.cli import build_parser as coordinator_parser

    parser = coordinator_parser() if words[0] == "asyncrl-coordinator" else client_parser()
    try:
        parser.parse_args(words[1:])
    except SystemExit as exc:
        pytest.fail(f"{where}: {' '.join(words)} does not parse (exit {exc.code})")
