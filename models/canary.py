"""The adapter-identity canary: proof that a published LoRA version really reached a volunteer's engine.

The most reported silent failure in async LoRA RL is an engine that never got the adapter (it serves the
frozen base model, and its batches then read as "staleness" or, here, as LOGPROB_MISMATCH strikes against
an honest volunteer). So each version's signed manifest carries a `messages.Canary`: a fixed probe prompt
and completion with the learner's per-token log-probs of the completion under that version *and* under
the base model alone (`make_canary`, on the learner thread at export: two forward passes of a few dozen
tokens). Both are scored with the LoRA tensors rounded to the publish dtype (`published_lora`): the weights
volunteers really serve. Scored with the learner's fp32 LoRA instead, the canary drifted from every honest
engine as the adapter grew: a tiny-model swarm's v1551 (LoRA delta norm 12, bf16 published) read 0.082 per
token off on both its volunteers, past the fp32 tolerance, and they refused it and all later work (CI,
2026-12-07). A volunteer scores the probe with its own engine after loading the version (`Engine.score`) and
`judge`s it:

  diff       mean |engine - canary.logprobs| per completion token
  base_diff  mean |engine - canary.base_logprobs|
  passed     diff <= tolerance (this engine's: TOLERANCE by dtype). A version not yet told apart from the
             base model on the probe (|logprobs - base_logprobs| <= tolerance: version 0's zero LoRA-B, a
             barely trained adapter) passes an engine that dropped it too — harmless, nothing differs yet
             (the verdict says so)

Temperature 1, no top-k/top-p: the raw model distribution, the same in every engine.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from asyncrl.protocol import messages

PROBE_PROMPT = "Adapter canary. Describe a lighthouse at dawn in one sentence."
PROBE_COMPLETION = " A pale beam sweeps the grey water as gulls wake over the rocks."
TOLERANCE = {"fp32": 0.05, "bf16": 0.15, "fp16": 0.1, "": 0.15}
"""Mean |log-prob| difference per token an engine of this dtype may show against the learner and still
serve the same weights (reduction order, kernels, the published dtype of the LoRA tensors)."""


def probe_ids(tokenizer) -> tuple[list[int], list[int]]:
    prompt = list(tokenizer(PROBE_PROMPT, add_special_tokens=False)["input_ids"])
    completion = list(tokenizer(PROBE_COMPLETION, add_special_tokens=False)["input_ids"])
    return prompt, completion


def completion_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """Per-token log-probs of `completion` after `prompt` under `model` (temperature 1), float32."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([prompt + completion], dtype=torch.long, device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, ids[0, len(prompt):, None]).squeeze(1).cpu().tolist()


def _f32(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def _i32(values) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


@contextlib.contextmanager
def published_lora(model, dtype: str):
    """Within the block, `model`'s LoRA parameters hold their values rounded to `dtype` (what `models.lora.
    export_lora` publishes and volunteers load); the exact values come back after it. Only LoRA tensors are
    copied (a 7B model's rank-16 adapter: ~40M values), on their own device."""
    import torch

    from asyncrl.models.lora import TORCH_DTYPES

    target = TORCH_DTYPES[dtype]
    saved = []
    with torch.no_grad():
        try:
            for name, p in model.named_parameters():
                if "lora_" in name and p.dtype != target:
                    saved.append((p, p.detach().clone()))
                    p.copy_(p.to(target))
            yield model
        finally:
            for p, exact in saved:
                p.copy_(exact)


def make_canary(model, tokenizer, dtype: str = "fp32") -> messages.Canary:
    """Learner thread: the canary of the adapter `model` (a PEFT model) holds now, as published in `dtype`
    (the coordinator's --publish-dtype): scored with the LoRA tensors volunteers will load."""
    was_training = model.training
    model.eval()
    try:
        prompt, completion = probe_ids(tokenizer)
        with published_lora(model, dtype):
            with_adapter = completion_logprobs(model, prompt, completion)
        with model.disable_adapter():
            base = completion_logprobs(model, prompt, completion)
    finally:
        model.train(was_training)
    return messages.Canary(_i32(prompt), _i32(completion), _f32(with_adapter), _f32(base))


def canary_tokens(canary: messages.Canary) -> tuple[list[int], list[int]]:
    return (np.frombuffer(canary.prompt_token_ids, dtype="<i4").tolist(),
            np.frombuffer(canary.completion_token_ids, dtype="<i4").tolist())


@dataclass(frozen=True)
class Verdict:
    passed: bool
    diff: float
    base_diff: float
    tolerance: float
    told_apart: bool  # the version differs from the base model on the probe by more than the tolerance

    def explain(self, version: int) -> str:
        """One line for the volunteer: what differs and what to try."""
        if self.passed:
            return (f"adapter v{version} canary passed: log-probs within {self.diff:.4f} of the coordinator's "
                    f"(tolerance {self.tolerance})" + ("" if self.told_apart else "; this version is not yet told "
                                                       "apart from the base model"))
        closer = ("they match the base model without the adapter: the LoRA did not reach the engine"
                  if self.base_diff < self.diff else "they match neither the adapter nor the base model")
        return (f"adapter v{version} failed its canary: this engine's log-probs differ from the coordinator's by "
                f"{self.diff:.3f} per token (tolerance {self.tolerance}; base model {self.base_diff:.3f}) — "
                f"{closer}. Not generating with v{version}. Try `--engine transformers`, or another vLLM build "
                "(LoRA support), and tell the operator")


def judge(engine_logprobs, canary: messages.Canary, *, dtype: str = "") -> Verdict:
    """Compare an engine's scores of the probe with the canary (module docstring)."""
    tol = TOLERANCE.get(dtype, TOLERANCE[""])
    got = np.asarray(engine_logprobs, dtype=np.float64)
    want = np.frombuffer(canary.logprobs, dtype="<f4").astype(np.float64)
    base = np.frombuffer(canary.base_logprobs, dtype="<f4").astype(np.float64)
    if got.shape != want.shape:
        return Verdict(False, float("inf"), float("inf"), tol, True)
    diff, base_diff = float(np.abs(got - want).mean()), float(np.abs(got - base).mean())
    told_apart = float(np.abs(want - base).mean()) > tol
    return Verdict(diff <= tol, diff, base_diff, tol, told_apart)
