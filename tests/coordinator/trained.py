"""A run directory holding one real checkpoint of a non-trivial adapter on the tiny model (no swarm):
what the export and eval tests load with stock transformers + peft."""

from __future__ import annotations

from pathlib import Path


def trained_run(root: Path, lora: dict, *, b_scale: float = 0.15) -> dict:
    """Random lora_B (x b_scale), one optimizer step, adapter version 3, checkpointed under root/run."""
    import torch

    from asyncrl import tasks
    from asyncrl.coordinator import checkpoint
    from asyncrl.coordinator.ingest.ingest import Ingest
    from asyncrl.coordinator.learner.learner import Learner, TrainGroup
    from asyncrl.coordinator.learner.loss import LossConfig
    from asyncrl.coordinator.leasing.taskboard import TaskBoard
    from asyncrl.models import pinning
    from asyncrl.models.tinymodel import write_tiny_model
    from asyncrl.protocol.messages import LoraSpec

    model_dir = write_tiny_model(root / "tiny")
    spec = LoraSpec(**lora)
    learner = Learner(str(model_dir), spec, lr=1e-2, loss=LossConfig(), max_staleness=None, seed=1)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_scale)
    tok = learner.tokenizer
    comps = [tok("a" * n)["input_ids"] for n in (3, 5, 7)]
    learner.step([TrainGroup(tok("rep:a=")["input_ids"], comps, [[-1.0] * len(c) for c in comps], [0.0, 0.5, 1.0], 0)])
    learner.version = 3
    board = TaskBoard(tasks.get_task("repeat", 0), lease_timeout_s=60, max_leases_per_client=8)
    ingest = Ingest(identity_public_key=bytes(32), run_id="r", board=board, tokenizer=tok, vocab_size=64,
                    current_version=lambda: 3, max_batch_bytes=1 << 20, window_s=300)
    pin = pinning.pin_directory(model_dir, name=str(model_dir))
    run = root / "run"
    checkpoint.save(checkpoint.Checkpointer(run / "checkpoints"), gate=checkpoint.Gate(), learner=learner,
                    board=board, ingest=ingest,
                    identity=checkpoint.identity_meta(run_id="r", base_model=pin.name, base_revision=pin.revision,
                                                      lora=spec),
                    export=checkpoint.AdapterExport.of_base(spec, str(model_dir), pin))
    return {"run": run, "model": str(model_dir), "learner": learner, "spec": spec, "pin": pin}
