"""Off-policy corrections: the per-token policy-gradient term for stale volunteer samples.

Owned by the staleness work (issue 18). `coordinator/learner/loss.py` owns advantages, normalisation and
the KL term; this module owns only what a correction does to each completion token, so it composes
with any normalisation (`loss.token_weights` over the step's global normaliser): `token_term` maps a
micro-batch's [b, T] tensors to [b, T] tensors row by row — except the M2PO mask, whose statistic is
a property of the tokens it is computed over (`m2po_keep_mask`). The learner computes it per
micro-batch, as the paper's own code does (verl micro-batches): every micro-batch's kept tokens then
have mean (log r)^2 < tau, so the step's kept tokens do too; a step that fits one micro-batch gets
exactly the whole-batch mask, a split step may mask a few more tokens than the whole-batch mask would.

Notation: pi = current policy (logps, carries the gradient), sg(.) = stop-gradient, mu = the
volunteer's *sampling* policy (its reported logprobs), r = pi / mu, A = the sequence's advantage.
One optimizer step per batch, so the "old" policy of PPO is the behaviour policy mu unless said
otherwise. Per-token loss terms (minimised; the caller multiplies by the token mask and normalises):

  clip          -min(r A, clip(r, 1-eps, 1+eps_high) A)                      PPO (Schulman et al. 2017),
                asymmetric bounds (DAPO "clip-higher", Yu et al. 2025). With `dual_clip` c > 1 and A < 0
                the term is min(that, -c A): dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in
                MOBA Games with Deep RL", Eq. 5: max(min(r A, clip(r) A), c A) for A < 0; c = 3 there and
                in verl's `clip_ratio_c`), so a negative advantage on a token the current policy now
                likes far more than the volunteer did (r > c) stops pushing instead of pushing r A.
  tis-token     -sg(w) A * pi/sg(pi), w = min(sg(pi)/mu, is_cap)              truncated IS on decoupled PPO
  tis-sequence  the same with w = min(prod_t sg(pi_t)/mu_t, is_cap) per sequence   (AReaL, Fu et al. 2025;
                TRL `vllm_importance_sampling_correction`, "token_truncate" / "sequence_truncate"). With
                one update per batch the proximal policy *is* sg(pi), so the PPO clip never binds.
  aipo          -min(r, aipo_cap) A                                           AIPO (LlamaRL, arXiv
                2505.24034) as prime-rl implemented it (src/prime_rl/trainer/rl/loss.py before
                2025-09-23: `torch.clamp(exp(logp - old_logp), max=clip_ratio) * -A`, clip_ratio 8):
                one-sided: tokens with r > aipo_cap get no gradient whatever the sign of A; below the cap
                the gradient is the full IS-weighted r A.
  m2po          -M r A, M in {0, 1}                                           M2PO (Zheng, Zhao, Chen 2025,
                "Prosperity before Collapse", arXiv 2510.01161; AReaL `_apply_m2po_masking`): with
                M2 = mean over the batch's tokens of (log r)^2, sort the tokens by (log r)^2 and mask
                (M = 0) the largest ones, fewest first, until the mean over the tokens left is below
                `m2_threshold` (tau = 0.04 in the paper and AReaL's example). No ratio clipping. If
                even a single token is at or above tau every token is masked (the step then has no
                policy gradient). The paper's code (github.com/Infini-AI-Lab/M2PO, `compute_m2po_policy_loss`)
                ships a variant that turns the same budget into an adaptive PPO clip range; this is
                the masking form the paper's text and AReaL describe. `dual_clip` bounds A < 0 here too.
  decoupled     -min(rho A, clip(rho, 1-eps, 1+eps_high) A) * sg(w)           decoupled PPO (AReaL, Fu et al.
                2025, arXiv 2505.24298, Eq. 5) with the proximal policy approximated log-linearly between
                mu and sg(pi) by version (AReaL `compute_prox_logp_approximations`, "loglinear"):
                log pi_prox = log mu + alpha (sg(log pi) - log mu), alpha = max(0, g - prox_lag) / g for a
                row g versions stale; rho = pi / sg(pi_prox) = r^(1-alpha) in value, w = min(pi_prox / mu,
                is_cap) = min(r^alpha, is_cap). AReaL's proximal policy is one version behind the learner
                (prox_lag = 1); prox_lag = G anchors the trust region at most G versions behind, so a row
                at most G versions old is plain `clip` and an older one may have moved log(1+eps_high)/G
                per version before its tokens are clipped: the trust region widens with staleness instead
                of pinning the policy to a months-old sampler. `dual_clip` bounds A < 0 on rho.
  none          -A * pi/sg(pi)                                                stale data as if on-policy;
                only for the staleness benchmark's uncorrected arm.

`TokenTerm.no_grad` marks the tokens the correction left without a policy gradient (clipped,
dual-clipped, capped, masked): the "masked/clipped" figure the step metrics break down by staleness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .loss_config import LossConfig


@dataclass
class TokenTerm:
    per_token: torch.Tensor
    """[B, T] policy-gradient loss per token (unmasked, unnormalised, before any KL term)."""
    ratio: torch.Tensor
    """[B, T] the objective's ratio, detached: pi/mu for clip/aipo/m2po, 1 for the decoupled modes."""
    weight: torch.Tensor
    """[B, T] detached IS weight multiplying the term (tis-*; 1 elsewhere)."""
    truncated: torch.Tensor
    """[B, T] 1 where an IS cap bound (tis-*: w hit is_cap; aipo: r above aipo_cap)."""
    no_grad: torch.Tensor
    """[B, T] bool: tokens the correction left without a policy gradient."""


