"""The logit processing volunteers sample under, written once for the engine that samples with it
(client/engine.py) and for the learner and the audit that score its samples (models/logprobs.py).

The distribution a volunteer samples from — and whose log-probs it reports — is the *processed* one,
in vLLM 0.32's order (vllm/v1/sample/sampler.py: logits processors, penalties, then `sample`: temperature,
min_p, top-k/top-p), which the transformers engine copies:

  1. ids at or past len(tokenizer) masked (the padded embedding rows; vLLM `allowed_token_ids`);
  2. repetition penalty (vLLM `apply_repetition_penalties_torch`, HF's RepetitionPenaltyLogitsProcessor):
     a token seen in the prompt or in the completion so far has its logit multiplied by 1/penalty when it
     is positive and by penalty otherwise;
  3. temperature;
  4. min_p (vLLM MinPLogitsProcessor): a token whose probability is below min_p x the largest is dropped;
  5. top-k: the k largest logits are kept (ties with the k-th kept);
  6. top-p (vLLM `apply_top_k_top_p_pytorch`, HF TopPLogitsWarper): sorted ascending, the prefix whose
     cumulative probability is <= 1 - top_p is dropped; the most likely token always stays.

Dropped tokens get logit -inf: they have probability 0 and cannot be sampled; the log-probs are those of
the renormalised distribution over the kept set. The scorer (learner, audit) treats the kept set and the
penalty's per-token scale as constants of the position (they are piecewise constant in the weights), so
the gradient of log q(token) is (onehot - q) over the kept set, times the penalty scale, times 1/temperature.

Defaults (top_p 1, top_k 0, min_p 0, repetition_penalty 1) touch nothing: `SamplingKnobs.active` is False
and callers skip this module, so the default path is bit for bit what it was before these knobs existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROCESSED_BYTES_PER_LOGIT = 32
"""Peak bytes per (position, vocabulary id) while processing a chunk: the fp32 logits, an ascending sort
(fp32 values + int64 indices), its softmax and cumulative sum, and boolean masks. The scorer sizes its
head chunks with this instead of 4 when any knob is active, so the head's peak stays within its budget."""


