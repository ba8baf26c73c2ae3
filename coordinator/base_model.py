"""The run's base model, pinned (models/pinning.py) with the coordinator's one twist: a resumed run stays on the
commit its checkpoint was trained on. Used by the hub (coordinator/service.py) and by DDP followers
(coordinator/learner/ddp.py), which must load exactly the files rank 0 pinned."""

from __future__ import annotations

from pathlib import Path

from asyncrl.models import pinning, sources

from .checkpoint import latest_meta
from .config import CoordinatorConfig


def resolve_model(cfg: CoordinatorConfig, *, out=print):
    """The run's base model pinned to an immutable revision (models/pinning.py): a `ResolvedBase` whose
    `path` holds exactly the files every manifest pins. On --resume a moving `model_revision` ("main")
    becomes the commit the checkpoint was trained on, so an upstream push cannot change a run midway."""
    revision = cfg.model_revision
    if cfg.resume and not pinning.is_commit_sha(revision):
        meta = latest_meta(Path(cfg.run_dir)) or {}
        if meta.get("base_model") == cfg.model and pinning.is_commit_sha(meta.get("base_revision", "")):
            revision = meta["base_revision"]
    return sources.resolve(cfg.model, revision, out=out)
