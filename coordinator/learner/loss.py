"""GRPO loss for asynchronous, possibly stale, volunteer rollouts.

Variant (and sources):
- Advantages: group-relative, A_i = r_i - mean(r_group), optionally divided by std(r_group) + eps
  (GRPO, Shao et al. 2024 "DeepSeekMath"; TRL `scale_rewards="group"`; Dr. GRPO (Liu et al. 2025)
  argues for no std scaling: `scale_rewards="none"`).
- Policy ratio and clipping (PPO, Schulman et al. 2017) with asymmetric bounds
  clip(ratio, 1 - epsilon, 1 + epsilon_high) (DAPO "clip-higher", Yu et al. 2025; TRL `epsilon_high`).
- Off-policy correction, `correction` (the per-token term; coordinator/learner/corrections.py names each
  variant, its source and its exact formula): "clip" (PPO ratio pi_theta / mu against the volunteer's
  sampling logprobs mu, with dual-clip for A < 0), "tis-token" / "tis-sequence" (truncated IS on
  decoupled PPO), "aipo" (one-sided capped IS), "m2po" (second-moment trust region), "decoupled"
  (decoupled PPO whose proximal policy is at most `prox_lag` versions behind), "none" (stale data as
  on-policy: the staleness benchmark's uncorrected arm). Default: "decoupled" with prox_lag 4 — at most
  4 versions stale it *is* "clip"; docs/staleness.md has the measurements behind the choice.
- Staleness-aware weighting, `stale_weighting` (default "none"): "decay" multiplies each row's policy
  term by 0.5^(gap / stale_half_life), normalised to mean 1 over the step's rows (`decay_row_weights`).
- Loss normalisation, `loss_type` (TRL semantics):
    "grpo"     mean over each sequence's tokens, then mean over sequences;
    "dr_grpo"  sum over all tokens / (num_sequences * max_completion_length);
    "dapo"     sum over all tokens / number of tokens in the batch (token-level mean).
- KL to the reference policy (the base model with the adapter disabled), off by default (beta = 0, as
  in DAPO / Dr. GRPO and TRL's default). When on: the k3 estimator of Schulman's "Approximating KL
  divergence" as TRL computes it, kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1, added per token
  *after* the importance weight: per_token = -min(r A, clip(r) A) * w + beta * kl_t (TRL's order).
- Truncated completions (finish_reason "length", derived by ingest from the tokens and the pinned stop
  set): `mask_truncated` drops them from the loss — DAPO's "overlong filtering" (Yu et al. 2025, §3.4;
  TRL `mask_truncated_completions`): their tokens get mask 0, they still count in their group's reward
  mean/std and, for "grpo", in the mean over sequences (as in TRL). `overlong_buffer` > 0 adds DAPO's
  "soft overlong punishment" to the task reward before advantages (TRL `get_soft_overlong_punishment`):
  with L_max = max_completion_length and L_cache = overlong_buffer,
      R_len(|y|) = 0 if |y| <= L_max - L_cache;  ((L_max - L_cache) - |y|) / L_cache if |y| <= L_max;  -1 beyond,
  times `overlong_factor`. It depends only on the completion length, so the coordinator computes it;
  volunteers keep reporting the task reward in [0, 1].
- Statistics (what `LossStats` reports, per masked token): `ratio_*` is pi_theta / mu, the current
  policy against the volunteer's sampling policy, in every mode (it is what staleness moves; in the
  "tis-*"/"none" modes the objective's own ratio is 1 by construction); clip fractions split into
  low (ratio < 1 - epsilon with A < 0) and high (ratio > 1 + epsilon_high with A > 0) against the
  objective's ratio (clip and decoupled only); IS weight mean and the fraction of tokens whose weight
  hit the cap; the off-policy figures: mean (log r)^2 (what M2PO bounds), mean r^2 (the IS weight's
  second moment), the Kish effective sample size (sum r)^2 / (N sum r^2) of the token weights r =
  pi_theta / mu, and the fraction of tokens the correction left without gradient, overall and by
  version-gap band (`corrections.STALENESS_BANDS`). r is capped at e^50 in these three sums only (so a
  float64 sum cannot overflow; a weight that large already means ESS ~ 1/N).

Structure (what micro-batching and the off-policy corrections build on):
  `policy_terms`   the objective *per token* (coordinator/learner/corrections.py's `token_term`, then KL) — a
                   function of each row alone, except M2PO's mask (a statistic of the micro-batch: see
                   corrections.py);
  `token_weights`  the normalisation: each token's coefficient from its row and the step-wide counts in a
                   `StepNormaliser` (rows, trained tokens of the whole step, every micro-batch and rank);
  `LossTotals`     statistics as sums and counts, added per micro-batch (and all-reduced under DDP).
A micro-batch's loss is sum(policy_terms.per_token * token_weights): the pieces add up to the full-batch
loss exactly (docs/learner.md). `grpo_loss` is the one-batch composition of the three.

Everything here is pure tensor math on padded [B, T] tensors so it can be unit-tested against
hand-computed values (tests/coordinator/learner/test_loss.py, tests/coordinator/learner/test_microbatch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .loss_config import LossConfig, ScaleRewards  # LossConfig is also imported from here by tests and benches

if TYPE_CHECKING:
    import torch
# torch is imported inside the functions: the coordinator's config (and so `--help`) imports this module's neighbours.

R_LOG_CAP = 50.0
"""log(pi/mu) is capped here in the second-moment / ESS sums (float64, all-reduced under DDP)."""
STALENESS_BANDS = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 128), (129, None))
"""Version-gap bands of the masked-by-staleness statistic (fixed, so the sums all-reduce across ranks)."""
STALENESS_BAND_LABELS = tuple(str(lo) if lo == hi else f"{lo}+" if hi is None else f"{lo}-{hi}"
                              for lo, hi in STALENESS_BANDS)


def staleness_bands(gaps: torch.Tensor) -> torch.Tensor:
    """Index into STALENESS_BANDS of each version gap."""
    import torch

    uppers = torch.tensor([hi for _, hi in STALENESS_BANDS[:-1]], device=gaps.device)
    return torch.bucketize(gaps.clamp(min=0), uppers, right=False)


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, scale: ScaleRewards = "group",
                     eps: float = 1e-4) -> torch.Tensor:
    """Per-sequence advantage r - mean(group) (divided by the group's std + eps when scale="group").

    `group_ids[i]` says which group sequence i belongs to; groups may have different sizes.
    std is the unbiased sample std, as in TRL.
    """
    import torch

    # Vectorised (index_add over group slots): no Python loop over groups.
    _, slot = torch.unique(group_ids, return_inverse=True)
    n = int(slot.max()) + 1 if slot.numel() else 0
    zeros = torch.zeros(n, dtype=rewards.dtype, device=rewards.device)
    counts = zeros.index_add(0, slot, torch.ones_like(rewards))
    mean = zeros.index_add(0, slot, rewards) / counts
    centred = rewards - mean[slot]
    if scale == "group":
        var = zeros.index_add(0, slot, centred * centred) / (counts - 1).clamp(min=1)
        std = torch.where(counts > 1, var.sqrt(), torch.zeros_like(var))
        centred = centred / (std[slot] + eps)
    return centred


@dataclass(frozen=True)
class StepNormaliser:
    """The denominator of one optimizer step's loss, counted over *every* row of the step (all micro-batches,
    all DDP ranks). Each micro-batch's loss is sum(per_token * token_weights(...)) with this normaliser, so the
    micro-batch losses (and gradients) add up exactly to the full-batch loss of the step."""

    sequences: int      # rows (completions) in the step
    tokens: float       # sum of the loss mask over the step (completion tokens that are trained)

    @classmethod
    def over(cls, row_masks) -> "StepNormaliser":
        """From each row's loss mask (an iterable of 1-d tensors or lists of 0/1 weights)."""
        rows = list(row_masks)
        return cls(sequences=len(rows), tokens=float(sum(float(sum(m)) for m in rows)))


