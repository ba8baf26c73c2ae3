"""A resumed run keeps the base-model commit its checkpoint was trained on, even after `main` moved."""

from __future__ import annotations

import json

from asyncrl.coordinator.base_model import resolve_model
from asyncrl.coordinator.config_file import resolve_config
from asyncrl.models.tinymodel import write_tiny_model

from tests.hub_cache import fake_hub_cache, hub_cache  # noqa: F401  (fixture)

OLD, NEW = "1a" * 20, "2b" * 20


def test_resume_repins_to_the_checkpoints_commit(tmp_path, hub_cache):  # noqa: F811
    tiny = write_tiny_model(tmp_path / "tiny")
    fake_hub_cache(hub_cache, "acme/tiny-qwen2", tiny, OLD)
    root = hub_cache / "models--acme--tiny-qwen2"
    (root / "snapshots" / NEW).symlink_to(root / "snapshots" / OLD, target_is_directory=True)
    (root / "refs" / "main").write_text(NEW)  # upstream pushed: main is another commit now
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-00000010-1"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"format": 1, "step": 10, "base_model": "acme/tiny-qwen2",
                                                "base_revision": OLD}))
    quiet = dict(out=lambda s: None)
    fresh = resolve_config({"model": "acme/tiny-qwen2", "run_dir": str(run)})
    assert resolve_model(fresh, **quiet).pin.revision == NEW        # a fresh run follows main
    resumed = resolve_config({"model": "acme/tiny-qwen2", "run_dir": str(run), "resume": True})
    assert resolve_model(resumed, **quiet).pin.revision == OLD      # --resume stays on the trained commit
    pinned = resolve_config({"model": "acme/tiny-qwen2", "run_dir": str(run), "resume": True,
                             "model_revision": NEW})
    assert resolve_model(pinned, **quiet).pin.revision == NEW       # an explicit sha is the user's choice
