"""A current-version cheater against a DDP learner: 2 real gloo ranks (torchrun), the real Ingest, Auditor,
TaskBoard and signed envelopes on rank 0, a real engine generating the honest tokens.

Under DDP the learner takes no train-time audit hook (each rank sees only its slice), so a batch claiming
the *current* version must be audited on the shadow model (by the audit worker, after the ack, before
training); before, it was never audited at all.
Rank 0 writes what happened as JSON (`--out`); tests/adversarial/test_limits.py runs it and checks it:

    torchrun --standalone --nproc-per-node 2 -m tests.adversarial.ddp_cheater --out /tmp/ddp_cheater.json
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import numpy as np
    import torch

    from asyncrl import tasks
    from asyncrl.client.engine import TransformersEngine
    from asyncrl.coordinator.ingest.ingest import Ingest
    from asyncrl.coordinator.learner.ddp import end_process, finish_rank, make_learner, world
    from asyncrl.coordinator.learner.loss import LossConfig
    from asyncrl.coordinator.leasing.taskboard import TaskBoard
    from asyncrl.coordinator.trust.access import AccessControl, AccessPolicy
    from asyncrl.coordinator.trust.audit import Auditor
    from asyncrl.models import tinymodel
    from asyncrl.models.lora import export_lora
    from asyncrl.protocol import envelope, messages
    from asyncrl.protocol.identity import Identity
    from asyncrl.tasks.sources import encode_prompt

    torch.set_num_threads(1)
    path = str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))
    lora = messages.LoraSpec(r=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj", "o_proj", "up_proj"))
    learner = make_learner(path, lora, lr=1e-2, loss=LossConfig(), max_staleness=4, seed=0)
    rank, size = world()
    if rank > 0:
        learner.follow()
        finish_rank(0)  # ends the process (world > 1 here)
        return 0
    coordinator = Identity.generate()
    sampling = messages.SamplingParams(temperature=1.0, max_new_tokens=6)
    access = AccessControl(AccessPolicy(max_strikes=3))
    auditor = Auditor(learner, tolerance=0.01, floor=1.0, keep_versions=5)
    board = TaskBoard(tasks.get_task("repeat", 0), lease_timeout_s=60, max_leases_per_client=8)
    ingest = Ingest(identity_public_key=coordinator.public_key, run_id="ddp", board=board,
                    tokenizer=learner.tokenizer, vocab_size=learner.vocab_size, current_version=lambda: learner.version,
                    max_batch_bytes=1 << 22, window_s=300, access=access, auditor=auditor, sampling=sampling)
    auditor.attach(ingest)
    specs, blobs = export_lora(learner.model, "bf16")
    auditor.remember_published(learner.version, specs, blobs, learner.steps)
    engine = TransformersEngine(path, lora, seed=1)
    engine.load_adapter(learner.version, specs, blobs)

    def batch_from(who: Identity, forge: bool) -> bytes:
        leases = board.lease(who.public_key, 2)
        prompts = [list(encode_prompt(learner.tokenizer, l.prompt.text)) for l in leases]
        groups = []
        for lease, ids, samples in zip(leases, prompts, engine.generate(prompts, 4, sampling)):
            comps = []
            for s in samples:
                text = learner.tokenizer.decode(s.token_ids, skip_special_tokens=True)
                lps = [-0.05] * len(s.logprobs) if forge else list(s.logprobs)  # confident made-up numbers
                comps.append(messages.Completion(np.asarray(s.token_ids, "<i4").tobytes(), np.asarray(lps, "<f4").tobytes(),
                                                 tasks.score(lease.prompt.reward, text, lease.prompt.answer), "length"))
            groups.append(messages.RolloutGroup(lease.lease_id, lease.prompt.prompt_id, np.asarray(ids, "<i4").tobytes(),
                                                tuple(comps)))
        b = messages.RolloutBatch(run_id="ddp", adapter_version=learner.version, client_name=who.fingerprint[:8],
                                  sampling=sampling, groups=tuple(groups), generated_at=0.0)
        return envelope.seal(who, "rollout_batch", messages.encode(b), audience=coordinator.public_key)

    honest, cheater = Identity.generate(), Identity.generate()
    result = {"world_size": size, "hook_taken": learner.audit_hook is not None,
              "reuse_learner_pass": auditor.reuse_learner_pass, "cheater": [], "honest": []}
    def final_code(sealed: bytes) -> str:
        """The ack's code, or for an acked batch its audit's verdict (audits run after the ack)."""
        ack = ingest.handle(sealed)
        if not ack.accepted:
            return ack.code
        assert ingest.audits.wait_idle(120), "the audit worker did not finish"
        codes = [v["code"] for v in ingest.verdicts if v["batch_id"] == ack.batch_id.hex()]
        return next((c for c in codes if c not in ("ACCEPTED", "AUDIT_PASSED")), "ACCEPTED")

    for _ in range(2):
        result["cheater"].append(final_code(batch_from(cheater, forge=True)))
        result["honest"].append(final_code(batch_from(honest, forge=False)))
    import threading

    items = ingest.take(1 << 20, max_wait_s=0.2, min_groups=1, stop=threading.Event())
    step = learner.step([g for it in items for g in it.groups])  # every rank takes part
    learner.close()
    result.update(trained_groups=step.groups_used if step else 0,
                  trained_from=sorted({it.signer for it in items}), honest_fp=honest.fingerprint,
                  audit=auditor.status(), cheater_strikes=access.strikes(cheater.public_key))
    with open(args.out, "w") as f:
        json.dump(result, f, default=str)
    end_process(0)  # rank 0 too ends without the interpreter's teardown (coordinator/learner/ddp.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
