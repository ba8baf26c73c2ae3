"""GRPO loss for asynchronous, possibly stale, volunteer rollouts.

Variant (and sources):
- Advantages: group-relative, A_i = r_i - mean(r_group), optionally divided by std(r_group) + eps
  (GRPO, Shao et al. 2024 "DeepSeekMath"; TRL `scale_rewards="group"`; Dr. GRPO (Liu et al. 2025)
  argues for no std scaling: `scale_rewards="none"`).
- Policy ratio and clipping (PPO, Schulman et al. 2017) with asymmetric bounds
  clip(ratio, 1 - epsilon, 1 + epsilon_high) (DAPO "clip-higher", Yu et al. 2025; TRL `epsilon_high`).
- Off-policy correction, `correction`:
    "clip"            ratio = pi_theta / mu, mu = the volunteer's *sampling* logprobs: plain PPO where the
                      behaviour policy plays "old policy". Stale tokens whose ratio left the band get no
                      gradient. This is the default.
    "tis-token"       decoupled PPO (AReaL, Fu et al. 2025; TRL `vllm_importance_sampling_correction`):
    "tis-sequence"    ratio = pi_theta / pi_prox with pi_prox = the current policy (detached), times a
                      truncated importance weight w = min(pi_prox / mu, cap) per token or per sequence
                      (product over the sequence's tokens). TRL's "token_truncate" / "sequence_truncate".
    "none"            ratio against the detached current policy and no weight: treats stale data as
                      on-policy. Only for the staleness benchmark's "uncorrected" arm.
- Loss normalisation, `loss_type` (TRL semantics):
    "grpo"     mean over each sequence's tokens, then mean over sequences;
    "dr_grpo"  sum over all tokens / (num_sequences * max_completion_length);
    "dapo"     sum over all tokens / number of tokens in the batch (token-level mean).
- KL to the reference policy: off (beta = 0), as in DAPO / Dr. GRPO and TRL's default.

Everything here is pure tensor math on padded [B, T] tensors so it can be unit-tested against
hand-computed values (tests/coordinator/test_loss.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossType = Literal["grpo", "dr_grpo", "dapo"]
Correction = Literal["clip", "tis-token", "tis-sequence", "none"]
ScaleRewards = Literal["group", "none"]


@dataclass(frozen=True)
class LossConfig:
    loss_type: LossType = "grpo"
    correction: Correction = "clip"
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    is_cap: float = 2.0
    scale_rewards: ScaleRewards = "group"
    max_completion_length: int = 16  # only used by dr_grpo's constant normaliser


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, scale: ScaleRewards = "group",
                     eps: float = 1e-4) -> torch.Tensor:
    """Per-sequence advantage r - mean(group) (divided by the group's std + eps when scale="group").

    `group_ids[i]` says which group sequence i belongs to; groups may have different sizes.
    std is the unbiased sample std, as in TRL.
    """
    adv = torch.empty_like(rewards)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx]
        centred = r - r.mean()
        if scale == "group":
            std = r.std() if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
            centred = centred / (std + eps)
        adv[idx] = centred
    return adv


@dataclass
class LossStats:
    loss: torch.Tensor
    clip_fraction: float
    ratio_mean: float
    ratio_max: float
    is_weight_mean: float
    is_truncated_fraction: float


def grpo_loss(logps: torch.Tensor, sampling_logps: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, cfg: LossConfig) -> LossStats:
    """logps, sampling_logps, mask: [B, T]; advantages: [B]. Returns the scalar loss and statistics."""
    mask = mask.to(logps.dtype)
    adv = advantages.unsqueeze(1)
    if cfg.correction == "clip":
        anchor = sampling_logps
    else:
        anchor = logps.detach()
    log_ratio = (logps - anchor) * mask
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)

    weight = torch.ones_like(logps)
    truncated = torch.zeros_like(logps)
    if cfg.correction in ("tis-token", "tis-sequence"):
        log_w = (logps.detach() - sampling_logps) * mask
        if cfg.correction == "tis-sequence":
            log_w = log_w.sum(dim=1, keepdim=True).expand_as(logps)
        raw = torch.exp(log_w)
        weight = torch.clamp(raw, max=cfg.is_cap)
        truncated = (raw > cfg.is_cap).to(logps.dtype)
    per_token = per_token * weight

    n_tokens = mask.sum().clamp(min=1.0)
    if cfg.loss_type == "grpo":
        per_seq = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        loss = per_seq.mean()
    elif cfg.loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (logps.shape[0] * cfg.max_completion_length)
    elif cfg.loss_type == "dapo":
        loss = (per_token * mask).sum() / n_tokens
    else:  # pragma: no cover - guarded by config validation
        raise ValueError(f"unknown loss_type {cfg.loss_type!r}")

    with torch.no_grad():
        is_clipped = ((ratio < 1.0 - cfg.epsilon) & (adv < 0)) | ((ratio > 1.0 + cfg.epsilon_high) & (adv > 0))
        stats = LossStats(
            loss=loss,
            clip_fraction=float((is_clipped.to(mask.dtype) * mask).sum() / n_tokens),
            ratio_mean=float((ratio * mask).sum() / n_tokens),
            ratio_max=float((ratio * mask + (1 - mask) * 0).max()),
            is_weight_mean=float((weight * mask).sum() / n_tokens),
            is_truncated_fraction=float((truncated * mask).sum() / n_tokens),
        )
    return stats
