"""Volunteer lifecycle against a real coordinator: Ctrl-C semantics, and refusing a base model that is not
the run's pinned one (other weights, or the right weights with an edited tokenizer) before generating —
exit code 3 with the PinCode, and nothing reaches the coordinator, so nobody is struck."""

from __future__ import annotations

import json
import signal

import pytest

from tests.conftest import wait_for
from tests.harness import start_coordinator, start_volunteer

pytestmark = pytest.mark.integration


@pytest.fixture
def coordinator(procs, tmp_path):
    run = tmp_path / "run"
    return start_coordinator(procs, run, timeout=120, no_dashboard=False, min_groups=1, max_wait_s=1).join


def _refusal(proc, timeout=180) -> str:
    """The PinCode a refusing volunteer printed (exit 3, one error line, no traceback)."""
    from asyncrl.client.cli import EXIT_BASE_MISMATCH

    assert proc.wait(timeout) == EXIT_BASE_MISMATCH, proc.log_path.read_text()[-2000:]
    log = proc.log_path.read_text()
    assert "Traceback" not in log
    error = [line for line in log.splitlines() if line.startswith("asyncrl-client: error:")]
    assert len(error) == 1, log[-2000:]
    return error[0].removeprefix("asyncrl-client: error:").split(":")[0].strip()


def test_first_ctrl_c_finishes_and_flushes(procs, coordinator, tmp_path):
    data = tmp_path / "bob"
    bob = start_volunteer(procs, coordinator, data, name="bob")
    wait_for(lambda: (data / "status.json").exists() and json.loads((data / "status.json").read_text())
             ["batches_acked"] >= 1, 300, "bob's first acked batch")
    procs.signal(bob, signal.SIGINT)
    assert bob.wait(120) == 0, bob.log_path.read_text()[-2000:]
    assert not list((data / "outbox").glob("*.payload")), "a clean stop uploads everything it generated"
    status = json.loads((data / "status.json").read_text())
    assert status["batches_rejected"] == {}
    # every ack carried a receipt signed by the join address's key, and each one is in the ledger
    assert status["receipts"] == status["batches_acked"] and status["receipts_invalid"] == 0


def test_foreign_base_model_is_refused_with_one_line(procs, coordinator, tmp_path):
    import json as _json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.models.tinymodel import build_config, build_tokenizer, write_tiny_model

    tok = build_tokenizer()
    cfg = build_config(len(tok))
    cfg.intermediate_size = 320  # another model altogether
    other = tmp_path / "other-model"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(other)
    tok.save_pretrained(other)
    carol = start_volunteer(procs, coordinator, tmp_path / "carol", name="carol", model=str(other))
    assert _refusal(carol) == "REVISION_MISMATCH"

    # The right weights (an exact copy of the tiny model), but someone edited the tokenizer config.
    edited = write_tiny_model(tmp_path / "edited")
    conf = _json.loads((edited / "tokenizer_config.json").read_text())
    conf["model_max_length"] = 128
    (edited / "tokenizer_config.json").write_text(_json.dumps(conf))
    dave = start_volunteer(procs, coordinator, tmp_path / "dave", name="dave", model=str(edited))
    assert _refusal(dave) == "TOKENIZER_MISMATCH"
    # Refused before generating: neither asked for work nor sent a batch, so the coordinator never saw their
    # keys — an honest volunteer with the wrong copy is never struck.
    from asyncrl.protocol.identity import Identity

    shutil.rmtree(edited)
    run = tmp_path / "run"
    trust = wait_for(lambda: (run / "trust.json").exists() and (run / "trust.json").read_text(), 30, "trust.json")
    for name in ("carol", "dave"):
        status = tmp_path / name / "status.json"
        assert not status.exists() or _json.loads(status.read_text())["batches_sent"] == 0
        key, created = Identity.load_or_create(tmp_path / name / "identity.key")
        assert not created and key.fingerprint not in trust
