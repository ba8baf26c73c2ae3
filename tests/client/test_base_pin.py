"""A volunteer checks the manifest's base-model pin before it starts an engine, and refuses with a PinCode."""

from __future__ import annotations

import json
import shutil

import pytest

from asyncrl.client.session import BaseModelMismatch
from asyncrl.client.worker import Volunteer, VolunteerConfig
from asyncrl.models import pinning
from asyncrl.models.tinymodel import write_tiny_model
from asyncrl.protocol import messages

PEER = "12D3KooWCTPoZcmRwD9Wv1yMmMqnmYb8gQiyGtf68YLDZ3iRuz7o"
LORA = messages.LoraSpec(4, 8.0, 0.0, ("q_proj",))


def manifest_for(pin: pinning.BasePin, **kw) -> messages.AdapterManifest:
    fields = dict(run_id="r", version=0, parent_version=None, keyframe_version=0, base_model=pin.name,
                  base_revision=pin.revision, lora=LORA, codec="c", tensors=(messages.TensorSpec("a", "bf16", (1,)),),
                  raw_bytes=2, compressed_bytes=0, chunk_bytes=1024, chunk_hashes=(), created_at=0.0,
                  base_weights_sha256=pin.weights_sha256, tokenizer_sha256=pin.tokenizer_sha256,
                  stop_token_ids=pin.stop_token_ids)
    fields.update(kw)
    return messages.AdapterManifest(**fields)


class RecordingEngineFactory:
    """Stands in for make_engine: records whether the volunteer got as far as starting an engine."""

    def __init__(self):
        self.calls = []
        self.contexts = []  # max_model_len per engine started

    def __call__(self, kind, model, lora, **kw):
        self.calls.append((model, kw.get("stop_token_ids")))
        self.contexts.append(kw.get("max_model_len"))
        return object()


@pytest.fixture
def volunteer(tmp_path, monkeypatch):
    factory = RecordingEngineFactory()
    monkeypatch.setattr("asyncrl.client.engine.make_engine", factory)

    def make(model=None):
        vol = Volunteer(VolunteerConfig(address=f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}", data_dir=tmp_path / "v",
                                        model=model, quiet=True))
        return vol, factory
    return make


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("b") / "instruct", instruct=True)
    return path, pinning.pin_directory(path, name=str(path))


def test_a_matching_copy_starts_the_engine_with_the_published_stop_set(volunteer, base, tmp_path):
    path, pin = base
    copy = shutil.copytree(path, tmp_path / "copy")
    vol, factory = volunteer(model=str(copy))
    vol.load_engine(manifest_for(pin))
    assert factory.calls == [(str(copy), pin.stop_token_ids)] and len(pin.stop_token_ids) == 2


@pytest.mark.parametrize("edit, code", [
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "rope_theta": 5000.0})), "REVISION_MISMATCH"),
    (lambda d: (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text().replace('"a":', '"a" :', 1)),
     "TOKENIZER_MISMATCH"),
])
def test_a_different_copy_is_refused_before_any_engine_starts(volunteer, base, tmp_path, edit, code):
    path, pin = base
    copy = shutil.copytree(path, tmp_path / "edited")
    edit(copy)
    vol, factory = volunteer(model=str(copy))
    with pytest.raises(BaseModelMismatch) as info:
        vol.load_engine(manifest_for(pin))
    assert info.value.code == code and factory.calls == []


def test_a_manifest_without_a_pin_is_refused(volunteer, base):
    path, pin = base
    vol, factory = volunteer(model=str(path))
    with pytest.raises(BaseModelMismatch) as info:
        vol.load_engine(manifest_for(pin, tokenizer_sha256="", stop_token_ids=()))
    assert info.value.code == "NOT_PINNED" and factory.calls == []


@pytest.mark.parametrize("published, flag, context", [(1536, None, 1536), (1536, 512, 512), (0, None, None)])
def test_the_engine_context_is_the_tasks_longest_sequence_not_the_models(base, tmp_path, monkeypatch, published,
                                                                          flag, context):
    path, pin = base
    factory = RecordingEngineFactory()
    monkeypatch.setattr("asyncrl.client.engine.make_engine", factory)
    said = []
    vol = Volunteer(VolunteerConfig(address=f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}", data_dir=tmp_path / "v",
                                    model=str(path), quiet=True, max_model_len=flag), out=said.append)
    vol.load_engine(manifest_for(pin, max_context_tokens=published))
    assert factory.contexts == [context]  # --max-model-len wins; 0 (not said) leaves the model's own limit
    why = {1536: "the task's longest prompt + max_new_tokens", 512: "--max-model-len", None: "the model's own limit"}
    assert said[-1].startswith("engine: ") and why[flag or (published or None)] in said[-1]
