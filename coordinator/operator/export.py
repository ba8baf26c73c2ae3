"""`asyncrl-coordinator export`: the trained adapter out of a run directory, to take home.

    asyncrl-coordinator export --run-dir runs/r1 --out out/r1-adapter                # newest checkpoint
    asyncrl-coordinator export --run-dir runs/r1 --step 400 --out out/r1-400         # a retained one
    asyncrl-coordinator export --run-dir runs/r1 --out out/r1-merged --merge         # base + adapter, merged
    asyncrl-coordinator export --run-dir runs/r1 --out out/r1-adapter --push-to-hub me/qwen-gsm8k-lora

Output, always an ordinary Hugging Face directory:
  adapter   adapter_config.json (`base_model_name_or_path` + `revision` = the pin: the hub commit, or the
            content hash (`sha256:`/`gguf-sha256:`) of a local base, which transformers ignores when loading) and
            adapter_model.safetensors with PEFT's standard names — `PeftModel.from_pretrained(base, DIR)`,
            `AutoPeftModelForCausalLM.from_pretrained(DIR)` and vLLM's `LoRARequest(..., DIR)` load it
  --merge   the base model with the adapter merged in (`merge_and_unload`), written with `save_pretrained`,
            plus the base's tokenizer files and generation config copied byte for byte (same tokenizer hash
            and stop set): loads like any model, no peft needed. The base
            is located and verified against the run's pin first (models/pinning.py), so the merge happens
            on exactly the weights the run trained against.
Both also get `asyncrl_export.json` (run, step, adapter version, base model, revision) and a short README.md.

The source is a checkpoint's `adapter/` directory (coordinator/checkpoint.py); older checkpoints without
one are converted from their `adapter.safetensors` (PEFT's in-model names, `.default.` dropped).
`--push-to-hub` uploads the finished directory with huggingface_hub (`create_repo` + `upload_folder`) — the
only network call; the uploader is injected (`HubUploader` here), so tests stop at it offline.

Exit codes: 0 written (and uploaded) · 1 upload failed (the directory is complete) · 2 bad arguments, no
such checkpoint, or a base model that does not match the pin.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

EXPORT_INFO = "asyncrl_export.json"
EXIT_OK, EXIT_UPLOAD, EXIT_USAGE = 0, 1, 2
DTYPES = ("auto", "fp32", "bf16", "fp16")


class ExportError(RuntimeError):
    """No usable checkpoint, an existing --out, or a base model that does not match the run's pin."""


class HubUploader:
    """The real upload: huggingface_hub's `create_repo` + `upload_folder` (needs a token and internet)."""

    def __init__(self, private: bool = False):
        self.private = private

    def upload(self, folder: Path, repo_id: str) -> str:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(repo_id, repo_type="model", private=self.private, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                                 commit_message="asyncrl export")
        return str(getattr(info, "commit_url", "") or f"https://huggingface.co/{repo_id}")


@dataclass
class ExportResult:
    out: Path
    step: int
    version: int
    merged: bool
    url: str | None = None


def add_subcommand(sub) -> None:
    p = sub.add_parser("export", help="write a run's adapter (or the merged model) as a standard HF directory")
    p.add_argument("--run-dir", required=True, help="the run directory (its checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint at this optimizer step (default: newest)")
    p.add_argument("--out", required=True, help="directory to write (must not exist, or be empty)")
    p.add_argument("--merge", action="store_true", help="merge the adapter into the base model (merge_and_unload)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="tensor dtype written: auto = fp32 for an adapter (the trained master weights), the "
                        "base model's own dtype for --merge")
    p.add_argument("--base", metavar="DIR", default=None,
                   help="--merge: a local copy of the base model (verified against the run's pin); default: the "
                        "run's own directory, or the pinned hub revision")
    p.add_argument("--push-to-hub", metavar="REPO", default=None, help="upload the result to this Hub repo")
    p.add_argument("--private", action="store_true", help="create the Hub repo as private")


