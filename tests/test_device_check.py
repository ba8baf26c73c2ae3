"""bench/device_check.py --smoke: the device check's CPU run writes every key the GPU run fills, measures
what a CPU can (learner and bare tokens/s at >= 2 micro-batches with checkpointing, generation, the audit
statistic, the merge), leaves only GPU-only figures null, and never imports hivemind or vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_ONLY = {"gpu", "learner_peak_gpu_bytes", "bare_peak_gpu_bytes", "peak_flops", "mfu", "mfu_6n", "bare_mfu",
            "peak_gpu_bytes"}


def leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("versions", "errors"):
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_smoke_run_fills_every_key_of_the_gpu_run(tmp_path):
    sys.path.insert(0, str(ROOT))
    from bench.device_check import empty_result
    from bench.learner_throughput import coordinator_checkpointing

    out = tmp_path / "D.json"
    # The budget is generous so that a loaded test machine never skips a section (speed goals live in bench/).
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "device_check.py"), "--smoke", "--json-out", str(out),
                          "--budget-s", "900", "--threads", "1"], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    got = json.loads(out.read_text())
    assert out.with_suffix(".txt").read_text().startswith("device check (smoke, cpu): complete")
    assert {k for k, _ in leaves(got)} == {k for k, _ in leaves(empty_result())}
    assert got["complete"] and not got["skipped"] and not got["errors"] and got["loaded_forbidden"] == []
    for key, value in leaves(got):
        if key.rsplit(".", 1)[-1] in GPU_ONLY:
            assert value is None, key  # not measurable on a CPU: null, never a made-up figure
        else:
            assert value is not None, key
    for role in ("small", "large"):
        x = got["learner"][role]
        assert x["micro_batches"] >= 2 and x["bare_micro_batches"] == x["micro_batches"]
        assert x["gradient_checkpointing"] is coordinator_checkpointing() and x["lora_dtype"] == "float32"
        assert x["learner_tokens_per_s"] > 0 and x["bare_tokens_per_s"] > 0 and x["ratio"] > 0
    assert got["generation"]["tokens"] > 0
    audit = got["audit"]
    assert audit["batches"] == len(audit["mismatch"]) >= 1
    assert audit["passed_at_learned"] == audit["batches"]  # honest samples pass the tolerance learned from them
    assert got["export"]["merge_s"] > 0 and got["export"]["bytes_written"] > 0