@dataclass(frozen=True)
class SamplingKnobs:
    """The processing knobs of one sampling configuration (protocol.messages.SamplingParams' fields)."""

    top_p: float = 1.0
    top_k: int = 0             # 0 (or negative) = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, sampling) -> "SamplingKnobs":
        return cls(float(getattr(sampling, "top_p", 1.0)), int(getattr(sampling, "top_k", 0)),
                   float(getattr(sampling, "min_p", 0.0)), float(getattr(sampling, "repetition_penalty", 1.0)))

    @property
    def active(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0 or self.repetition_penalty != 1.0


@dataclass
class TokenSampling:
    """Knobs per scored position ([N] tensors) and, for the repetition penalty, what each position has seen:
    the first `seen[n]` ids of row `row[n]` of `context` (prompt + completion before the token)."""

    top_p: torch.Tensor    # float32 [N]
    top_k: torch.Tensor    # int64 [N], <= 0 = off
    min_p: torch.Tensor    # float32 [N]
    penalty: torch.Tensor  # float32 [N], 1 = off
    context: torch.Tensor | None = None  # int64 [R, W]
    row: torch.Tensor | None = None      # int64 [N]
    seen: torch.Tensor | None = None     # int64 [N]
    seen_ids: torch.Tensor | None = None  # bool [N, V]: the seen set itself (a generating engine keeps it)

    @classmethod
    def uniform(cls, n: int, knobs: SamplingKnobs, device, **context) -> "TokenSampling":
        full = lambda v, dt: torch.full((n,), v, dtype=dt, device=device)  # noqa: E731
        return cls(full(knobs.top_p, torch.float32), full(max(knobs.top_k, 0), torch.long),
                   full(knobs.min_p, torch.float32), full(knobs.repetition_penalty, torch.float32), **context)

    def __getitem__(self, part: slice) -> "TokenSampling":
        cut = lambda t: None if t is None else t[part]  # noqa: E731
        return TokenSampling(self.top_p[part], self.top_k[part], self.min_p[part], self.penalty[part],
                             self.context, cut(self.row), cut(self.seen), cut(self.seen_ids))

    def seen_mask(self, vocab: int) -> torch.Tensor:
        """[N, vocab] bool: the ids each position has seen (one spare column takes the unseen slots)."""
        if self.seen_ids is not None:
            return self.seen_ids[:, :vocab]
        n, width = self.row.shape[0], self.context.shape[1]
        ids = self.context[self.row].clamp(max=vocab)
        ids = ids.masked_fill(torch.arange(width, device=ids.device).unsqueeze(0) >= self.seen.unsqueeze(1), vocab)
        out = torch.zeros((n, vocab + 1), dtype=torch.bool, device=ids.device)
        return out.scatter_(1, ids, True)[:, :vocab]


def penalty_scale(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """[N, V] factor of the repetition penalty (vLLM's arithmetic): 1/penalty on seen positive logits,
    penalty on seen others, 1 elsewhere. The sign of a logit is the same before and after temperature."""
    pen = torch.where(seen, penalty.unsqueeze(1), 1.0)
    return torch.where(logits > 0, 1.0 / pen, pen)


def dropped(logits: torch.Tensor, ts: TokenSampling) -> torch.Tensor | None:
    """[N, V] bool, True where min_p / top-k / top-p drop the token (`logits` after penalty and temperature,
    -inf where already excluded); None when none of the three is on for any position."""
    vocab = logits.shape[-1]
    min_on, k_on, p_on = ts.min_p > 0, (ts.top_k > 0) & (ts.top_k < vocab), ts.top_p < 1
    if not bool(min_on.any() | k_on.any() | p_on.any()):
        return None
    drop = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    if bool(min_on.any()):
        probs = torch.softmax(logits, dim=-1)
        drop |= probs < probs.amax(dim=-1, keepdim=True) * ts.min_p.unsqueeze(1)
        del probs
        logits = logits.masked_fill(drop, float("-inf"))
    if bool(k_on.any() | p_on.any()):
        asc = torch.sort(logits, dim=-1).values
        if bool(k_on.any()):
            kth = asc.gather(1, (vocab - ts.top_k.clamp(1, vocab)).unsqueeze(1))
            kth = torch.where(k_on.unsqueeze(1), kth, float("-inf"))
            drop |= logits < kth
            asc.masked_fill_(asc < kth, float("-inf"))
        if bool(p_on.any()):
            cut = torch.softmax(asc, dim=-1).cumsum_(dim=-1) <= (1 - ts.top_p).unsqueeze(1)
            cut[:, -1] = False  # the most likely token always stays
            smallest_kept = asc.gather(1, cut.sum(dim=-1, keepdim=True))
            drop |= logits < torch.where(p_on.unsqueeze(1), smallest_kept, float("-inf"))
    return drop


def process(logits: torch.Tensor, ts: TokenSampling, keep: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(processed logits with -inf on dropped ids, the penalty's [N, V] scale or None) for [N, V] fp32
    `logits` that already carry the temperature. `keep` ([N] ids): never dropped — the scorer passes the
    sampled tokens, so an engine's token that a rounding difference puts just outside our kept set gets a
    finite log-prob instead of -inf (where the sets agree, which is everywhere but such a boundary, this
    changes nothing)."""
    scale = None
    if bool((ts.penalty != 1).any()):
        scale = penalty_scale(logits, ts.seen_mask(logits.shape[-1]), ts.penalty)
        logits = logits * scale
    drop = dropped(logits, ts)
    if drop is not None:
        if keep is not None:
            drop.scatter_(1, keep.unsqueeze(1), False)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits, scale
