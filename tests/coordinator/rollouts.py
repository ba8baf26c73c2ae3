"""A volunteer's signed rollout batch for one leased prompt (shared by the ingest-facing unit tests)."""

from __future__ import annotations

import numpy as np

from asyncrl import tasks
from asyncrl.protocol import envelope, messages


def sealed_batch(board, tokenizer, who, *, audience: bytes, sampling: messages.SamplingParams, run_id: str = "r",
                 version: int = 0) -> bytes:
    """Lease one prompt from `board` to `who`, answer it with two honest completions, seal for `audience`."""
    lease = board.lease(who.public_key, 1)[0]
    ids = tokenizer(lease.prompt.text)["input_ids"]
    comps = []
    for letters in ("aaaa", "abab"):
        toks = tokenizer(letters)["input_ids"]
        comps.append(messages.Completion(np.asarray(toks, "<i4").tobytes(), np.full(len(toks), -1.0, "<f4").tobytes(),
                                         tasks.score(lease.prompt.reward, letters, lease.prompt.answer), "length"))
    group = messages.RolloutGroup(lease.lease_id, lease.prompt.prompt_id, np.asarray(ids, "<i4").tobytes(), tuple(comps))
    batch = messages.RolloutBatch(run_id=run_id, adapter_version=version, client_name="alice", sampling=sampling,
                                  groups=(group,), generated_at=0.0)
    return envelope.seal(who, "rollout_batch", messages.encode(batch), audience=audience)