def m2po_keep_mask(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO's token mask, [B, T] bool (True = keep): drop the largest (log r)^2 until the mean of the rest < tau.

    `log_ratio` = sg(log pi) - log mu (detached), `mask` = the completion-token mask. Padding is never kept.
    """
    import torch

    on = mask > 0
    m2 = log_ratio.detach().double().pow(2)[on]
    keep_flat = torch.zeros_like(m2, dtype=torch.bool)
    n = m2.numel()
    if n:
        m2_sorted, order = torch.sort(m2, descending=True, stable=True)
        suffix_mean = m2_sorted.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=m2.dtype, device=m2.device)
        below = torch.nonzero(suffix_mean < threshold)
        if below.numel():
            n_masked = int(below[0])
            keep_sorted = torch.ones(n, dtype=torch.bool, device=m2.device)
            keep_sorted[:n_masked] = False
            keep_flat[order] = keep_sorted
    keep = torch.zeros_like(on)
    keep[on] = keep_flat
    return keep


def token_term(logps: torch.Tensor, sampling_logps: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, cfg: LossConfig, keep: torch.Tensor | None = None,
               row_staleness: torch.Tensor | None = None) -> TokenTerm:
    """The correction's per-token term. logps (with grad), sampling_logps, mask: [B, T]; advantages: [B].

    `keep` (m2po only): a precomputed M2PO mask over the whole step; computed from these rows if None.
    `row_staleness` [B]: each row's version gap (decoupled: None = every row fresh; the others ignore it).
    """
    import torch

    adv = advantages.unsqueeze(1).to(logps.dtype)
    mask = mask.to(logps.dtype)
    on = mask > 0
    ones = torch.ones_like(logps)
    zeros = torch.zeros_like(logps)
    behaviour_log = (logps.detach() - sampling_logps) * mask  # log(sg(pi)/mu), 0 on padding
    c = cfg.correction

    if c in ("clip", "aipo", "m2po"):
        ratio = torch.exp((logps - sampling_logps) * mask)  # pi/mu, with the gradient
    elif c == "decoupled":
        # rows without a version gap are fresh (the learner always passes the gaps: `collate_rows`)
        gap = (torch.zeros(logps.shape[0], device=logps.device, dtype=logps.dtype) if row_staleness is None
               else row_staleness.to(logps.device, logps.dtype)).view(-1, 1)
        alpha = torch.where(gap > cfg.prox_lag, (gap - cfg.prox_lag) / gap.clamp(min=1.0), torch.zeros_like(gap))
        log_prox = sampling_logps + alpha * (logps.detach() - sampling_logps)
        ratio = torch.exp((logps - log_prox) * mask)  # pi/pi_prox = r^(1 - alpha), with the gradient
    else:
        ratio = torch.exp((logps - logps.detach()) * mask)  # 1 in value, gradient of log pi
    r = ratio.detach()
    weight, truncated = ones, zeros
    no_grad = torch.zeros_like(on)

    if c in ("clip", "decoupled"):
        lo, hi = 1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high
        per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
        no_grad = ((r < lo) & (adv < 0)) | ((r > hi) & (adv > 0))
        if c == "decoupled":
            raw = torch.exp((log_prox - sampling_logps) * mask)  # pi_prox / mu = r^alpha
            weight = torch.clamp(raw, max=cfg.is_cap)
            truncated = (raw > cfg.is_cap).to(logps.dtype)
    elif c in ("tis-token", "tis-sequence"):
        log_w = behaviour_log
        if c == "tis-sequence":
            log_w = log_w.sum(dim=1, keepdim=True).expand_as(logps)
        raw = torch.exp(log_w)
        weight = torch.clamp(raw, max=cfg.is_cap)
        truncated = (raw > cfg.is_cap).to(logps.dtype)
        per_token = -ratio * adv
    elif c == "aipo":
        per_token = -torch.clamp(ratio, max=cfg.aipo_cap) * adv
        capped = r > cfg.aipo_cap
        truncated = capped.to(logps.dtype)
        no_grad = capped
    elif c == "m2po":
        if keep is None:
            keep = m2po_keep_mask(behaviour_log, mask, cfg.m2_threshold)
        per_token = -ratio * adv * keep.to(logps.dtype)
        no_grad = ~keep
    elif c == "none":
        per_token = -ratio * adv
    else:  # pragma: no cover - guarded by config validation
        raise ValueError(f"unknown correction {c!r}")

    if c in ("clip", "m2po", "decoupled") and cfg.dual_clip > 0.0:
        bound = -cfg.dual_clip * adv  # c|A| where A < 0
        dual = (adv < 0) & (r > cfg.dual_clip)
        per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
        no_grad = no_grad | dual
    per_token = per_token * weight
    return TokenTerm(per_token=per_token, ratio=r, weight=weight, truncated=truncated, no_grad=no_grad & on)



def decay_row_weights(staleness: list[int] | torch.Tensor, half_life: float) -> torch.Tensor:
    """`stale_weighting = "decay"`: row weights 0.5 ** (gap / half_life) over a whole step's rows, normalised
    to mean 1 — a re-balancing between the step's rows, so a step whose rows are equally stale is unchanged
    (and the step size of a uniformly stale batch too). Computed from the version gaps alone, before any
    forward pass, so it is micro-batch exact. (An ESS-based variant — each group weighted by the effective
    sample size of its IS weights — was measured and hurt: docs/staleness.md.)"""
    import torch

    w = torch.pow(0.5, torch.as_tensor(staleness, dtype=torch.float64) / half_life)
    return (w / w.mean()).float() if w.numel() else w.float()
