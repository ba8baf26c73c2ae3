"""Completion log-probabilities without a [B, T, V] fp32 logits tensor: the one implementation the
learner (policy and KL-reference passes), the generation audit and the benchmarks share.

Design (docs/learner.md has the memory budget):
- The decoder runs once and returns hidden states; the LM head runs only on the positions that predict a
  completion token (every token j < comp_len of each row — `logits_to_keep` taken to its end: no head work
  on prompt or pad positions).
- The head is applied `head_chunk_tokens(V)` tokens at a time inside one autograd Function
  (`SelectiveLogSoftmax`): forward computes logits for a chunk (matmul in the model's dtype, upcast to
  fp32), keeps only log p(taken token) = logit - logsumexp and the token entropy, and frees the chunk;
  backward recomputes the chunk's logits and turns them into the gradient in place (softmax, scale,
  scatter the one-hot). Peak memory of the head = one fp32 chunk (HEAD_CHUNK_BYTES) plus its bf16 matmul
  output, whatever the batch. The recompute costs one extra head matmul; measured on CPU it is still
  ~3x faster than autograd's naive full-vocabulary path, which is bound by allocating and walking several
  [T, V] temporaries (docs/learner.md).
- Why not Liger-Kernel's fused linear cross-entropy: it is Triton-only (no CPU path), and its GRPO loss
  chunks over whole rows with the loss inside the kernel, which would tie the loss code to the kernel.
  This stays plain torch, works on CPU and CUDA, under DDP/FSDP and with any loss built on top.
- A head that is not a plain `nn.Linear` (e.g. LoRA on `lm_head`) goes through the same chunking with
  non-reentrant activation checkpointing of the head call instead of the fused Function.
- Sampling knobs (top-p, top-k, min-p, repetition penalty; models/sampling.py): when a batch uses any, each
  chunk's logits are processed as the engines process them before the softmax, so the log-probs are those
  of the truncated, renormalised distribution the volunteer sampled from; the chunk is smaller by
  PROCESSED_BYTES_PER_LOGIT / 4 (the sort over the vocabulary and its temporaries live inside it).
- The distribution is over the ids the tokenizer has (`vocab_limit` = len(tokenizer)): the embedding
  matrix is padded past it (Qwen2.5: 151,936 rows, 151,665 tokens) and both engines mask those ids
  (client/engine.py), so the head's rows beyond the limit take no part in the softmax here either.

`CompletionScorer` wraps a (PEFT) causal LM as one module whose forward is exactly this computation, so
DDP / FSDP can wrap it and see one forward per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .sampling import PROCESSED_BYTES_PER_LOGIT, TokenSampling, process

HEAD_CHUNK_BYTES = 256 * 1024 * 1024  # fp32 logits of one head chunk (about 441 tokens at a 151,936 vocabulary)
UNSUPPORTED_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def head_chunk_tokens(vocab_size: int, budget_bytes: int = HEAD_CHUNK_BYTES) -> int:
    return max(1, budget_bytes // (4 * max(1, vocab_size)))


class SelectiveLogSoftmax(torch.autograd.Function):
    """log softmax(h W^T + b)[target] (and the entropy, not differentiable) for [N, H] hidden states, with
    per-token inverse temperatures, over the head's first `vocab_limit` rows (None = all); logits never
    outlive the call, backward recomputes them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_temp, with_entropy=True, vocab_limit=None, sampling=None):
        rows = weight.shape[0]
        weight, bias = _limited(weight, bias, vocab_limit)
        logits, _ = _processed(_logits(hidden, weight, bias, inv_temp), sampling, targets)
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(1, targets.unsqueeze(1)).squeeze(1) - lse
        if with_entropy:  # one more pass over the chunk; the reference and audit passes skip it
            probs = (logits - lse.unsqueeze(1)).exp_()
            finite = logits if sampling is None else logits.nan_to_num(neginf=0.0)  # dropped ids: p = 0
            entropy = lse - torch.linalg.vecdot(probs, finite)
            del probs, finite
        else:
            entropy = torch.zeros_like(lse)
        del logits
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), targets, inv_temp, lse)
        ctx.has_bias, ctx.rows, ctx.sampling = bias is not None, rows, sampling
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, inv_temp, lse = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        g, scale = _processed(_logits(hidden, weight, bias, inv_temp), ctx.sampling, targets)
        g.sub_(lse.unsqueeze(1)).exp_().mul_(-grad_logp.unsqueeze(1))  # d logp / d logits = onehot - softmax
        g.scatter_add_(1, targets.unsqueeze(1), grad_logp.unsqueeze(1))  # (softmax is 0 on dropped ids)
        if scale is not None:
            g.mul_(scale)  # chain rule through the repetition penalty (its scale is constant per position)
        g.mul_(inv_temp.unsqueeze(1))  # chain rule through logits / temperature
        grad_h = grad_w = grad_b = None
        pad = ctx.rows - weight.shape[0]  # rows beyond vocab_limit: no logit, no gradient
        if ctx.needs_input_grad[0]:
            grad_h = (g.to(weight.dtype) @ weight).to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g.t().to(hidden.dtype) @ hidden).to(weight.dtype)
            grad_w = torch.cat([grad_w, grad_w.new_zeros(pad, grad_w.shape[1])]) if pad else grad_w
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(bias.dtype)
            grad_b = torch.cat([grad_b, grad_b.new_zeros(pad)]) if pad else grad_b
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _processed(logits, sampling, targets):
    """(logits after models/sampling.py's processing, the penalty's scale or None); as they are without
    `sampling`. The sampled tokens are kept in the kept set (sampling.process `keep`)."""
    if sampling is None:
        return logits, None
    return process(logits, sampling, keep=targets)