def token_weights(mask: torch.Tensor, cfg: LossConfig, norm: StepNormaliser) -> torch.Tensor:
    """[b, T] coefficient of each token's loss term in the step's loss (TRL's three normalisations):
    grpo     mask / (row's mask sum * sequences)   mean over each sequence's tokens, then over sequences;
    dr_grpo  mask / (sequences * max_completion_length);
    dapo     mask / tokens                          token-level mean over the step."""
    mask = mask.float()
    if cfg.loss_type == "grpo":
        return mask / (mask.sum(dim=1, keepdim=True).clamp(min=1.0) * max(1, norm.sequences))
    if cfg.loss_type == "dr_grpo":
        return mask / (max(1, norm.sequences) * cfg.max_completion_length)
    if cfg.loss_type == "dapo":
        return mask / max(1.0, norm.tokens)
    raise ValueError(f"unknown loss_type {cfg.loss_type!r}")  # pragma: no cover - guarded by validation


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment per completion (see the module docstring); 0 everywhere when buffer == 0."""
    import torch

    lengths = lengths.to(torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    free = max_len - buffer
    ramp = (free - lengths) / buffer
    penalty = torch.where(lengths <= free, torch.zeros_like(lengths), torch.where(lengths <= max_len, ramp, -1.0))
    return factor * penalty


@dataclass
class TokenTerms:
    """The objective per token, before normalisation, plus what the statistics need (all [b, T])."""

    per_token: torch.Tensor   # loss term per token (differentiable in logps)
    ratio: torch.Tensor       # the objective's ratio (what is clipped)
    behaviour: torch.Tensor   # pi_theta / mu against the volunteer's sampling policy, detached
    weight: torch.Tensor      # importance weight applied to the policy term (1 without TIS)
    truncated: torch.Tensor   # 1 where the weight hit is_cap
    kl: torch.Tensor | None   # k3 KL per token when beta > 0
    no_grad: torch.Tensor | None = None  # bool: tokens the correction left without a policy gradient
    log_behaviour: torch.Tensor | None = None  # log(pi_theta / mu), detached, 0 on padding
    staleness: torch.Tensor | None = None  # [b] each row's version gap


def policy_terms(logps: torch.Tensor, sampling_logps: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, cfg: LossConfig, ref_logps: torch.Tensor | None = None,
                 staleness: torch.Tensor | None = None, row_weights: torch.Tensor | None = None,
                 keep: torch.Tensor | None = None) -> TokenTerms:
    """The per-token objective: a function of each row alone (rows are never split across micro-batches), so
    any correction added here is micro-batch exact as long as it is normalised by `token_weights` — M2PO's
    mask excepted (a statistic of the rows given; pass `keep` to use one computed elsewhere).

    staleness [b]: each row's version gap (needed by "decoupled"; the masked-by-staleness statistic);
    row_weights [b]: multiplies each row's policy term (`stale_weighting`)."""
    import torch

    from .corrections import token_term

    mask = mask.to(logps.dtype)
    term = token_term(logps, sampling_logps, advantages, mask, cfg, keep=keep, row_staleness=staleness)
    per_token = term.per_token
    if row_weights is not None:
        per_token = per_token * row_weights.to(per_token.device, per_token.dtype).unsqueeze(1)

    kl = None
    if cfg.beta > 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        delta = (ref_logps - logps) * mask
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + cfg.beta * kl
    log_behaviour = ((logps.detach() - sampling_logps) * mask)
    return TokenTerms(per_token, term.ratio, torch.exp(log_behaviour), term.weight, term.truncated,
                      kl.detach() if kl is not None else None, no_grad=term.no_grad, log_behaviour=log_behaviour,
                      staleness=staleness)


