"""Volunteer lifecycle against a real coordinator: Ctrl-C semantics and refusing a foreign base model."""

from __future__ import annotations

import json
import signal

import pytest

from tests.conftest import wait_for, wait_for_join

pytestmark = pytest.mark.integration


@pytest.fixture
def coordinator(procs, tmp_path):
    run = tmp_path / "run"
    procs.start("coordinator", ["-m", "asyncrl.coordinator.cli", "run", "--model", "tiny", "--run-dir", str(run),
                                "--max-steps", "0", "--threads", "1", "--min-groups", "1", "--max-wait-s", "1"])
    return wait_for_join(run)


def _join(procs, name, join, data, *extra):
    return procs.start(name, ["-m", "asyncrl.client.cli", "join", join, "--name", name, "--data-dir", str(data),
                              "--threads", "1", *extra])


def test_first_ctrl_c_finishes_and_flushes(procs, coordinator, tmp_path):
    data = tmp_path / "bob"
    bob = _join(procs, "bob", coordinator, data)
    wait_for(lambda: (data / "status.json").exists() and json.loads((data / "status.json").read_text())
             ["batches_acked"] >= 1, 300, "bob's first acked batch")
    procs.signal(bob, signal.SIGINT)
    assert bob.wait(120) == 0, bob.log_path.read_text()[-2000:]
    assert not list((data / "outbox").glob("*.batch")), "a clean stop uploads everything it generated"
    status = json.loads((data / "status.json").read_text())
    assert status["batches_rejected"] == {}


def test_foreign_base_model_is_refused_with_one_line(procs, coordinator, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.models.tinymodel import build_config, build_tokenizer

    tok = build_tokenizer()
    cfg = build_config(len(tok))
    cfg.intermediate_size = 320  # another model: the coordinator's LoRA tensors cannot fit it
    other = tmp_path / "other-model"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(other)
    tok.save_pretrained(other)
    carol = _join(procs, "carol", coordinator, tmp_path / "carol", "--model", str(other))
    assert carol.wait(180) == 1
    log = carol.log_path.read_text()
    assert "Traceback" not in log
    error = [l for l in log.splitlines() if l.startswith("asyncrl-client: error:")]
    assert len(error) == 1 and "asyncrl/tiny-qwen2" in error[0], log[-2000:]
