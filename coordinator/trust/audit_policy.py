"""Audit policy: how far an honest volunteer's logprobs may be from ours, and what a miss costs it.

Owned by the trust work (docs/SECURITY.md "Strike policy"); the audit's mechanics (which model, which
pass) are coordinator/trust/audit.py's. Two decisions live here:

Tolerance, per engine class (kind x dtype), learned from honest engines. A volunteer's batch says which
engine computed its logprobs (`RolloutBatch.engine_kind`: "transformers", "vllm", ...) and in which dtype
(`engine_dtype`). Engines differ from the audit's own recomputation by their kernels and dtype, and the
audit cannot emulate that: an emulation (autocast on the learner) is the learner's own computation on a
bf16 GPU learner and measures ~0. So each class's tolerance is *learned from its own batches*:

  * learning: the class's first `learn_batches` audited batches on a trained adapter (a version whose
    lora_B is not all zero; the zero adapter is the base model and hides the LoRA path's noise) are
    all audited (probability 1) and judged against the class's *ceiling*, a conservative documented
    tolerance per dtype (`ceiling`): `learn_tolerance` for fp32 classes (default 0.05 nats/token) and
    `learn_tolerance_half` for bf16/fp16 ones (default 0.2). Why two: a half-precision engine rounds its
    logits (bf16 keeps 8 significant bits: +-0.06 at a logit of 30, and a pretrained model's logits are
    that large), so its honest noise grows with the model's logit scale — measured worst 0.065
    nats/token for transformers/bf16 on SmolLM2-135M-Instruct, while fp32 engines stay near 1e-5 there.
    Both ceilings sit above every honest engine of their kind measured and below every fabricated-logprob
    attack measured but small added noise (docs/SECURITY.md). A miss there rejects the batch and
    quarantines the key, but never strikes. Every statistic is kept as a sample.
  * learned: tolerance = clamp(margin x the `learn_quantile` quantile of the samples, base, ceiling),
    frozen from then on. Learning can only *tighten* the ceiling: a cheat who feeds the learning period
    gains at most what the learning period itself allows, and the quantile (not the max) means a few of
    his samples among honest ones move nothing.

Engine kinds outside ENGINE_KINDS count as "other", a batch that does not say its kind (an older client)
as "unknown" (classes stay few: at most 4 kinds x 3 dtypes learn), and a batch
that does not say its dtype is held to `base` (the strictest; it never learns: every schema-2 client
says it). The learned state goes to `<run_dir>/audit_engines.json` (`state`/`load_state`) and comes back
on --resume. With `learn_batches` 0 there is no learning: fp32 gets `base`, other dtypes what
`set_calibrated` measured (bench/audit_calibration.py's emulation) or `base`.

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

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

ENGINE_DTYPES = ("fp32", "bf16", "fp16")
ENGINE_KINDS = ("transformers", "vllm")  # client engines' `name`; any other kind is judged as "other"
MAX_KEYS = 100_000
LEARN_TOLERANCE = 0.05  # nats/token: the conservative ceiling while an fp32 class learns (docs/SECURITY.md)
LEARN_TOLERANCE_HALF = 0.2  # nats/token: the same for bf16/fp16 classes (rounded logits; docs/SECURITY.md)
HALF_DTYPES = ("bf16", "fp16")
LEARN_QUANTILE = 0.95


def engine_class(engine_kind: str = "", engine_dtype: str = "") -> str:
    """The policy's key for a batch's engine: "<kind>/<dtype>" ("" when the dtype is not said: no class)."""
    if engine_dtype not in ENGINE_DTYPES:
        return ""
    kind = engine_kind if engine_kind in ENGINE_KINDS else ("other" if engine_kind else "unknown")
    return f"{kind}/{engine_dtype}"


@dataclass
class EngineRecord:
    """One engine class's learning: its samples (per-batch statistics) until learned, then its tolerance."""

    samples: list[float] = field(default_factory=list)
    tolerance: float | None = None  # None while learning
    learning_misses: int = 0        # batches over the learning ceiling (rejected, never struck)
    untrained: int = 0              # audited on an untrained adapter: judged, not counted as samples
    learned_at: float = 0.0


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
                 gross_factor: float = 10.0, learn_batches: int = 0, learn_tolerance: float = LEARN_TOLERANCE,
                 learn_tolerance_half: float = LEARN_TOLERANCE_HALF, learn_quantile: float = LEARN_QUANTILE,
                 on_event=None):
        self.base = base
        self.learn_batches = learn_batches
        self.learn_tolerance = max(learn_tolerance, base)
        self.learn_tolerance_half = max(learn_tolerance_half, base)
        self.learn_quantile = learn_quantile
        self.engines: dict[str, EngineRecord] = {}  # engine class -> learning (bounded: few classes)
        self.on_event = on_event  # fn(event, **fields): a class starts or ends learning (metrics.jsonl)
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
                   quarantine_strikes=cfg.audit_quarantine_strikes,
                   learn_batches=cfg.audit_learn_batches if cfg.audit_calibrate else 0,
                   learn_tolerance=cfg.audit_learn_tolerance, learn_tolerance_half=cfg.audit_learn_tolerance_half)

    def ceiling(self, engine_dtype: str) -> float:
        """The tolerance a class of this dtype is judged by while it learns, and the most it can learn."""
        return self.learn_tolerance_half if engine_dtype in HALF_DTYPES else self.learn_tolerance

    def tolerance(self, engine_dtype: str = "", engine_kind: str = "") -> float:
        cls = engine_class(engine_kind, engine_dtype) if self.learn_batches > 0 else ""
        if cls:
            rec = self.engines.get(cls)
            return rec.tolerance if rec is not None and rec.tolerance is not None else self.ceiling(engine_dtype)
        return self.tolerances.get(engine_dtype, self.base)  # not said, or not calibrated: the strictest

    def learning(self, engine_dtype: str = "", engine_kind: str = "") -> bool:
        """True while this engine class's tolerance is still being learned (its batches: always audited)."""
        cls = engine_class(engine_kind, engine_dtype) if self.learn_batches > 0 else ""
        if not cls:
            return False
        rec = self.engines.get(cls)
        return rec is None or rec.tolerance is None

    def _learn(self, cls: str, stat: float, trained: bool, ok: bool) -> None:
        ceiling = self.ceiling(cls.split("/")[1])
        rec = self.engines.get(cls)
        if rec is None:
            rec = self.engines[cls] = EngineRecord()
            self._event("audit_engine_learning", engine=cls, needed=self.learn_batches, ceiling=ceiling)
        if not ok:
            rec.learning_misses += 1
        if not trained:
            rec.untrained += 1
            return
        rec.samples.append(float(stat))
        if len(rec.samples) >= self.learn_batches:
            q = quantile(rec.samples, self.learn_quantile)
            rec.tolerance = min(ceiling, max(self.base, self.margin * q))
            rec.learned_at = time.time()
            self._event("audit_engine_learned", engine=cls, tolerance=rec.tolerance, samples=len(rec.samples),
                        quantile=q, worst=max(rec.samples), misses=rec.learning_misses)

    def _event(self, event: str, **fields) -> None:
        if self.on_event is not None:
            self.on_event(event, **fields)

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

    def judge(self, key: bytes, stat: float, engine_dtype: str = "", engine_kind: str = "", *,
              trained: bool = True) -> Judgement:
        """The verdict on one audited batch's statistic. `trained`: the claimed version's adapter is not the
        zero one (only then does a learning class count the batch as a sample)."""
        tol = self.tolerance(engine_dtype, engine_kind)
        learning = self.learning(engine_dtype, engine_kind)
        if learning:
            self._learn(engine_class(engine_kind, engine_dtype), stat, trained, stat <= tol)
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
        if learning:  # a class still learning its tolerance: rejected and quarantined, never struck
            return Judgement(False, strike=False, quarantined=True, tolerance=tol)
        rec.misses += 1
        strike = stat > self.gross_factor * tol or rec.misses >= self.quarantine_strikes
        if strike:
            rec.misses = 0
            self.stats["strikes"] += 1
        return Judgement(False, strike=strike, quarantined=True, tolerance=tol)

    def engines_status(self) -> dict[str, dict]:
        """Per engine class: "learning" (samples so far of `needed`, the ceiling in force) or "learned"."""
        out = {}
        for cls, rec in sorted(self.engines.items()):
            done = rec.tolerance is not None
            out[cls] = {"state": "learned" if done else "learning", "samples": len(rec.samples),
                        "needed": self.learn_batches,
                        "tolerance": rec.tolerance if done else self.ceiling(cls.split("/")[1]),
                        "worst": max(rec.samples) if rec.samples else None,
                        "quantile": quantile(rec.samples, self.learn_quantile) if rec.samples else None,
                        "learning_misses": rec.learning_misses, "untrained": rec.untrained}
        return out

    def state(self) -> dict:
        """What --resume needs (JSON): each class's samples and learned tolerance."""
        return {"version": 1, "engines": {cls: {"samples": list(rec.samples), "tolerance": rec.tolerance,
                                                "learning_misses": rec.learning_misses, "untrained": rec.untrained,
                                                "learned_at": rec.learned_at}
                                          for cls, rec in list(self.engines.items())}}

    def load_state(self, state: dict) -> int:
        """Merge a `state()` back (--resume): a class learned before the restart stays learned. Returns the
        number of classes read; a malformed entry is skipped."""
        n = 0
        engines = state.get("engines") if isinstance(state, dict) else None
        for cls, e in (engines.items() if isinstance(engines, dict) else ()):
            try:
                tol = e.get("tolerance")
                ceiling = self.ceiling(cls.split("/")[-1])
                rec = EngineRecord(samples=[float(x) for x in e.get("samples", [])][:max(self.learn_batches, 1)],
                                   tolerance=None if tol is None else min(ceiling, float(tol)),
                                   learning_misses=int(e.get("learning_misses", 0)), untrained=int(e.get("untrained", 0)),
                                   learned_at=float(e.get("learned_at", 0.0)))
            except (TypeError, ValueError, AttributeError):
                continue
            if cls.count("/") == 1 and len(self.engines) < 64:
                self.engines[cls] = rec
                n += 1
        return n

    def status(self) -> dict:
        return {"tolerances": dict(self.tolerances), "calibration": dict(self.calibration),
                "engines": self.engines_status(), "learn_batches": self.learn_batches,
                "learn_tolerance": self.learn_tolerance, "learn_tolerance_half": self.learn_tolerance_half,
                "learn_quantile": self.learn_quantile,
                "in_quarantine": sum(1 for r in self._keys.values() if r.passes_left > 0), **self.stats,
                "quarantine_passes": self.quarantine_passes, "quarantine_strikes": self.quarantine_strikes,
                "gross_factor": self.gross_factor, "margin": self.margin}


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (nearest rank, no interpolation: a value that was measured)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