@dataclass
class LossStats:
    loss: torch.Tensor
    clip_fraction: float
    ratio_mean: float
    ratio_max: float
    is_weight_mean: float
    is_truncated_fraction: float
    ratio_min: float = 1.0
    clip_low_fraction: float = 0.0
    clip_high_fraction: float = 0.0
    kl_mean: float = 0.0
    entropy_mean: float | None = None
    log_ratio_m2: float = 0.0
    is_weight_m2: float = 1.0
    ess: float = 1.0
    masked_fraction: float = 0.0
    masked_by_staleness: dict | None = None

    def metrics(self) -> dict[str, float]:
        """The per-step numbers the coordinator writes to metrics.jsonl."""
        out = {"loss": float(self.loss.detach()) if hasattr(self.loss, "detach") else float(self.loss),
               "clip_fraction": self.clip_fraction,
               "clip_low_fraction": self.clip_low_fraction, "clip_high_fraction": self.clip_high_fraction,
               "ratio_mean": self.ratio_mean, "ratio_max": self.ratio_max, "ratio_min": self.ratio_min,
               "is_weight_mean": self.is_weight_mean, "is_truncated_fraction": self.is_truncated_fraction,
               "kl_mean": self.kl_mean, "log_ratio_m2": self.log_ratio_m2, "is_weight_m2": self.is_weight_m2,
               "ess": self.ess, "masked_fraction": self.masked_fraction,
               "masked_by_staleness": dict(self.masked_by_staleness or {})}
        if self.entropy_mean is not None:
            out["entropy_mean"] = self.entropy_mean
        return out


