"""Base-model pinning: what a pin covers, and every way a volunteer's copy is refused (by PinCode)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from asyncrl.models import pinning, sources
from asyncrl.models.pinning import PinCode, PinError
from asyncrl.models.tinymodel import write_tiny_model

from tests.hub_cache import fake_hub_cache, hub_cache  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("pin") / "tiny")


@pytest.fixture(scope="module")
def instruct(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("pin") / "tiny-instruct", instruct=True)


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def code_of(fn, *a, **kw) -> PinCode:
    with pytest.raises(PinError) as info:
        fn(*a, **kw)
    return info.value.code


def test_a_pin_covers_weights_tokenizer_and_the_stop_set(tiny, instruct):
    pin = pinning.pin_directory(tiny, name="t")
    assert pin.revision.startswith("sha256:") and len(pin.revision) == 7 + 64
    assert pin.revision == pinning.local_revision(pin.weights_sha256, pin.tokenizer_sha256)
    assert pin.stop_token_ids == (0,)
    # Qwen2.5-Instruct's layout: generation_config stops on <|im_end|> and <|endoftext|>
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(instruct)
    ipin = pinning.pin_directory(instruct, name="i")
    assert ipin.stop_token_ids == tuple(sorted({tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids(
        "<|endoftext|>")})) and len(ipin.stop_token_ids) == 2
    assert ipin.tokenizer_sha256 != pin.tokenizer_sha256


def test_an_identical_copy_is_accepted(tiny, tmp_path):
    pin = pinning.pin_directory(tiny, name="t")
    got = sources.locate(pin, override=str(copy_of(tiny, tmp_path / "copy")))
    assert got.path == str(tmp_path / "copy")


def test_changed_weights_are_a_revision_mismatch(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    pin = pinning.pin_directory(tiny, name="t")
    other = copy_of(tiny, tmp_path / "edited")
    tensors = load_file(str(other / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1e-3  # one weight nudged: "an edited local copy"
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    assert code_of(sources.locate, pin, override=str(other)) is PinCode.REVISION_MISMATCH


def test_changed_generation_config_is_a_revision_mismatch(instruct, tmp_path):
    pin = pinning.pin_directory(instruct, name="i")
    other = copy_of(instruct, tmp_path / "gen")
    cfg = json.loads((other / "generation_config.json").read_text())
    cfg["eos_token_id"] = cfg["eos_token_id"][:1]  # a copy that stops on <|im_end|> only
    (other / "generation_config.json").write_text(json.dumps(cfg))
    assert code_of(sources.locate, pin, override=str(other)) is PinCode.REVISION_MISMATCH


def test_changed_tokenizer_is_a_tokenizer_mismatch(tiny, tmp_path):
    pin = pinning.pin_directory(tiny, name="t")
    other = copy_of(tiny, tmp_path / "tok")
    tc = json.loads((other / "tokenizer_config.json").read_text())
    tc["model_max_length"] = 128
    (other / "tokenizer_config.json").write_text(json.dumps(tc))
    assert code_of(sources.locate, pin, override=str(other)) is PinCode.TOKENIZER_MISMATCH


def test_a_different_stop_set_is_refused_even_with_the_same_files(tiny):
    pin = pinning.pin_directory(tiny, name="t")
    other = pinning.BasePin(pin.name, pin.revision, pin.weights_sha256, pin.tokenizer_sha256, (0, 5))
    assert code_of(pinning.verify, tiny, other) is PinCode.STOP_TOKENS_MISMATCH


def test_unpinned_manifest_and_missing_copies(tiny, tmp_path):
    pin = pinning.pin_directory(tiny, name=str(tmp_path / "gone"))
    assert code_of(sources.locate, pinning.BasePin("m", "main", "", "", ()), override=str(tiny)) is PinCode.NOT_PINNED
    assert code_of(sources.locate, pin, override=str(tmp_path / "nowhere")) is PinCode.MODEL_UNAVAILABLE
    # a coordinator's local directory the volunteer has no copy of: "pass --model DIR"
    assert code_of(sources.locate, pin) is PinCode.MODEL_UNAVAILABLE
    (tmp_path / "empty").mkdir()
    assert code_of(sources.locate, pin, override=str(tmp_path / "empty")) is PinCode.NOT_PINNED


def test_local_directory_revision_in_the_config_is_checked(tiny):
    pin = pinning.pin_directory(tiny, name=str(tiny))
    assert sources.resolve(str(tiny), "main").pin == pin                 # a moving name: nothing to check
    assert sources.resolve(str(tiny), pin.revision).pin == pin           # the right content hash
    assert code_of(sources.resolve, str(tiny), "sha256:" + "0" * 64) is PinCode.REVISION_MISMATCH


# ---- the hub path, offline: a Hugging Face cache laid out by hand, read by huggingface_hub itself ----------
def test_hub_model_resolves_to_its_commit_sha_offline(tiny, hub_cache):  # noqa: F811
    sha = "3f" * 20
    fake_hub_cache(hub_cache, "acme/tiny-qwen2", tiny, sha)
    got = sources.resolve("acme/tiny-qwen2", "main", out=lambda s: None)
    assert got.pin.revision == sha and Path(got.path).name == sha     # "main" -> the immutable commit
    plain = pinning.pin_directory(tiny, name="x")
    # the cache's blob names stand in for hashing the weights, and give what a full hash of a copy gives
    assert got.pin.weights_sha256 == plain.weights_sha256 and got.pin.tokenizer_sha256 == plain.tokenizer_sha256
    assert sources.locate(got.pin).path == got.path                    # a volunteer: revision=sha, verified
    unknown = pinning.BasePin("acme/tiny-qwen2", "4e" * 20, got.pin.weights_sha256, got.pin.tokenizer_sha256,
                              got.pin.stop_token_ids)
    assert code_of(sources.locate, unknown) is PinCode.MODEL_UNAVAILABLE  # not cached, and offline
    assert code_of(sources.resolve, "acme/never-downloaded", "main", out=lambda s: None) is PinCode.MODEL_UNAVAILABLE
