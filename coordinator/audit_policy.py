"""Audit policy: how far an honest volunteer's logprobs may be from ours, and what a miss costs it.

Owned by the trust work (docs/SECURITY.md "Strike policy"); the audit's mechanics (which model, which
pass) are coordinator/audit.py's. Two decisions live here:

Tolerance, per engine dtype. A volunteer's batch says which dtype its engine computed logprobs in
(`RolloutBatch.engine_dtype`: fp32 for CPU engines, bf16/fp16 for GPU engines such as vLLM). An fp32
engine reproduces the audit's numbers to float noise, so it gets `base` (the configured `--audit-tolerance`).
A bf16 engine differs from an fp32 recomputation by ~1e-2 nats/token on the tiny model — more than the
base tolerance — so its tolerance is *measured at start-up* (`calibrate`): honest completions are sampled
from the current policy, their logprobs computed once in the audit's own path and once as an engine in
that dtype would (autocast: weights and matmuls rounded to the dtype; on the tiny model this matched a
real bf16-weights engine within 5 %: max 1.00e-2 vs 1.04e-2, median 4.1e-3 vs 4.0e-3), and the tolerance
is `max(base, margin x the worst honest completion)`. A batch that does not say its dtype is held to the
base tolerance (every schema-2 client says it). Claiming bf16 buys a cheat at most the bf16 tolerance.

Quarantine before strikes. A miss (statistic over the tolerance) rejects the batch (LOGPROB_MISMATCH: it
never reaches a gradient) and puts the key in quarantine: every one of its batches is audited until
`quarantine_passes` consecutive ones pass. It is *struck* only when `quarantine_strikes` misses
accumulate inside one quarantine — or at once for a gross miss (> `gross_factor` x tolerance: fabricated
numbers, another model), which no honest engine produces. Why: rare honest outliers exist (a numerically
touchy completion, an engine kernel we did not calibrate for); rejecting the batch already protects the
policy, and a ban needs repeated evidence. A cheat that always lies is struck on its 3rd miss and, with
`max_strikes` 3, banned by its 9th; a gross one is banned by its 3rd, as before.
Per-key records are LRU-bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

ENGINE_DTYPES = ("fp32", "bf16", "fp16")
MAX_KEYS = 100_000


@dataclass
class _KeyRecord:
    passes_left: int = 0  # quarantine: audited batches that must pass before it ends (0 = not in quarantine)
    misses: int = 0       # misses inside the current quarantine


@dataclass(frozen=True)
class Judgement:
    ok: bool
    strike: bool = False
    quarantined: bool = False
    tolerance: float = 0.0


class AuditPolicy:
    def __init__(self, base: float, *, margin: float = 3.0, quarantine_passes: int = 8, quarantine_strikes: int = 3,
                 gross_factor: float = 10.0):
        self.base = base
        self.margin = margin
        self.quarantine_passes = quarantine_passes
        self.quarantine_strikes = quarantine_strikes
        self.gross_factor = gross_factor
        self.tolerances: dict[str, float] = {"fp32": base}
        self.calibration: dict[str, dict] = {}
        self._keys: OrderedDict[bytes, _KeyRecord] = OrderedDict()
        self.stats = {"quarantined": 0, "quarantine_misses": 0, "strikes": 0, "released": 0}

    @classmethod
    def from_config(cls, cfg) -> AuditPolicy:
        return cls(cfg.audit_tolerance, margin=cfg.audit_margin, quarantine_passes=cfg.audit_quarantine_passes,
                   quarantine_strikes=cfg.audit_quarantine_strikes)

    def tolerance(self, engine_dtype: str = "") -> float:
        return self.tolerances.get(engine_dtype, self.base)  # not said, or not calibrated: the strictest

    def set_calibrated(self, dtype: str, honest: list[float]) -> float:
        """Tolerance for engines in `dtype` from the per-completion statistics of honest samples."""
        worst = max(honest) if honest else 0.0
        tol = max(self.base, self.margin * worst)
        self.tolerances[dtype] = tol
        ordered = sorted(honest)
        self.calibration[dtype] = {"n": len(honest), "worst": worst, "median": ordered[len(ordered) // 2] if ordered
                                   else 0.0, "tolerance": tol}
        return tol

    def in_quarantine(self, key: bytes) -> bool:
        rec = self._keys.get(key)
        return rec is not None and rec.passes_left > 0

    def judge(self, key: bytes, stat: float, engine_dtype: str = "") -> Judgement:
        tol = self.tolerance(engine_dtype)
        rec = self._keys.get(key)
        if stat <= tol:
            if rec is not None and rec.passes_left > 0:
                rec.passes_left -= 1
                if rec.passes_left == 0:
                    rec.misses = 0
                    self.stats["released"] += 1
            return Judgement(True, tolerance=tol)
        if rec is None:
            rec = self._keys[key] = _KeyRecord()
            while len(self._keys) > MAX_KEYS:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        if rec.passes_left == 0:
            self.stats["quarantined"] += 1
        else:
            self.stats["quarantine_misses"] += 1
        rec.passes_left = self.quarantine_passes
        rec.misses += 1
        strike = stat > self.gross_factor * tol or rec.misses >= self.quarantine_strikes
        if strike:
            rec.misses = 0
            self.stats["strikes"] += 1
        return Judgement(False, strike=strike, quarantined=True, tolerance=tol)

    def status(self) -> dict:
        return {"tolerances": dict(self.tolerances), "calibration": dict(self.calibration),
                "in_quarantine": sum(1 for r in self._keys.values() if r.passes_left > 0), **self.stats,
                "quarantine_passes": self.quarantine_passes, "quarantine_strikes": self.quarantine_strikes,
                "gross_factor": self.gross_factor, "margin": self.margin}
