"""Where a pinned base model's files come from: `resolve` on the coordinator, `locate` on a volunteer.

The coordinator turns its `--model` string into files and an immutable pin once, at start; a volunteer
finds exactly the pinned files and verifies them (models/pinning.py: what a pin is, the hashes, `verify`
and the PinCodes), refusing before any engine starts.

  "tiny"            the built-in model, written to the local cache (models/tinymodel.py)
  a local directory that directory; a volunteer passes its own copy with `--model DIR`
  a hub id          `snapshot_download(id, revision=sha)` — online, or from the HF cache when offline
  a GGUF            `PATH.gguf`, a directory holding one, or a named offline model (`smollm2-135m-instruct`):
                    converted once to a cached Hugging Face directory; revision "gguf-sha256:<the GGUF's
                    hash>", weights and tokenizer hashes of the conversion (models/gguf.py)

Imports models/pinning.py, models/gguf.py and models/tinymodel.py; none of them imports this module.
"""

from __future__ import annotations

from pathlib import Path

from . import gguf, tinymodel
from .pinning import BasePin, PinCode, PinError, ResolvedBase, is_commit_sha, pin_directory, verify

# What a hub snapshot needs for training and serving (no pickled *.bin, no other formats).
HUB_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.jinja"]


# ---- the coordinator: resolve once at start ------------------------------------------------------
def _hub_snapshot(repo_id: str, revision: str, *, out=None) -> tuple[str, str]:
    """(local snapshot dir, commit sha) for `repo_id` at `revision` (branch, tag or sha)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    sha = revision if is_commit_sha(revision) else None
    if sha is None:
        try:
            sha = HfApi().model_info(repo_id, revision=revision).sha  # the hub's answer: branch/tag -> commit
        except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError) as exc:
            raise PinError(PinCode.MODEL_UNAVAILABLE, f"{repo_id}@{revision}: {exc.__class__.__name__}: "
                                                      f"{str(exc).splitlines()[0][:200]}") from None
        except Exception as exc:  # offline mode, no network, hub down: the local cache may have it
            if out is not None:
                out(f"hub not reachable ({exc.__class__.__name__}); resolving {repo_id}@{revision} from the local cache")
    try:
        path = snapshot_download(repo_id, revision=sha or revision, allow_patterns=HUB_PATTERNS,
                                 local_files_only=sha is None)
    except Exception as exc:
        raise PinError(PinCode.MODEL_UNAVAILABLE,
                       f"cannot get {repo_id}@{sha or revision} ({exc.__class__.__name__}); with no internet, "
                       "download it once elsewhere into the Hugging Face cache, or pass a local directory") from None
    got = Path(path).name  # snapshots/<commit sha>
    if not is_commit_sha(got) or (sha is not None and got != sha):
        raise PinError(PinCode.MODEL_UNAVAILABLE, f"{repo_id}: snapshot {path} is not named by its commit sha")
    return path, got


def resolve(model: str, revision: str = "main", *, out=None) -> ResolvedBase:
    """Pin the coordinator's base model. `revision` applies to hub ids; for a local directory it may be
    its "sha256:..." revision (checked) or a moving name ("main", "") that is ignored."""
    if model in ("tiny", tinymodel.TINY_MODEL_NAME):
        path = tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir())
        return _local(path, tinymodel.TINY_MODEL_NAME, revision)
    source = gguf.gguf_source(model)
    if source is not None:
        return gguf.resolve_gguf(model, source, revision, out=out)
    if Path(model).is_dir():
        return _local(Path(model), model, revision)
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise PinError(PinCode.MODEL_UNAVAILABLE, f"{model}: no such directory (and not a hub id)")
    path, sha = _hub_snapshot(model, revision or "main", out=out)
    return ResolvedBase(path, pin_directory(path, name=model, revision=sha))


def _local(path: Path, name: str, revision: str) -> ResolvedBase:
    pin = pin_directory(path, name=name)
    if revision.startswith("sha256:") and revision != pin.revision:
        raise PinError(PinCode.REVISION_MISMATCH, f"{path} has revision {pin.revision}, the config pins {revision}")
    return ResolvedBase(str(path), pin)


# ---- a volunteer: find exactly the pinned files, or say why not ----------------------------------
def locate(pin: BasePin, *, override: str | None = None) -> ResolvedBase:
    """The local directory holding `pin`'s files, verified. `override`: the volunteer's `--model DIR`.

    Raises PinError before any engine starts; the message says what differs and what to do."""
    if not pin.revision or not pin.weights_sha256 or not pin.tokenizer_sha256 or not pin.stop_token_ids:
        raise PinError(PinCode.NOT_PINNED, f"the coordinator's manifest does not pin its base model {pin.name!r} "
                                           "(revision, weights, tokenizer and stop tokens); refusing to guess")
    if pin.revision.startswith(gguf.GGUF_REVISION_PREFIX):
        return gguf.locate_gguf(pin, override=override)
    if override:
        path, where = Path(override).expanduser(), f"--model {override}"
        if not path.is_dir():
            raise PinError(PinCode.MODEL_UNAVAILABLE, f"{where}: no such directory")
    elif pin.name == tinymodel.TINY_MODEL_NAME:
        path, where = tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()), "the built-in tiny model"
    elif Path(pin.name).is_dir():
        path, where = Path(pin.name), pin.name
    elif is_commit_sha(pin.revision):
        snapshot, _ = _hub_snapshot(pin.name, pin.revision)
        path, where = Path(snapshot), f"{pin.name}@{pin.revision[:12]}"
    else:
        raise PinError(PinCode.MODEL_UNAVAILABLE,
                       f"the coordinator trains a local directory {pin.name!r} (revision {pin.short()}); get a copy "
                       "of it and pass --model DIR")
    verify(path, pin, where=where)
    return ResolvedBase(str(path), pin)
