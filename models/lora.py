"""LoRA adapter <-> bytes, shared by the coordinator (export) and volunteers (load).

The wire never carries torch objects: an adapter version is a list of `TensorSpec`s plus raw
little-endian bytes per tensor in the published dtype (bf16 by default), which `protocol.codec`
compresses. Tensor names are PEFT's adapter-state-dict names (adapter name stripped), so the same
bytes can be written as an ordinary PEFT directory for vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from asyncrl.protocol.atomic import write_atomic
from asyncrl.protocol.messages import LoraSpec, TensorSpec

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_INT_VIEW = {"bf16": torch.int16, "fp16": torch.int16, "fp32": torch.int32}


def peft_config(spec: LoraSpec):
    from peft import LoraConfig

    return LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=list(spec.target_modules), bias="none", task_type="CAUSAL_LM")


DTYPE_NAMES = ("auto", "bf16", "fp16", "fp32")


def resolve_placement(device: str = "auto", dtype: str | torch.dtype = "auto") -> tuple[str, torch.dtype]:
    """(device, base-weight dtype) from `--device auto|cuda|cuda:N|cpu` and `--dtype auto|bf16|fp16|fp32`.

    auto device = cuda when torch sees a GPU, else cpu; auto dtype = bf16 on a GPU that supports it (fp16 on
    one that does not), fp32 on CPU. An explicit cuda without a GPU is an error, not a silent CPU run."""
    if isinstance(dtype, torch.dtype):
        dtype = {v: k for k, v in TORCH_DTYPES.items()}.get(dtype, str(dtype))
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, not {dtype!r}")
    device = str(device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but torch {torch.__version__} sees no CUDA device")
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
    elif device != "cpu":
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {device!r}")
    if dtype == "auto":
        if device == "cpu":
            dtype = "fp32"
        else:
            dtype = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return device, TORCH_DTYPES[dtype]


def load_base_model(model: str, *, dtype: torch.dtype = torch.float32, revision: str | None = None,
                    device: str | None = None):
    """The one loading path for every model: a hub id or a local HF directory.

    Weights are read straight into `dtype` (a bf16 checkpoint never passes through an fp32 copy:
    `low_cpu_mem_usage=True` on transformers 4.x, what 5.x always does) and, for a CUDA
    `device`, straight onto that GPU (`device_map`), not through host RAM in full. `device="meta"`: the
    architecture only, no weights read (an FSDP rank > 0, which receives its shards from rank 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, revision=revision)
    if str(device) == "meta":
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model, revision=revision), dtype=dtype)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return base, tokenizer
    extra = {"device_map": device} if device is not None and str(device).startswith("cuda") else {}
    extra["low_cpu_mem_usage"] = True
    base = AutoModelForCausalLM.from_pretrained(model, revision=revision, dtype=dtype, **extra)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return base, tokenizer


def with_lora(base, spec: LoraSpec, *, seed: int = 0):
    from peft import get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(base, peft_config(spec))


def export_lora(model, dtype: str) -> tuple[list[TensorSpec], dict[str, bytes]]:
    """LoRA weights cast to the published dtype, as (specs, raw bytes by name), sorted by name."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    specs, blobs = [], {}
    for name in sorted(state):
        t = state[name].detach().to("cpu", TORCH_DTYPES[dtype]).contiguous()
        specs.append(TensorSpec(name=name, dtype=dtype, shape=tuple(t.shape)))
        blobs[name] = t.view(_INT_VIEW[dtype]).numpy().tobytes()
    return specs, blobs


def tensors_from_bytes(specs, blobs: dict[str, bytes]) -> dict[str, torch.Tensor]:
    out = {}
    for spec in specs:
        raw = bytearray(blobs[spec.name])  # writable copy: torch.frombuffer warns on read-only memory
        out[spec.name] = torch.frombuffer(raw, dtype=TORCH_DTYPES[spec.dtype]).reshape(spec.shape).clone()
    return out


def load_lora(model, tensors: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors into a PEFT model in place (shapes must match exactly)."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, tensors)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise ValueError(f"adapter has tensors the model does not: {unexpected[:3]}")


def standard_adapter_names(tensors: dict[str, torch.Tensor], adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """PEFT's in-model parameter names (`...lora_A.default.weight`) -> the names of a saved adapter
    (`...lora_A.weight`), which `PeftModel.from_pretrained` and vLLM load."""
    marker = f".{adapter_name}."
    return {k.replace(marker, ".") if marker in k else k: v for k, v in tensors.items()}


def peft_dir_files(spec: LoraSpec, base_model: str, tensors: dict[str, torch.Tensor], *,
                   revision: str | None = None) -> dict[str, bytes]:
    """The two files of an ordinary PEFT adapter directory: adapter_config.json (`base_model_name_or_path`,
    and `revision` = the pinned hub commit when there is one) + adapter_model.safetensors (standard names)."""
    from safetensors.torch import save

    cfg = peft_config(spec).to_dict()
    cfg["base_model_name_or_path"] = base_model
    if revision:
        cfg["revision"] = revision
    cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}
    return {"adapter_config.json": json.dumps(cfg, indent=2, default=str).encode(),
            "adapter_model.safetensors": save({k: v.contiguous() for k, v in sorted(tensors.items())},
                                              metadata={"format": "pt"})}


def write_peft_dir(path: Path, spec: LoraSpec, base_model: str, tensors: dict[str, torch.Tensor], *,
                   revision: str | None = None) -> Path:
    """An ordinary PEFT adapter directory (what `PeftModel.from_pretrained` and vLLM's LoRARequest load)."""
    path.mkdir(parents=True, exist_ok=True)
    for name, data in peft_dir_files(spec, base_model, tensors, revision=revision).items():
        write_atomic(path / name, data)
    return path
