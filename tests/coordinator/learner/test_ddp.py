"""Data-parallel equivalence: 2 CPU processes under torchrun (gloo) train the same adapter as 1 process,
with DDP and with FSDP2 (`fully_shard` of the base, which torch 2.13 runs on CPU/gloo).

Uneven slices on purpose (5 groups of 3-6 completions over 2 ranks), for the `grpo` (per-sequence),
`dr_grpo` (constant) and `dapo` (per-token) normalisations, with a KL term, and the 2-process side split into
micro-batches of at most 64 tokens (several per rank, different counts per rank, so `no_sync`
accumulation and FSDP's equal-count padding are exercised): the global step normaliser and the summed
gradient reduction must make them exact.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

LOSSES = ("grpo", "dr_grpo", "dapo")
CHECK = ["-m", "asyncrl.coordinator.learner.ddp_check", "--steps", "3", "--groups-per-step", "5", "--loss-types",
         ",".join(LOSSES), "--beta", "0.05"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    from asyncrl.coordinator.learner import ddp_check

    one = tmp_path_factory.mktemp("one") / "one.safetensors"
    assert ddp_check.main([*CHECK[2:], "--out", str(one)]) == 0
    return one


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_gloo_processes_match_one(procs, tmp_path, one_process, parallel):
    two = tmp_path / "two.safetensors"
    run = procs.start("torchrun", ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                   *CHECK, "--micro-batch-tokens", "64", "--parallel", parallel, "--out", str(two)])
    assert run.wait(300) == 0, run.log_path.read_text()[-3000:]
    a, b = load_file(str(one_process)), load_file(str(two))
    assert set(a) == set(b) and len(a) > 0
    for loss_type in LOSSES:
        keys = [k for k in a if k.startswith(loss_type + "/")]
        moved = max(float(a[k].abs().max()) for k in keys if "lora_B" in k)
        assert moved > 1e-3, "training did not move the adapter"
        diff = max(float((a[k] - b[k]).abs().max()) for k in keys)
        assert diff <= 1e-3, (loss_type, diff)  # see ddp_check --atol: AdamW amplifies ~1e-9 gradients
    assert subprocess.run([sys.executable, "-m", "asyncrl.coordinator.learner.ddp_check", "--compare", str(one_process),
                           str(two)], capture_output=True).returncode == 0
    import json

    for rank in (0, 1):
        report = json.loads((tmp_path / f"two.safetensors.rank{rank}.json").read_text())
        for learner in report["learners"]:
            assert all(key.endswith("@" + learner["learner_device"]) for key in learner["calls"])
            # FSDP: one host copy of the base (rank 0); the other rank builds it on the meta device
            assert learner["base_loaded_on"] == ("meta" if parallel == "fsdp" and rank == 1 else "cpu")


def test_collectives_run_on_the_learner_device_and_survive_an_idle_rank_0(procs, tmp_path):
    """`ddp_check --device cpu` under gloo: every collective rank 0 issued went through `Collectives` on the
    learner's own device (under NCCL, a CPU tensor would fail at the first collective), and followers waiting
    in their first step's broadcast outlive a rank 0 idle for twice the collective timeout: the heartbeat."""
    import json

    out = tmp_path / "idle.safetensors"
    run = procs.start("torchrun", ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                   "-m", "asyncrl.coordinator.learner.ddp_check", "--steps", "2",
                                   "--groups-per-step", "4",
                                   "--loss-types", "grpo", "--micro-batch-tokens", "64", "--device", "cpu",
                                   "--timeout-s", "4", "--idle-s", "8", "--out", str(out)])
    assert run.wait(300) == 0, run.log_path.read_text()[-3000:]
    report = json.loads((tmp_path / "idle.safetensors.rank0.json").read_text())
    assert report["world_size"] == 2
    (learner,) = report["learners"]
    assert learner["learner_device"] == learner["device"] == "cpu"
    ops = {key.split("@")[0] for key in learner["calls"]}
    assert {"broadcast", "all_reduce"} <= ops
    assert all(key.split("@")[1] == learner["learner_device"] for key in learner["calls"])
    assert learner["calls"]["broadcast@cpu"] >= 2 * 2 + 2  # two steps' header + payload, and heartbeats