def main(args, *, uploader=None) -> int:
    try:
        result = export(Path(args.run_dir), Path(args.out), step=args.step, merge=args.merge, dtype=args.dtype,
                        base=args.base)
    except ExportError as exc:
        print(f"asyncrl-coordinator export: {exc}", file=sys.stderr)
        return EXIT_USAGE
    kind = "merged model" if result.merged else "adapter"
    print(f"wrote {kind} of step {result.step} (adapter v{result.version}) to {result.out}")
    if args.push_to_hub:
        uploader = uploader or HubUploader(private=args.private)
        try:
            url = uploader.upload(result.out, args.push_to_hub)
        except Exception as exc:  # offline, no token, no rights: the directory stays, say why
            print(f"asyncrl-coordinator export: upload to {args.push_to_hub} failed ({exc.__class__.__name__}: "
                  f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); {result.out} is complete, retry with "
                  "`huggingface-cli upload`", file=sys.stderr)
            return EXIT_UPLOAD
        print(f"uploaded to {url}")
    return EXIT_OK


# ---- finding the checkpoint -----------------------------------------------------------------------
def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    from ..checkpoint import PREFIX

    root = run_dir / "checkpoints"
    done = sorted(p for p in root.glob(f"{PREFIX}*") if (p / "meta.json").is_file())
    if not done:
        raise ExportError(f"no checkpoint in {root} (a run writes one every checkpoint_every steps and at its end)")
    if step is None:
        return done[-1]
    steps = {}
    for p in done:
        steps.setdefault(int(json.loads((p / "meta.json").read_text())["step"]), p)
    if step not in steps:
        raise ExportError(f"no checkpoint at step {step} in {root}; retained steps: {sorted(steps)} "
                          "(keep_checkpoints sets how many are kept)")
    return steps[step]


def _adapter_files(ckpt: Path, meta: dict) -> tuple[dict, dict]:
    """(adapter_config dict, tensors by standard name) of a checkpoint, fp32."""
    from safetensors.torch import load_file

    if (ckpt / "adapter" / "adapter_config.json").is_file():
        cfg = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
        return cfg, load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    # A checkpoint from before the PEFT directory existed: rebuild both from meta + in-model names.
    from asyncrl.models.lora import peft_config, standard_adapter_names
    from asyncrl.protocol.messages import LoraSpec

    lora = meta["lora"]
    spec = LoraSpec(r=lora["r"], alpha=lora["alpha"], dropout=0.0, target_modules=tuple(lora["target_modules"]))
    cfg = peft_config(spec).to_dict()
    cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}
    cfg["base_model_name_or_path"] = meta["base_model"]
    return cfg, standard_adapter_names(load_file(str(ckpt / "adapter.safetensors")))


def _prepare_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty; choose a new --out")
    out.mkdir(parents=True, exist_ok=True)


# ---- export -----------------------------------------------------------------------------------------
def export(run_dir: Path, out: Path, *, step: int | None = None, merge: bool = False, dtype: str = "auto",
           base: str | None = None) -> ExportResult:
    import torch

    from asyncrl.models.lora import TORCH_DTYPES

    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {DTYPES}")
    ckpt = find_checkpoint(Path(run_dir), step)
    meta = json.loads((ckpt / "meta.json").read_text())
    cfg, tensors = _adapter_files(ckpt, meta)
    _prepare_out(out)
    info = {"run_id": meta.get("run_id"), "step": int(meta["step"]), "adapter_version": int(meta["version"]),
            "base_model": meta.get("base_model"), "base_revision": meta.get("base_revision"),
            "checkpoint": ckpt.name, "merged": merge}
    if merge:
        _merge(ckpt, meta, cfg, tensors, out, dtype, base)
    else:
        from safetensors.torch import save_file

        want = torch.float32 if dtype == "auto" else TORCH_DTYPES[dtype]
        (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2, default=str))
        save_file({k: v.to(want).contiguous() for k, v in sorted(tensors.items())},
                  str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / EXPORT_INFO).write_text(json.dumps(info, indent=2))
    (out / "README.md").write_text(_card(info, cfg, merge))
    shareable(out)
    return ExportResult(out=out, step=info["step"], version=info["adapter_version"], merged=merge)


def shareable(out: Path) -> None:
    """Every file of an export readable as a normally created file is (0666 less the umask): safetensors
    creates its files 0600, which another user, a web server or a container could not read."""
    import os

    umask = os.umask(0)
    os.umask(umask)
    for path in out.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


