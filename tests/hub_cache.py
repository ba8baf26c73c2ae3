"""A Hugging Face hub cache laid out by hand (no network), for tests of the hub path of base-model pinning.

huggingface_hub itself reads it: `snapshot_download(repo, revision=...)` in offline mode resolves refs and
snapshots exactly as it would for a real download.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest


def fake_hub_cache(cache: Path, repo: str, files: Path, sha: str) -> None:
    """models--org--name/{refs/main, blobs/<hash>, snapshots/<sha>/<file> -> blob}, as huggingface_hub writes it.
    LFS files (the weights) are blobs named by the sha256 of their content, like on the hub."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)
    (root / "blobs").mkdir()
    snap = root / "snapshots" / sha
    snap.mkdir(parents=True)
    for f in files.iterdir():
        if f.name.startswith("."):
            continue
        data = f.read_bytes()
        blob_name = hashlib.sha256(data).hexdigest() if f.suffix == ".safetensors" else hashlib.sha1(data).hexdigest()
        (root / "blobs" / blob_name).write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(root / "blobs" / blob_name, snap))


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)
    return cache