class LossTotals:
    """Statistics summed over a step's micro-batches (and, under DDP, over ranks: `as_tensors`/`load_tensors`),
    so a micro-batched step reports exactly what the full-batch step would. Means are per masked token.

    The sums stay on the device the micro-batches are on (one float64 vector, plus the ratio max / min) and
    reach the host once, when `sums` or `stats()` first reads them: no host sync per micro-batch."""

    SUMS = ("loss", "tokens", "clip_low", "clip_high", "ratio", "weight", "truncated", "kl", "entropy",
            "log_r2", "r1", "r2", "masked") + tuple(f"{kind}@{band}" for band in STALENESS_BAND_LABELS
                                                     for kind in ("masked", "tokens"))

    def __init__(self) -> None:
        self._sums = None  # float64 [len(SUMS) + 1] (the last: entropy seen), on the micro-batches' device
        self._hi = None    # float64 [1]: max ratio over masked tokens
        self._lo = None
        self._read: tuple[dict, float, float, bool] | None = None
        self.has_entropy = False

    def add(self, loss: torch.Tensor, terms: TokenTerms, advantages: torch.Tensor, mask: torch.Tensor,
            cfg: LossConfig, entropy: torch.Tensor | None = None) -> None:
        import torch

        with torch.no_grad():
            on = mask > 0
            m = on.to(torch.float32)
            adv = advantages.unsqueeze(1)
            zero = torch.zeros((), dtype=torch.float64, device=mask.device)
            s = {"loss": loss.detach(), "tokens": m.sum()}
            if cfg.correction in ("clip", "decoupled"):  # the only corrections with a PPO band
                s["clip_low"] = ((terms.ratio < 1.0 - cfg.epsilon) & (adv < 0) & on).sum()
                s["clip_high"] = ((terms.ratio > 1.0 + cfg.epsilon_high) & (adv > 0) & on).sum()
            if terms.log_behaviour is not None:
                lr = terms.log_behaviour.detach().double()[on].clamp(max=R_LOG_CAP)
                s["log_r2"] = lr.pow(2).sum()
                s["r1"] = torch.exp(lr).sum()
                s["r2"] = torch.exp(2 * lr).sum()
            if terms.no_grad is not None:
                masked = terms.no_grad & on
                s["masked"] = masked.sum()
                if terms.staleness is not None:
                    bands = staleness_bands(terms.staleness).to(on.device)
                    for b, label in enumerate(STALENESS_BAND_LABELS):
                        rows = (bands == b).unsqueeze(1)
                        s[f"tokens@{label}"] = (on & rows).sum()
                        s[f"masked@{label}"] = (masked & rows).sum()
            s["ratio"] = (terms.behaviour * m).sum()
            s["weight"] = (terms.weight * m).sum()
            s["truncated"] = (terms.truncated * m).sum()
            if terms.kl is not None:
                s["kl"] = (terms.kl * m).sum()
            if entropy is not None:
                self.has_entropy = True
                s["entropy"] = (entropy * m).sum()
            vec = torch.stack([s[k].to(torch.float64) if k in s else zero for k in self.SUMS]
                              + [zero + float(self.has_entropy)])
            behaviour = terms.behaviour.detach().to(torch.float64)
            hi = torch.where(on, behaviour, float("-inf")).amax().reshape(1)
            lo = torch.where(on, behaviour, float("inf")).amin().reshape(1)
            if self._sums is None:
                self._sums, self._hi, self._lo = vec, hi, lo
            else:
                self._sums = self._sums + vec
                self._hi, self._lo = torch.maximum(self._hi, hi), torch.minimum(self._lo, lo)
            self._read = None

    def as_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sums, [max], [min]) as float64 tensors (on the micro-batches' device; CPU zeros when nothing was
        added), for SUM / MAX / MIN all-reduces."""
        import torch

        if self._sums is None:
            return (torch.zeros(len(self.SUMS) + 1, dtype=torch.float64),
                    torch.tensor([float("-inf")], dtype=torch.float64), torch.tensor([float("inf")], dtype=torch.float64))
        return self._sums, self._hi, self._lo

    def load_tensors(self, sums, hi, lo) -> None:
        self._sums, self._hi, self._lo = sums, hi.reshape(1), lo.reshape(1)
        self._read = None

    def _host(self) -> tuple[dict, float, float, bool]:
        """The one host read of a step's statistics."""
        if self._read is None:
            import torch

            sums, hi, lo = self.as_tensors()
            values = torch.cat([sums, hi.to(sums.device), lo.to(sums.device)]).tolist()
            n = len(self.SUMS)
            self._read = (dict(zip(self.SUMS, values[:n])), values[n + 1], values[n + 2], values[n] > 0)
        return self._read

    @property
    def sums(self) -> dict[str, float]:
        return self._host()[0]

    @property
    def ratio_max(self) -> float:
        return self._host()[1]

    @property
    def ratio_min(self) -> float:
        return self._host()[2]

    def stats(self, loss=None) -> LossStats:
        s, ratio_max, ratio_min, has_entropy = self._host()
        n = max(1.0, s["tokens"])
        empty = s["tokens"] == 0
        return LossStats(
            loss=loss if loss is not None else s["loss"],
            clip_fraction=(s["clip_low"] + s["clip_high"]) / n,
            ratio_mean=1.0 if empty else s["ratio"] / n,
            ratio_max=1.0 if empty else ratio_max,
            ratio_min=1.0 if empty else ratio_min,
            is_weight_mean=s["weight"] / n,
            is_truncated_fraction=s["truncated"] / n,
            clip_low_fraction=s["clip_low"] / n,
            clip_high_fraction=s["clip_high"] / n,
            kl_mean=s["kl"] / n,
            entropy_mean=s["entropy"] / n if has_entropy else None,
            log_ratio_m2=s["log_r2"] / n,
            is_weight_m2=1.0 if empty else s["r2"] / n,
            ess=1.0 if empty or s["r2"] <= 0 else s["r1"] ** 2 / (n * s["r2"]),
            masked_fraction=s["masked"] / n,
            masked_by_staleness={label: s[f"masked@{label}"] / s[f"tokens@{label}"] for label in STALENESS_BAND_LABELS
                                 if s[f"tokens@{label}"] > 0},
        )


def grpo_loss(logps: torch.Tensor, sampling_logps: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, cfg: LossConfig, ref_logps: torch.Tensor | None = None,
              norm: StepNormaliser | None = None, staleness: torch.Tensor | None = None,
              row_weights: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> LossStats:
    """logps, sampling_logps, mask (and ref_logps when cfg.beta > 0): [B, T]; advantages: [B].

    The loss of these rows as part of a step normalised by `norm` (default: these rows are the whole step);
    staleness / row_weights / keep as in `policy_terms`. Returns the scalar loss and statistics."""
    if norm is None:
        norm = StepNormaliser(sequences=logps.shape[0], tokens=float(mask.float().sum()))
    terms = policy_terms(logps, sampling_logps, advantages, mask, cfg, ref_logps, staleness=staleness,
                         row_weights=row_weights, keep=keep)
    loss = (terms.per_token * token_weights(mask, cfg, norm).to(terms.per_token.dtype)).sum()
    totals = LossTotals()
    totals.add(loss, terms, advantages, mask, cfg)
    return totals.stats(loss)
