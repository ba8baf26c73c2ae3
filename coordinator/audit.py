"""Generation audit: are a batch's sampling logprobs what the claimed adapter version assigns?

A volunteer reports, per completion token, the logprob under the adapter version it claims to have
sampled with; the learner trusts those numbers in its importance ratio. The auditor recomputes them
for a sample of batches and rejects a batch whose numbers do not match (LOGPROB_MISMATCH, a strike):
made-up logprobs, tokens from another adapter version than claimed, or from another base model.
What it cannot prove: that the tokens were *sampled* (a volunteer holding the adapter can compute the
true logprobs of tokens it picked by hand). Rewards are recomputed for every batch anyway (ingest).

Who is audited (BOINC adaptive replication): an identity with n accepted batches since its last
strike is audited with probability max(`floor`, 1/n); with n == 0 (no track record) always.

How, cheapest first:
  * claimed version == the learner's current version: the check is deferred to train time on the
    learner's own model (`train_hook`, called by `Learner.step` with the log-probs of a no-grad pass over
    the audited groups, before the step's first micro-batch): a failing batch is dropped before any
    gradient exists and the step trains the rest (cost: one forward of the audited rows).
    Valid only while the learner's weights still equal that version (no optimizer step since it was
    published) and LoRA dropout is 0; otherwise the shadow model below is used, still at train time.
    The learner holds the fp32 weights, volunteers the *published* (e.g. bf16-rounded) ones, so a batch
    that fails on the learner's pass is re-checked on the shadow model with the published tensors before
    it is rejected (`shadow_confirms`): a strike always rests on exactly what the volunteer was served.
  * claimed version older than current (but held): recomputed at ingest on a *shadow model*, a copy of
    the learner's PEFT model that shares its frozen base weights (only the LoRA tensors are separate),
    loaded with that version's published (bf16) LoRA tensors — exactly what volunteers serve — under
    torch.no_grad. The verdict goes back in the ack.
  * claimed version older than max_staleness: not audited — the learner drops it unread;
    one not held for another reason (max_staleness None and older than the versions kept): STALE_VERSION.

The statistic (`mismatch`): the worst completion's mean |claimed - recomputed| logprob per token.
Per-completion (not per-batch) so that one forged completion among 64 honest ones is not averaged
away; a per-token mean (not max) so that an honest rare token whose logprob is numerically touchy
does not decide alone. Calibrated by bench/audit_calibration.py; figures in docs/SECURITY.md.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from collections import OrderedDict
from typing import Callable

import torch

from asyncrl.models.logprobs import CompletionScorer
from asyncrl.protocol.errors import ProtocolError, RejectCode

from .learner import completion_logprobs as learner_logprobs

DEFAULT_TOLERANCE = 0.01  # see docs/SECURITY.md: honest max 6e-4, attacks >= 1.5e-2 (tiny model)


def shadow_model(model):
    """A copy of a PEFT model whose frozen (base) parameters are *shared* with `model`.

    Only the trainable LoRA tensors (and small buffers) are duplicated, so the copy costs the adapter's
    memory, not the base model's. Both may run forward passes from different threads: neither writes
    the shared base weights.
    """
    memo = {id(p): p for p in model.parameters() if not p.requires_grad}
    shadow = copy.deepcopy(model, memo)
    shadow.eval()
    for p in shadow.parameters():
        p.requires_grad_(False)
    return shadow


@torch.no_grad()
def completion_logprobs(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The learner's completion logprobs for one collated batch (`learner.completion_logprobs`: same
    positions, temperature, chunked LM head and arithmetic as training); on CPU. The auditor itself goes
    through `Learner.score_groups`, which also splits the rows into the learner's micro-batches."""
    return learner_logprobs(model, batch).cpu()


def mismatch(recomputed: torch.Tensor, claimed: torch.Tensor, mask: torch.Tensor) -> float:
    """The worst completion's mean |claimed - recomputed| logprob per token (rows = completions)."""
    mask = mask.to(torch.float32)
    diff = (recomputed.detach().float().cpu() - claimed.float().cpu()).abs() * mask
    per_row = diff.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return float(per_row.max()) if per_row.numel() else 0.0