def _merge(ckpt: Path, meta: dict, cfg: dict, tensors: dict, out: Path, dtype: str, base_override: str | None) -> None:
    """Locate the pinned base, verify it, merge the adapter (`merge_adapter`), save in the requested dtype."""
    from asyncrl.models import pinning, sources
    from asyncrl.models.lora import TORCH_DTYPES

    pin_meta = meta.get("base_pin")
    if not pin_meta:
        raise ExportError(f"{ckpt.name} records no base-model pin; export the adapter and merge it yourself")
    pin = pinning.BasePin(**{**pin_meta, "stop_token_ids": tuple(pin_meta["stop_token_ids"])})
    own = str(cfg.get("base_model_name_or_path") or "")
    try:
        base_dir = sources.locate(pin, override=base_override or (own if Path(own).is_dir() else None)).path
    except pinning.PinError as exc:
        raise ExportError(f"cannot merge: {exc}") from None
    merged = merge_adapter(base_dir, cfg, tensors)
    if dtype != "auto":
        merged = merged.to(TORCH_DTYPES[dtype])
    merged.save_pretrained(out, safe_serialization=True)
    # The base's tokenizer and generation config byte for byte (re-saving may rewrite them): the merged model
    # keeps the run's tokenizer hash and stop set (models/pinning.py).
    for f in pinning.tokenizer_files(Path(base_dir)) + [Path(base_dir) / "generation_config.json"]:
        if f.is_file():
            shutil.copyfile(f, out / f.name)


def base_dtype(base_dir: str | Path):
    """The checkpoint's own dtype, as its config.json states it (fp32 when it states none)."""
    import torch

    stated = json.loads((Path(base_dir) / "config.json").read_text())
    name = stated.get("dtype") or stated.get("torch_dtype") or "float32"
    return getattr(torch, str(name).replace("torch.", ""), torch.float32)


def merge_adapter(base_dir: str | Path, cfg: dict, tensors: dict, *, device: str = "auto"):
    """The base with the adapter merged in (`merge_and_unload`), on `device` (auto: the GPU when there is
    one), in the base's own dtype.

    The base is read straight onto the device in its dtype (models.lora.load_base_model: no fp32 copy, no full
    host copy on a GPU), so a 7B bf16 base needs ~15 GB of GPU memory, not ~30 GB of host RAM. PEFT keeps the
    adapter in fp32 and adds B @ A * scale to each bf16 weight in place: one rounding of the exact fp32 sum,
    the same bits as merging in fp32 and casting (tests/coordinator/operator/test_export.py). On a CPU-only machine the
    base must fit host RAM in its dtype; a base larger than that is not merged here (docs/learner.md)."""
    import tempfile

    import torch
    from peft import PeftModel

    from asyncrl.models.lora import load_base_model

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    base, _ = load_base_model(str(base_dir), dtype=base_dtype(base_dir), device=device)
    with tempfile.TemporaryDirectory() as tmp:  # PeftModel.from_pretrained reads a directory
        from safetensors.torch import save_file

        (Path(tmp) / "adapter_config.json").write_text(json.dumps(cfg, default=str))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(tmp) / "adapter_model.safetensors"))
        return PeftModel.from_pretrained(base, tmp, torch_device=str(base.device)).merge_and_unload()


def _card(info: dict, cfg: dict, merged: bool) -> str:
    base, rev = info["base_model"], info["base_revision"]
    load = ("from transformers import AutoModelForCausalLM\n"
            "model = AutoModelForCausalLM.from_pretrained(\"<this repo or directory>\")" if merged else
            "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n"
            f"base = AutoModelForCausalLM.from_pretrained({base!r}, revision={rev!r})\n"
            "model = PeftModel.from_pretrained(base, \"<this repo or directory>\")")
    kind = "Merged model" if merged else f"LoRA adapter (r={cfg.get('r')}, alpha={cfg.get('lora_alpha')})"
    return (f"---\nbase_model: {base}\nlibrary_name: {'transformers' if merged else 'peft'}\ntags: [asyncrl, grpo]\n"
            f"---\n\n# {kind} trained with asyncrl\n\nRun `{info['run_id']}`, optimizer step {info['step']} "
            f"(adapter version {info['adapter_version']}), base model `{base}` at revision `{rev}`.\n\n"
            f"```python\n{load}\n```\n")
