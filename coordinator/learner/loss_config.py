"""The loss's configuration: which GRPO variant, which off-policy correction, and their constants.

Its own module so that the coordinator's config (and so `--help`) reads it without torch, and so that the
loss (coordinator/learner/loss.py) and the staleness corrections (coordinator/learner/corrections.py) both depend
on it rather than on each other. What each field means is said where it is used: loss.py's and corrections.py's
docstrings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LossType = Literal["grpo", "dr_grpo", "dapo"]
Correction = Literal["clip", "tis-token", "tis-sequence", "aipo", "m2po", "decoupled", "none"]
CORRECTIONS = ("clip", "tis-token", "tis-sequence", "aipo", "m2po", "decoupled", "none")
ScaleRewards = Literal["group", "none"]
StaleWeighting = Literal["none", "decay"]


@dataclass(frozen=True)
class LossConfig:
    loss_type: LossType = "grpo"
    correction: Correction = "decoupled"
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    is_cap: float = 2.0  # tis-*, decoupled: truncation cap of the IS weight
    dual_clip: float = 3.0  # clip/m2po/decoupled: dual-clip constant c for A < 0 (Ye et al. 2020); 0 = off
    aipo_cap: float = 8.0  # aipo: ratio cap delta (prime-rl's clip_ratio default)
    m2_threshold: float = 0.04  # m2po: tau, the bound on the kept tokens' mean (log r)^2
    prox_lag: int = 4  # decoupled: the proximal policy (trust-region anchor) is at most this many versions behind
    stale_weighting: StaleWeighting = "none"  # per-row weights by version gap, corrections.decay_row_weights.
    stale_half_life: float = 8.0  # stale_weighting "decay": versions for a row's weight to halve
    scale_rewards: ScaleRewards = "group"
    max_completion_length: int = 1024  # dr_grpo's normaliser and the overlong penalty's L_max; follows max_new_tokens
    beta: float = 0.0  # KL coefficient; 0 = no reference model forward at all
    mask_truncated: bool = False  # DAPO overlong filtering: completions cut at max_new_tokens contribute no loss
    overlong_buffer: int = 0  # DAPO soft overlong punishment over the last L_cache tokens (0 = off)
    overlong_factor: float = 1.0  # scale of that penalty (DAPO: 1.0)

    def validate(self) -> "LossConfig":
        """Raise ValueError naming the first bad field (the coordinator config wraps it)."""
        checks = [
            (self.loss_type in ("grpo", "dr_grpo", "dapo"), "loss_type must be grpo, dr_grpo or dapo"),
            (self.correction in CORRECTIONS, "correction must be one of " + ", ".join(CORRECTIONS)),
            (0.0 < self.epsilon < 1.0, "epsilon must be in (0, 1)"),
            (self.epsilon_high > 0.0, "epsilon_high must be > 0"),
            (self.is_cap >= 1.0, "is_cap must be >= 1"),
            (self.dual_clip == 0.0 or self.dual_clip > 1.0, "dual_clip must be 0 (off) or > 1"),
            (self.aipo_cap >= 1.0, "aipo_cap must be >= 1"),
            (self.m2_threshold > 0.0, "m2_threshold must be > 0"),
            (self.prox_lag >= 1, "prox_lag must be >= 1"),
            (self.stale_weighting in ("none", "decay"), "stale_weighting must be none or decay"),
            (self.stale_half_life > 0.0, "stale_half_life must be > 0"),
            (self.scale_rewards in ("group", "none"), "scale_rewards must be group or none"),
            (self.max_completion_length >= 1, "max_completion_length must be >= 1"),
            (self.beta >= 0.0, "beta must be >= 0"),
            (0 <= self.overlong_buffer < self.max_completion_length,
             "overlong_buffer must be in [0, max_completion_length)"),
            (self.overlong_factor >= 0.0, "overlong_factor must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self