def _limited(weight, bias, vocab_limit):
    """The head's first `vocab_limit` rows (the ids the tokenizer has); all of them for None."""
    if vocab_limit is None or vocab_limit >= weight.shape[0]:
        return weight, bias
    return weight[:vocab_limit], (bias[:vocab_limit] if bias is not None else None)


def _logits(hidden, weight, bias, inv_temp) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    if bias is not None:
        logits += bias.float()
    return logits.mul_(inv_temp.unsqueeze(1))


def _generic_head(head, hidden, targets, inv_temp, vocab_limit=None, sampling=None):
    logits = head(hidden).float()[:, :vocab_limit] * inv_temp.unsqueeze(1)
    if sampling is not None:  # autograd differentiates through the penalty's scale and the -inf fill
        with torch.no_grad():
            processed, scale = _processed(logits.detach(), sampling, targets)
        logits = (logits if scale is None else logits * scale).masked_fill(processed.isneginf(), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(1, targets.unsqueeze(1)).squeeze(1) - lse
    with torch.no_grad():
        finite = logits if sampling is None else logits.nan_to_num(neginf=0.0)  # dropped ids: p = 0
        entropy = lse - (torch.softmax(logits, dim=-1) * finite).sum(-1)
    return logp, entropy


def head_logprobs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor,
                  chunk: int, with_entropy: bool = True, vocab_limit: int | None = None,
                  sampling: TokenSampling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] log-probabilities of `targets` and [N] entropies (zeros without `with_entropy`) under `head`,
    `chunk` tokens at a time; the softmax over the first `vocab_limit` ids (None = the whole head).
    `sampling`: per-position top-p / top-k / min-p / repetition penalty (models/sampling.py) — the
    log-probs are then those of the processed distribution the engines sample, and the chunk shrinks by
    PROCESSED_BYTES_PER_LOGIT / 4 so that the sort and its temporaries fit the same byte budget."""
    from torch.utils.checkpoint import checkpoint

    fused = type(head) is nn.Linear
    if sampling is not None:
        chunk = max(1, chunk * 4 // PROCESSED_BYTES_PER_LOGIT)
    logps, ents = [], []
    for lo in range(0, hidden.shape[0], chunk):
        h, t, s = hidden[lo:lo + chunk], targets[lo:lo + chunk], inv_temp[lo:lo + chunk]
        ts = sampling[lo:lo + chunk] if sampling is not None else None
        if fused:
            lp, ent = SelectiveLogSoftmax.apply(h, head.weight, head.bias, t, s, with_entropy, vocab_limit, ts)
        elif torch.is_grad_enabled():
            lp, ent = checkpoint(_generic_head, head, h, t, s, vocab_limit, ts, use_reentrant=False)
        else:
            lp, ent = _generic_head(head, h, t, s, vocab_limit, ts)
        logps.append(lp)
        ents.append(ent)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(ents)


@dataclass
class TokenLogprobs:
    logps: torch.Tensor    # [B, Tmax] fp32, log pi(completion token j of row i); 0 beyond comp_len
    entropy: torch.Tensor  # [B, Tmax] fp32, entropy of pi at that position (no gradient); 0 beyond comp_len


class CompletionScorer(nn.Module):
    """A causal LM (PEFT-wrapped or not) as one module: batch -> completion log-probs and entropies.

    `batch` is `coordinator.learner.learner.collate_rows` output: right-padded `ids`/`attn` [B, W], `prompt_lens`,
    `comp_lens`, `temps` [B] and `mask` [B, Tmax]. Token j of row i is predicted by position
    prompt_len + j - 1."""

    def __init__(self, model: nn.Module, head_chunk_bytes: int = HEAD_CHUNK_BYTES, vocab_limit: int | None = None):
        """`vocab_limit`: len(tokenizer); ids at or beyond it (the padded embedding rows) are outside the
        distribution, as both engines sample it (client/engine.py). None = the whole head."""
        super().__init__()
        self.model = model
        self.vocab_limit = vocab_limit
        causal = model.get_base_model() if hasattr(model, "get_base_model") else model
        for attr in UNSUPPORTED_LOGIT_TRANSFORMS:
            value = getattr(causal.config, attr, None)
            if value not in (None, 1, 1.0):
                raise ValueError(f"models whose config sets {attr}={value!r} are not supported by the chunked "
                                 "log-prob head (models/logprobs.py)")
        self._causal = [causal]  # not a submodule twice (parameters are registered once, through `model`)
        self.chunk = head_chunk_tokens(causal.config.vocab_size, head_chunk_bytes)

    def forward(self, batch: dict[str, torch.Tensor], entropy: bool = True) -> TokenLogprobs:
        causal = self._causal[0]
        ids, comp_lens = batch["ids"], batch["comp_lens"].to(batch["ids"].device)
        B, tmax = batch["mask"].shape
        hidden = causal.get_decoder()(input_ids=ids, attention_mask=batch["attn"], use_cache=False).last_hidden_state
        valid = torch.arange(tmax, device=ids.device).unsqueeze(0) < comp_lens.unsqueeze(1)  # [B, Tmax]
        rows, cols = valid.nonzero(as_tuple=True)
        pos = batch["prompt_lens"].to(ids.device)[rows] - 1 + cols
        inv_temp = (1.0 / batch["temps"].to(ids.device, torch.float32))[rows]
        sampling = None
        if "top_p" in batch:  # collate_rows adds the knobs only when some row uses one (models/sampling.py)
            knob = lambda k: batch[k].to(ids.device)[rows]  # noqa: E731
            sampling = TokenSampling(knob("top_p"), knob("top_k"), knob("min_p"), knob("repetition_penalty"),
                                     context=ids, row=rows, seen=pos + 1)
        lp, ent = head_logprobs(causal.get_output_embeddings(), hidden[rows, pos], ids[rows, pos + 1], inv_temp,
                                self.chunk, with_entropy=entropy, vocab_limit=self.vocab_limit, sampling=sampling)
        logps = torch.zeros((B, tmax), dtype=torch.float32, device=ids.device).index_put((rows, cols), lp)
        entropy = torch.zeros((B, tmax), dtype=torch.float32, device=ids.device).index_put((rows, cols), ent.detach())
        return TokenLogprobs(logps, entropy)
