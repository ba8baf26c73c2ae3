"""Every source file README.md and docs/ name exists: a path under one of the repository's folders ending in a
source or document extension (`coordinator/operator/export.py`, `configs/qwen2.5-1.5b-instruct.toml`, `docs/tasks.md`),
and every capitalised `NAME.md` (at the root or in docs/). A renamed module, or a guide citing a file that was
never committed (an ARCHITECTURE.md kept outside the repository), fails here. Globs and placeholders
(`*`, `<...>`) and what runs write (`.json`, `.png`, `runs/`) are not checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FOLDERS = sorted(p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith("."))
SOURCE = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\.(?:md|py|toml|c|sh|txt))(?![\w*<-])" % "|".join(FOLDERS))
PAGE = re.compile(r"(?<![\w./-])([A-Z][\w-]*\.md)\b")


def cited(doc: Path) -> list[str]:
    text = doc.read_text()
    return sorted({m.group(1) for m in SOURCE.finditer(text)} | {m.group(1) for m in PAGE.finditer(text)})


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_file_a_guide_names_exists(doc):
    missing = [name for name in cited(doc)
               if not (REPO / name).exists() and not ("/" not in name and (REPO / "docs" / name).exists())]
    assert not missing, f"{doc.relative_to(REPO)} names files that are not in the repository: {missing}"


def test_the_check_sees_the_citations():
    names = {name for doc in DOCS for name in cited(doc)}
    assert {"docs/gpu-swarm.md", "coordinator/checkpoint.py", "configs/coordinator.example.toml", "README.md"} <= names