class Auditor:
    """Decides which batches to audit, keeps the adapter versions to audit against, runs the checks."""

    def __init__(self, learner, *, tolerance: float = DEFAULT_TOLERANCE, floor: float = 0.05,
                 keep_versions: int = 5, seed: int = 0, enabled: bool = True, lora_dropout: float = 0.0,
                 max_staleness: int | None = None,
                 on_verdict: Callable[[bytes, bytes, RejectCode | None, str], None] | None = None):
        self.learner = learner
        self.tolerance = tolerance
        self.floor = floor
        self.keep_versions = max(1, keep_versions)
        self.enabled = enabled
        self.max_staleness = max_staleness  # batches older than this are dropped by the learner: no audit needed
        self.reuse_learner_pass = lora_dropout == 0.0  # a train-mode forward with dropout is not the policy
        self.on_verdict = on_verdict  # (batch_id, signer, code or None on pass, stage)
        self.model = shadow_model(learner.model) if enabled else None
        self.scorer = CompletionScorer(self.model) if enabled else None  # models/logprobs.py, as the learner
        self._rng = random.Random(seed)
        self._lock = threading.Lock()        # guards the shadow model (one audit at a time)
        self._versions: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._published_step: dict[int, int] = {}  # version -> learner.steps when it was published
        self._loaded: int | None = None
        self._pending: dict[bytes, bytes] = {}      # deferred batch id -> signer
        self.stats = {"audited": 0, "deferred": 0, "passed": 0, "failed": 0, "reused_learner_pass": 0,
                      "shadow_confirms": 0, "shadow_passes": 0, "skipped": 0, "seconds_ingest": 0.0,
                      "seconds_train": 0.0, "learner_seconds": 0.0, "max_passing_mismatch": 0.0}

    @classmethod
    def from_config(cls, cfg, learner) -> "Auditor":
        keep = (cfg.max_staleness + 1) if cfg.max_staleness is not None else 8
        return cls(learner, tolerance=cfg.audit_tolerance, floor=cfg.audit_floor, keep_versions=keep,
                   seed=cfg.seed, lora_dropout=cfg.lora_dropout, max_staleness=cfg.max_staleness,
                   enabled=cfg.audit and not getattr(learner, "sharded", False))  # FSDP: a shadow pass needs every rank

    def attach(self, ingest) -> None:
        """Wire the two ends: ingest calls `check`, the learner calls `train_hook`, verdicts go to ingest."""
        self.on_verdict = ingest.audit_verdict
        if self.enabled:
            self.learner.audit_hook = self.train_hook

    # ---- adapter history --------------------------------------------------------------------------
    def remember_published(self, version: int, specs, blobs: dict[str, bytes], learner_steps: int) -> None:
        """The exact tensors volunteers will serve for `version` (the published dtype, e.g. bf16)."""
        if self.enabled:
            from asyncrl.models.lora import tensors_from_bytes

            self.remember(version, tensors_from_bytes(specs, blobs), learner_steps)

    def remember(self, version: int, tensors: dict[str, torch.Tensor], learner_steps: int) -> None:
        """Keep a published version's LoRA tensors (published dtype) for later audits."""
        if not self.enabled:
            return
        with self._lock:
            self._versions[version] = {k: v.detach().clone() for k, v in tensors.items()}
            self._published_step[version] = learner_steps
            while len(self._versions) > self.keep_versions:
                old, _ = self._versions.popitem(last=False)
                self._published_step.pop(old, None)
                if self._loaded == old:
                    self._loaded = None

    def held_versions(self) -> list[int]:
        with self._lock:
            return list(self._versions)

    # ---- ingest-time --------------------------------------------------------------------------------
    def probability(self, valid_streak: int) -> float:
        return 1.0 if valid_streak <= 0 else max(self.floor, 1.0 / valid_streak)

    def check(self, signer: bytes, batch_id: bytes, version: int, groups, *, valid_streak: int,
              current_version: int) -> str:
        """Audit (or schedule an audit of) a batch at ingest. Returns "skipped", "stale", "deferred" or
        "passed"; raises ProtocolError(LOGPROB_MISMATCH | STALE_VERSION)."""
        if not self.enabled or self._rng.random() >= self.probability(valid_streak):
            self.stats["skipped"] += 1
            return "skipped"
        if self.max_staleness is not None and current_version - version > self.max_staleness:
            self.stats["stale"] = self.stats.get("stale", 0) + 1
            return "stale"  # the learner drops it unread: nothing of it can reach a gradient
        self.stats["audited"] += 1
        if version == current_version and self.reuse_learner_pass:
            for g in groups:
                g.batch_id, g.audit = batch_id, True
            with self._lock:
                self._pending[batch_id] = signer
            self.stats["deferred"] += 1
            return "deferred"
        t0 = time.perf_counter()
        try:
            stat = self._shadow_mismatch(groups, version)
        finally:
            self.stats["seconds_ingest"] += time.perf_counter() - t0
        self._judge(stat, batch_id, signer, "ingest", raise_on_fail=True)
        return "passed"

    # ---- train-time ---------------------------------------------------------------------------------
    def train_hook(self, groups, logps: torch.Tensor, mask: torch.Tensor) -> set[bytes]:
        """Called by the learner after its forward pass, before backward(). `logps`/`mask` are its
        [rows, T] completion logprobs for `groups` (rows in group order). Returns the batch ids to drop."""
        flagged: dict[bytes, list[int]] = {}
        for i, g in enumerate(groups):
            if getattr(g, "audit", False):
                flagged.setdefault(g.batch_id, []).append(i)
        if not flagged:
            return set()
        t0 = time.perf_counter()
        starts, n = [], 0
        for g in groups:
            starts.append(n)
            n += len(g.completions)
        rejected = set()
        for batch_id, idxs in flagged.items():
            version = groups[idxs[0]].version
            rows = [r for i in idxs for r in range(starts[i], starts[i] + len(groups[i].completions))]
            try:
                if self._weights_are(version):
                    lp = logps.detach()[rows].float().cpu()
                    claimed = torch.zeros_like(lp)
                    for k, (i, j) in enumerate((i, j) for i in idxs for j in range(len(groups[i].completions))):
                        c = groups[i].sampling_logprobs[j]
                        claimed[k, :len(c)] = torch.tensor(c, dtype=torch.float32)
                    stat = mismatch(lp, claimed, mask[rows].cpu())
                    self.stats["reused_learner_pass"] += 1
                    if stat > self.tolerance:  # the published tensors decide, not the learner's fp32 ones
                        self.stats["shadow_confirms"] += 1
                        stat = self._shadow_mismatch([groups[i] for i in idxs], version)
                else:
                    stat = self._shadow_mismatch([groups[i] for i in idxs], version)
                code = None if stat <= self.tolerance else RejectCode.LOGPROB_MISMATCH
            except ProtocolError as exc:  # version no longer held
                stat, code = float("inf"), exc.code
            for i in idxs:
                groups[i].audit = False
            with self._lock:
                signer = self._pending.pop(batch_id, b"")
            if code is None:
                self._judge(stat, batch_id, signer, "train", raise_on_fail=False)
            else:
                self.stats["failed"] += 1
                rejected.add(batch_id)
                if self.on_verdict is not None:
                    self.on_verdict(batch_id, signer, code, "train")
        self.stats["seconds_train"] += time.perf_counter() - t0
        return rejected

    # ---- internals ----------------------------------------------------------------------------------
    def _weights_are(self, version: int) -> bool:
        """True while the learner's weights are still exactly the ones published as `version`."""
        return self.reuse_learner_pass and self._published_step.get(version) == self.learner.steps

    def shadow_logprobs(self, groups, version: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Recompute `groups`' completion logprobs under held `version` on the shadow model:
        ([rows, T] logprobs, the collated batch with its "sampling_logps" (claimed) and "mask" tensors)."""
        from asyncrl.models.lora import load_lora

        with self._lock:
            tensors = self._versions.get(version)
            if tensors is None:
                raise ProtocolError(RejectCode.STALE_VERSION, f"version {version} is no longer held for audits")
            if self._loaded != version:
                load_lora(self.model, tensors)
                self._loaded = version
            # micro-batched like a training step; the learner's dtype and device (the shadow shares its base)
            recomputed, mask = self.learner.score_groups(groups, model=self.scorer)
            self.stats["shadow_passes"] += 1
        claimed = torch.zeros_like(recomputed)
        for k, lp in enumerate(lp for g in groups for lp in g.sampling_logprobs):
            claimed[k, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
        return recomputed, {"sampling_logps": claimed, "mask": mask}

    def _shadow_mismatch(self, groups, version: int) -> float:
        recomputed, batch = self.shadow_logprobs(groups, version)
        return mismatch(recomputed, batch["sampling_logps"], batch["mask"])

    def _judge(self, stat: float, batch_id: bytes, signer: bytes, stage: str, *, raise_on_fail: bool) -> None:
        if stat <= self.tolerance:
            self.stats["passed"] += 1
            self.stats["max_passing_mismatch"] = max(self.stats["max_passing_mismatch"], stat)
            if self.on_verdict is not None:
                self.on_verdict(batch_id, signer, None, stage)
            return
        self.stats["failed"] += 1
        err = ProtocolError(RejectCode.LOGPROB_MISMATCH,
                            f"worst completion differs by {stat:.2e} nats/token (tolerance {self.tolerance:.1e})")
        if raise_on_fail:
            raise err
        if self.on_verdict is not None:
            self.on_verdict(batch_id, signer, RejectCode.LOGPROB_MISMATCH, stage)

    def status(self) -> dict:
        s = dict(self.stats)
        s["tolerance"] = self.tolerance
        s["floor"] = self.floor
        s["held_versions"] = self.held_versions()
        learner_s = s["learner_seconds"]
        s["cost_fraction_of_learner"] = ((s["seconds_ingest"] + s["seconds_train"]) / learner_s) if learner_s else None
        return s
