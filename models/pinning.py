"""Base-model pinning: the exact files a run trains on and serves, and the check a volunteer makes.

Everyone in a swarm must run the same base model: different weights or a different tokenizer make an
honest volunteer's logprobs and rewards disagree with the coordinator's, which would look like lying.
So the coordinator resolves its base to an immutable `BasePin` at start and publishes it in every
adapter manifest; a volunteer loads exactly those files and refuses, with a `PinCode`, before it
generates anything — never a strike, nothing sent.

    revision          immutable: the hub commit sha (`model_revision`, a branch/tag/sha, resolved with
                      huggingface_hub), "sha256:<hex>" for a local directory (a content hash of its
                      model and tokenizer files), or "gguf-sha256:<hex>" for a GGUF (the file's sha256)
    weights_sha256    content hash of the model files: *.safetensors (+ index), config.json,
                      generation_config.json
    tokenizer_sha256  content hash of the tokenizer files (tokenizer.json, tokenizer_config.json, ...)
    stop_token_ids    the stop set both engines stop on and ingest derives `finish_reason` from:
                      generation_config.eos_token_id (an int or a list) plus the tokenizer's eos token.
                      Qwen2.5-Instruct: <|im_end|> and <|endoftext|>.

A content hash is sha256 over "name sha256(file)" lines of the recognised files, sorted by name. Files
in a Hugging Face cache snapshot are symlinks to `blobs/<sha256 of the content>` for LFS files (the
weights): that name is used instead of re-reading gigabytes; it is the same value a full hash of a
plain copy gives, so a `--model DIR` copy of the same snapshot matches. Weights must be safetensors
(no pickle anywhere).

Where the files come from (`resolve` on the coordinator, `locate` on a volunteer: tiny, a local directory, a
hub id, a GGUF) is models/sources.py, which builds on this module and on models/gguf.py.

Error codes (`PinCode`; tests assert on them, people read the message):
  REVISION_MISMATCH     the model files differ from the pinned ones
  TOKENIZER_MISMATCH    the tokenizer files differ
  STOP_TOKENS_MISMATCH  the stop set read from the files differs (e.g. another transformers version)
  MODEL_UNAVAILABLE     cannot find or fetch the model at that revision (offline, no copy, bad id)
  NOT_PINNED            the manifest carries no pin (a coordinator that does not pin), or a directory
                        that is not a model
  ADAPTER_MISMATCH      (raised by the client) the adapter's tensors do not fit the verified base model
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors",)
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "chat_template.jinja", "chat_template.json")
_SHA1 = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class PinCode(str, enum.Enum):
    """Why a base model was refused. Value == name; add members, never rename them."""

    REVISION_MISMATCH = "REVISION_MISMATCH"
    TOKENIZER_MISMATCH = "TOKENIZER_MISMATCH"
    STOP_TOKENS_MISMATCH = "STOP_TOKENS_MISMATCH"
    MODEL_UNAVAILABLE = "MODEL_UNAVAILABLE"
    NOT_PINNED = "NOT_PINNED"
    ADAPTER_MISMATCH = "ADAPTER_MISMATCH"


class PinError(RuntimeError):
    """A base model that cannot be pinned or does not match its pin; `.code` says which (stable)."""

    def __init__(self, code: PinCode, detail: str):
        self.code = PinCode(code)
        self.detail = detail
        super().__init__(f"{self.code.value}: {detail}")


@dataclass(frozen=True)
class BasePin:
    name: str                # what the manifest calls the model: hub id, local path, or the tiny model's name
    revision: str            # hub commit sha, or "sha256:<hex>" for a local directory
    weights_sha256: str
    tokenizer_sha256: str
    stop_token_ids: tuple[int, ...]

    def short(self) -> str:
        return self.revision[:19] if self.revision.startswith("sha256:") else self.revision[:12]


@dataclass(frozen=True)
class ResolvedBase:
    path: str      # local directory holding exactly the pinned files: what from_pretrained / vLLM load
    pin: BasePin


def pin_of(manifest) -> BasePin:
    """The pin an `AdapterManifest` (schema 2) publishes."""
    return BasePin(name=manifest.base_model, revision=manifest.base_revision,
                   weights_sha256=manifest.base_weights_sha256, tokenizer_sha256=manifest.tokenizer_sha256,
                   stop_token_ids=tuple(manifest.stop_token_ids))


# ---- hashing -------------------------------------------------------------------------------------
def _file_sha256(path: Path) -> str:
    if path.is_symlink():  # HF cache: snapshots/<sha>/<file> -> ../../blobs/<sha256 of the content>
        target = Path(os.readlink(path)).name
        if _SHA256.match(target):
            return target
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _content_hash(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.name):
        h.update(f"{f.name} {_file_sha256(f)}\n".encode())
    return "sha256:" + h.hexdigest()


def model_files(path: Path) -> list[Path]:
    return [p for p in path.iterdir() if p.is_file() and (p.name.endswith(WEIGHT_SUFFIXES) or p.name in MODEL_FILES)]


def tokenizer_files(path: Path) -> list[Path]:
    return [path / n for n in TOKENIZER_FILES if (path / n).is_file()]


def weights_hash(path: str | os.PathLike) -> str:
    path = Path(path)
    files = model_files(path)
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in files) or not (path / "config.json").is_file():
        raise PinError(PinCode.NOT_PINNED, f"{path} is not a model directory (needs config.json and *.safetensors "
                                           "weights; pickled .bin weights are not loaded)")
    return _content_hash(files)


def tokenizer_hash(path: str | os.PathLike) -> str:
    files = tokenizer_files(Path(path))
    if not files:
        raise PinError(PinCode.NOT_PINNED, f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)")
    return _content_hash(files)


def local_revision(weights_sha256: str, tokenizer_sha256: str) -> str:
    """The revision of a local directory: one hash over its model and tokenizer hashes."""
    return "sha256:" + hashlib.sha256(f"{weights_sha256}\n{tokenizer_sha256}\n".encode()).hexdigest()


def stop_token_ids(path: str | os.PathLike, tokenizer=None) -> tuple[int, ...]:
    """generation_config.eos_token_id (int or list; config.json's when there is no generation config)
    plus the tokenizer's eos token id, sorted — the set vLLM stops on by default, made explicit."""
    path = Path(path)
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
                break
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise PinError(PinCode.NOT_PINNED, f"{path}: no eos token in generation_config.json, config.json or the "
                                           "tokenizer; generation could never stop")
    return tuple(sorted(int(i) for i in ids))


def pin_directory(path: str | os.PathLike, *, name: str, revision: str | None = None) -> BasePin:
    """Hash a local model directory. `revision` = a hub commit sha when the directory is that snapshot."""
    w, t = weights_hash(path), tokenizer_hash(path)
    return BasePin(name=name, revision=revision or local_revision(w, t), weights_sha256=w, tokenizer_sha256=t,
                   stop_token_ids=stop_token_ids(path))


# ---- revisions and the check a volunteer makes ---------------------------------------------------
def is_commit_sha(revision: str) -> bool:
    return bool(_SHA1.match(revision or ""))


def verify(path: str | os.PathLike, pin: BasePin, *, where: str = "") -> None:
    """Raise PinError unless `path` holds `pin`'s model files, tokenizer files and stop set."""
    where = where or str(path)
    weights = weights_hash(path)
    if weights != pin.weights_sha256:
        raise PinError(PinCode.REVISION_MISMATCH,
                       f"{where} is not the coordinator's base model {pin.name} (revision {pin.short()}): its model "
                       f"files hash to {weights[:19]}, the run pins {pin.weights_sha256[:19]}. Use exactly that "
                       "revision (or drop --model to fetch it)")
    tokenizer = tokenizer_hash(path)
    if tokenizer != pin.tokenizer_sha256:
        raise PinError(PinCode.TOKENIZER_MISMATCH,
                       f"{where} has the right weights but another tokenizer ({tokenizer[:19]}, the run pins "
                       f"{pin.tokenizer_sha256[:19]}); copy the tokenizer files of {pin.name} at revision {pin.short()}")
    stops = stop_token_ids(path)
    if stops != tuple(pin.stop_token_ids):
        raise PinError(PinCode.STOP_TOKENS_MISMATCH,
                       f"{where} stops on tokens {list(stops)}, the run on {list(pin.stop_token_ids)} (same files: "
                       "check that your transformers version matches the coordinator's)")
