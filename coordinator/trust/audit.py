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
  * claimed version == the learner's current version, on a learner that takes the hook (not DDP, whose
    ranks each see a slice: there every batch is checked on the shadow, as below): the check is
    deferred to train time on the learner's own model (`train_hook`, called by `Learner.step` with the
    log-probs of a no-grad pass over the audited groups, before the step's first micro-batch): a failing
    batch is dropped before any gradient exists and the step trains the rest (cost: one forward of the
    audited rows).
    Valid only while the learner's weights still equal that version (no optimizer step since it was
    published) and LoRA dropout is 0; otherwise the shadow model below is used, still at train time.
    The learner holds the fp32 weights, volunteers the *published* (e.g. bf16-rounded) ones, so a batch
    that fails on the learner's pass is re-checked on the shadow model with the published tensors before
    it is rejected (`shadow_confirms`): a strike always rests on exactly what the volunteer was served.
  * claimed version older than current (but held): recomputed on a *shadow model*, a copy of the
    learner's PEFT model that shares its frozen base weights (only the LoRA tensors are separate), loaded
    with that version's published (bf16) LoRA tensors — exactly what volunteers serve — under
    torch.no_grad. Ingest only routes (`route`: no forward pass inside a submit); the pass itself
    (`audit_shadow`) runs after the ack on the AuditWorker (coordinator/trust/audit_worker.py), and the batch
    reaches the learner only if it passes.
  * claimed version older than max_staleness: not audited — the learner drops it unread;
    one older than the versions kept (max_staleness None): STALE_VERSION.

The published tensors of the versions kept are also on disk (`<run_dir>/audit_versions/`, written on the
publisher thread before the version is servable), and `--resume` loads them back: batches a volunteer
spooled through a coordinator restart, and journalled batches whose train-time audit was pending at a
crash, are audited against the very version they claim — never dropped for our restart, never trained
unaudited. A version inside the kept window that is nonetheless missing (its file was lost) cannot be
checked: the batch is accepted unaudited and counted (`unavailable`), since the loss is ours.

What a miss costs (tolerance per engine class, kind x dtype, learned from that class's first audited
batches on a trained adapter; quarantine before strikes): coordinator/trust/audit_policy.py.

The statistic (`mismatch`): the worst completion's trimmed mean |claimed - recomputed| logprob per token
(its largest 1 in 16 token differences left out: TRIM_FRACTION; completions under SHORT_TOKENS judged
together). Per-completion (not per-batch) so that one forged completion among 64 honest ones is not
averaged away; a trimmed per-token mean (not max, not plain mean) so that an honest token whose logprob
is numerically touchy does not decide, however far off. Calibrated by bench/audit_calibration.py and
bench/audit_bf16_tail.py; figures in docs/SECURITY.md.

Size: routing, the learner-pass hook and the shadow-model pass share one tolerance, one set of kept
version tensors and one scoring path, which must not drift apart; who is audited (audit_policy.py) and the
worker thread (audit_worker.py) are already their own modules.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch

from asyncrl.models.logprobs import CompletionScorer
from asyncrl.protocol.errors import ProtocolError, RejectCode

from ..learner.learner import TrainGroup, rows_of, score_rows
from ..learner.learner import completion_logprobs as learner_logprobs
from .audit_policy import AuditPolicy

DEFAULT_TOLERANCE = 0.01  # see docs/SECURITY.md: honest max 6e-4, attacks >= 1.5e-2 (tiny model)
MAX_PENDING = 65536       # deferred audits remembered (far more than the learner queue holds)


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


def is_trained(tensors: dict[str, torch.Tensor]) -> bool:
    """False for the zero adapter (every lora_B all zero: the base model itself, as a fresh LoRA starts);
    honest noise measured on it misses the LoRA path's, so the policy's learning does not count it."""
    bs = [t for name, t in tensors.items() if "lora_B" in name]
    return not bs or any(bool(t.float().abs().max() > 0) for t in bs)


TRIM_FRACTION = 1 / 16
"""Share of a completion's tokens (its largest |claimed - recomputed|, rounded up; never its last token) that
the statistic leaves out. Why: an honest engine in another dtype or with other kernels agrees with us on
almost every token but is off by 0.1-0.4 nats on the odd numerically touchy one (measured: bf16 engine vs
fp32 audit on a trained tiny policy; vLLM vs trainer log-probs on real models show the same heavy tail).
A forged, wrong-version or wrong-model completion is off on most of its tokens, so trimming a few costs
the audit little; logprobs lied about on 1 token in 16 buy a cheat nothing a hand-picked token does not."""


SHORT_TOKENS = 4
"""Completions shorter than this are judged together (their token differences pooled into one row): a
token or two alone cannot tell a touchy token from a lie. Fewer pooled tokens than this: no verdict on them."""


def per_completion(recomputed: torch.Tensor, claimed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each completion's trimmed mean |claimed - recomputed| logprob per token (rows = completions): the
    ceil(TRIM_FRACTION x n) largest of its n token differences are left out, but never its last one. The
    batch's completions shorter than SHORT_TOKENS are judged together: each gets the trimmed mean of all
    their tokens (trimmed the same way), or 0 when they have fewer than SHORT_TOKENS tokens in all (no
    evidence either way: bench/audit_bf16_tail.py saw such pools decide an honest bf16 batch's verdict)."""
    mask = mask.to(torch.float32).cpu()
    diff = (recomputed.detach().float().cpu() - claimed.detach().float().cpu()).abs() * mask
    n = mask.sum(dim=1)
    if diff.shape[1] == 0:
        return torch.zeros(diff.shape[0])
    out = _trimmed_means(diff, n, keep_one=True)
    short = (n > 0) & (n < SHORT_TOKENS)
    if bool(short.any()):
        total = n[short].sum()
        pooled = diff[short].reshape(1, -1)  # their token differences as one row (padding is 0: sorts last)
        out[short] = (_trimmed_means(pooled, total.unsqueeze(0), keep_one=False)[0] if total >= SHORT_TOKENS
                      else 0.0)  # fewer tokens than one long completion has: no evidence either way
    return out


def _trimmed_means(diff: torch.Tensor, n: torch.Tensor, *, keep_one: bool) -> torch.Tensor:
    """Row-wise mean of `diff` (>= 0; 0 past each row's `n` entries) without its ceil(TRIM_FRACTION x n)
    largest entries (at most n - 1 of them when `keep_one`; a row left with nothing: 0)."""
    k = torch.ceil(n * TRIM_FRACTION)
    if keep_one:
        k = torch.minimum(k, (n - 1).clamp(min=0))
    k = k.long()
    top = diff.sort(dim=1, descending=True).values.cumsum(dim=1)  # unused positions are 0: they sort last
    dropped = torch.where(k > 0, top.gather(1, (k - 1).clamp(min=0).unsqueeze(1)).squeeze(1), torch.zeros_like(n))
    left = n - k
    return torch.where(left > 0, (diff.sum(dim=1) - dropped) / left.clamp(min=1.0), torch.zeros_like(n))


def mismatch(recomputed: torch.Tensor, claimed: torch.Tensor, mask: torch.Tensor) -> float:
    """The worst completion's trimmed mean |claimed - recomputed| logprob per token (rows = completions)."""
    per_row = per_completion(recomputed, claimed, mask)
    return float(per_row.max()) if per_row.numel() else 0.0


def stored_version_path(store_dir: Path, version: int) -> Path:
    """Where the audit store keeps a published version's tensors (`<run_dir>/audit_versions/`)."""
    return Path(store_dir) / f"v{version:010d}.safetensors"


def stored_versions(store_dir: Path) -> dict[int, Path]:
    """The versions the audit store holds on disk, oldest first; a file not named by `stored_version_path`
    (foreign, or a temp file of `write_atomic`) is not one of them."""
    found = {}
    for path in Path(store_dir).glob("v*.safetensors"):
        digits = path.stem[1:]
        if digits.isdigit() and path == stored_version_path(store_dir, int(digits)):
            found[int(digits)] = path
    return dict(sorted(found.items()))


class Auditor:
    """Decides which batches to audit, keeps the adapter versions to audit against, runs the checks."""

    def __init__(self, learner, *, tolerance: float = DEFAULT_TOLERANCE, floor: float = 0.05,
                 keep_versions: int = 5, seed: int = 0, enabled: bool = True, lora_dropout: float = 0.0,
                 max_staleness: int | None = None, store_dir: Path | None = None, policy: AuditPolicy | None = None,
                 on_verdict: Callable[..., None] | None = None, device: str = ""):
        """`device`: where shadow passes run ("" = the learner's device, sharing its frozen base weights;
        another device holds a full copy of the model there)."""
        self.learner = learner
        self.policy = policy or AuditPolicy(tolerance)
        self.floor = floor
        self.keep_versions = max(1, keep_versions)
        self.enabled = enabled
        self.max_staleness = max_staleness  # batches older than this are dropped by the learner: no audit needed
        self.reuse_learner_pass = lora_dropout == 0.0  # a train-mode forward with dropout is not the policy
        self.on_verdict = on_verdict  # (batch_id, signer, code or None on pass, stage, strike=bool)
        self.store_dir = Path(store_dir) if store_dir is not None else None  # published tensors on disk
        learner_device = getattr(learner, "device", None)
        self.device = torch.device(device) if device else torch.device(learner_device or "cpu")
        self.own_copy = bool(device) and self.device != torch.device(learner_device or "cpu")
        if not enabled:
            self.model = None
        elif self.own_copy:  # a separate device: the whole model, not only the adapter, lives there
            self.model = copy.deepcopy(learner.model).to(self.device).eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
        else:
            self.model = shadow_model(learner.model)
        self.scorer = (CompletionScorer(self.model, vocab_limit=len(learner.tokenizer))  # models/logprobs.py,
                       if enabled else None)                                           # as the learner
        self._rng = random.Random(seed)
        self._lock = threading.Lock()        # guards the shadow model (one audit at a time)
        self._versions: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._published_step: dict[int, int] = {}  # version -> learner.steps when it was published
        self._trained: dict[int, bool] = {}  # version -> its adapter is not the zero one (policy learning counts it)
        self._loaded: int | None = None
        # deferred batch id -> (signer, engine dtype, engine kind); bounded: a batch the learner drops as stale before its
        # forward pass never reaches the hook, so its entry would otherwise stay forever
        self._pending: OrderedDict[bytes, tuple[bytes, str, str]] = OrderedDict()
        self.stats = {"audited": 0, "deferred": 0, "passed": 0, "failed": 0, "reused_learner_pass": 0,
                      "shadow_confirms": 0, "shadow_passes": 0, "skipped": 0, "seconds_ingest": 0.0,
                      "seconds_train": 0.0, "learner_seconds": 0.0, "max_passing_mismatch": 0.0, "unavailable": 0,
                      "reloaded_versions": 0}

    @classmethod
    def from_config(cls, cfg, learner) -> "Auditor":
        keep = (cfg.max_staleness + 1) if cfg.max_staleness is not None else 8
        return cls(learner, tolerance=cfg.audit_tolerance, floor=cfg.audit_floor, keep_versions=keep,
                   seed=cfg.seed, lora_dropout=cfg.lora_dropout, max_staleness=cfg.max_staleness,
                   enabled=cfg.audit and not getattr(learner, "sharded", False),  # FSDP: a shadow pass needs every rank
                   store_dir=Path(cfg.run_dir) / "audit_versions", policy=AuditPolicy.from_config(cfg),
                   device=getattr(cfg, "audit_device", ""))

    @property
    def tolerance(self) -> float:
        """The base tolerance (fp32 engines); per-dtype ones: `policy.tolerance(dtype)`."""
        return self.policy.base

    def attach(self, ingest) -> None:
        """Wire the two ends: ingest calls `check`, the learner calls `train_hook`, verdicts go to ingest."""
        self.on_verdict = ingest.audit_verdict
        if self.enabled:
            self.learner.audit_hook = self.train_hook
            if self.learner.audit_hook is None:
                # The learner takes no hook (DDP: each rank sees only its slice of the step). Then nothing
                # may be deferred to its pass: current-version batches are audited at ingest on the shadow.
                self.reuse_learner_pass = False

    # ---- adapter history --------------------------------------------------------------------------
    def remember_published(self, version: int, specs, blobs: dict[str, bytes], learner_steps: int) -> None:
        """The exact tensors volunteers will serve for `version` (the published dtype, e.g. bf16)."""
        if self.enabled:
            from asyncrl.models.lora import tensors_from_bytes

            self.remember(version, tensors_from_bytes(specs, blobs), learner_steps)

    def remember(self, version: int, tensors: dict[str, torch.Tensor], learner_steps: int) -> None:
        """Keep a published version's LoRA tensors (published dtype) for later audits, in memory and on disk."""
        if not self.enabled:
            return
        kept = {k: v.detach().clone() for k, v in tensors.items()}
        with self._lock:
            self._versions[version] = kept
            self._published_step[version] = learner_steps
            self._trained[version] = is_trained(kept)
            while len(self._versions) > self.keep_versions:
                old, _ = self._versions.popitem(last=False)
                self._published_step.pop(old, None)
                self._trained.pop(old, None)
                if self._loaded == old:
                    self._loaded = None
            held = set(self._versions)
        self._persist(version, kept, held)

    def _persist(self, version: int, tensors: dict[str, torch.Tensor], held: set[int]) -> None:
        if self.store_dir is None:
            return
        from safetensors.torch import save

        from asyncrl.protocol.atomic import write_atomic

        self.store_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(stored_version_path(self.store_dir, version),
                     save({k: v.contiguous() for k, v in tensors.items()}))
        for stored, path in stored_versions(self.store_dir).items():
            if stored not in held:
                path.unlink(missing_ok=True)

    def load_persisted(self) -> int:
        """`--resume`: load the versions kept on disk. They never count as the learner's current weights
        (a resumed learner's step counter may meet a pre-crash one), so they are checked on the shadow."""
        if not self.enabled or self.store_dir is None or not self.store_dir.exists():
            return 0
        from safetensors.torch import load_file

        stored = list(stored_versions(self.store_dir).items())[-self.keep_versions:]
        n = 0
        with self._lock:
            for version, path in stored:
                try:
                    self._versions[version] = load_file(str(path))
                except (OSError, RuntimeError):
                    continue  # a torn file: that version counts as unavailable
                self._published_step[version] = -1
                self._trained[version] = is_trained(self._versions[version])
                n += 1
            self._versions = OrderedDict(sorted(self._versions.items()))
        self.stats["reloaded_versions"] += n
        return n

    def expect(self, batch_id: bytes, signer: bytes, engine_dtype: str = "", engine_kind: str = "") -> None:
        """A journal replay: a batch whose train-time audit was pending at the crash (its groups carry the
        flag) — remember whom to credit or strike when the learner's pass checks it."""
        with self._lock:
            self._pending[batch_id] = (signer, engine_dtype, engine_kind)

    def _unavailable(self, version: int, current_version: int) -> bool:
        """A version we should hold (inside the kept window) but do not: our loss, not the sender's."""
        return current_version - version < self.keep_versions

    def held_versions(self) -> list[int]:
        with self._lock:
            return list(self._versions)

    # ---- ingest-time --------------------------------------------------------------------------------
    def probability(self, valid_streak: int, signer: bytes | None = None, engine_dtype: str = "",
                    engine_kind: str = "") -> float:
        if signer is not None and self.policy.in_quarantine(signer):
            return 1.0  # quarantine: every batch is audited until enough pass (coordinator/trust/audit_policy.py)
        if self.policy.learning(engine_dtype, engine_kind):
            return 1.0  # its engine class is still learning its tolerance: its first batches are all audited
        return 1.0 if valid_streak <= 0 else max(self.floor, 1.0 / valid_streak)

    def check(self, signer: bytes, batch_id: bytes, version: int, groups, *, valid_streak: int,
              current_version: int, engine_dtype: str = "", engine_kind: str = "") -> str:
        """Audit (or schedule an audit of) a batch, here and now: `route`, then `audit_shadow` when it needs
        a pass of its own (tools, benches, tests; the coordinator queues that pass on its AuditWorker).
        Returns "skipped", "stale", "deferred", "passed" or "unavailable"; raises
        ProtocolError(LOGPROB_MISMATCH | STALE_VERSION)."""
        route = self.route(signer, batch_id, version, groups, valid_streak=valid_streak,
                           current_version=current_version, engine_dtype=engine_dtype, engine_kind=engine_kind)
        if route != "queued":
            return route
        return self.audit_shadow(signer, batch_id, version, groups, current_version=current_version,
                                 engine_dtype=engine_dtype, engine_kind=engine_kind, stage="ingest")

    def route(self, signer: bytes, batch_id: bytes, version: int, groups, *, valid_streak: int,
              current_version: int, engine_dtype: str = "", engine_kind: str = "") -> str:
        """Ingest's decision, cheap (no forward pass): "skipped" (not sampled), "stale" (the learner drops it
        unread), "deferred" (the learner's own pass checks it: its groups are flagged) or "queued" (it needs a
        shadow-model pass: `audit_shadow`, on the AuditWorker)."""
        if not self.enabled or self._rng.random() >= self.probability(valid_streak, signer, engine_dtype, engine_kind):
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
                self._pending[batch_id] = (signer, engine_dtype, engine_kind)
                while len(self._pending) > MAX_PENDING:
                    self._pending.popitem(last=False)
            self.stats["deferred"] += 1
            return "deferred"
        return "queued"

    def audit_shadow(self, signer: bytes, batch_id: bytes, version: int, groups, *, current_version: int,
                     engine_dtype: str = "", engine_kind: str = "", stage: str = "audit") -> str:
        """The shadow-model audit of a routed ("queued") batch. Returns "passed", "unavailable" (a version
        we should hold but lost: our loss) or "stale" (it went stale while waiting: the learner drops it
        unread); raises ProtocolError(LOGPROB_MISMATCH, `.strike` set by the policy | STALE_VERSION)."""
        if self.max_staleness is not None and current_version - version > self.max_staleness:
            self.stats["stale"] = self.stats.get("stale", 0) + 1
            return "stale"
        t0 = time.perf_counter()
        try:
            stat = self._shadow_mismatch(groups, version)
        except ProtocolError as exc:
            if exc.code is RejectCode.STALE_VERSION and self._unavailable(version, current_version):
                self.stats["unavailable"] += 1
                return "unavailable"
            raise
        finally:
            self.stats["seconds_ingest"] += time.perf_counter() - t0
        self._judge(stat, batch_id, signer, stage, raise_on_fail=True, engine_dtype=engine_dtype,
                    engine_kind=engine_kind, version=version)
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
                code = None
            except ProtocolError as exc:  # version not held
                stat, code = float("inf"), exc.code
                if self._unavailable(version, self.learner.version):  # our loss: trained, counted
                    self.stats["unavailable"] += 1
                    stat, code = None, None
            for i in idxs:
                groups[i].audit = False
            with self._lock:
                signer, engine_dtype, engine_kind = self._pending.pop(batch_id, (b"", "", ""))
            if stat is None:
                continue
            if code is None:
                if not self._judge(stat, batch_id, signer, "train", raise_on_fail=False, engine_dtype=engine_dtype,
                                   engine_kind=engine_kind, version=version):
                    rejected.add(batch_id)
            else:
                self.stats["failed"] += 1
                rejected.add(batch_id)
                if self.on_verdict is not None:
                    self.on_verdict(batch_id, signer, code, "train", strike=False)  # our retention, not a lie
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
            recomputed, mask = self._score(groups)
            self.stats["shadow_passes"] += 1
        claimed = torch.zeros_like(recomputed)
        for k, lp in enumerate(lp for g in groups for lp in g.sampling_logprobs):
            claimed[k, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
        return recomputed, {"sampling_logps": claimed, "mask": mask}

    def _score(self, groups) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.own_copy:
            return self.learner.score_groups(groups, model=self.scorer)
        return score_rows(self.scorer, rows_of(groups), self.learner.tokenizer.pad_token_id, self.device,
                          self.learner.micro_batch_tokens)

    def _shadow_mismatch(self, groups, version: int) -> float:
        recomputed, batch = self.shadow_logprobs(groups, version)
        return mismatch(recomputed, batch["sampling_logps"], batch["mask"])

    def _judge(self, stat: float, batch_id: bytes, signer: bytes, stage: str, *, raise_on_fail: bool,
               engine_dtype: str = "", engine_kind: str = "", version: int | None = None) -> bool:
        """Apply the policy (tolerance for the batch's engine class; quarantine before strikes). True = pass.
        A miss raises (ingest: the code goes in the ack) or reports through `on_verdict` (train time)."""
        with self._lock:
            trained = self._trained.get(version, True) if version is not None else True
        j = self.policy.judge(signer or b"?", stat, engine_dtype, engine_kind, trained=trained)
        if j.ok:
            self.stats["passed"] += 1
            self.stats["max_passing_mismatch"] = max(self.stats["max_passing_mismatch"], stat)
            if self.on_verdict is not None:
                self.on_verdict(batch_id, signer, None, stage)
            return True
        self.stats["failed"] += 1
        verdict = "struck" if j.strike else "quarantined, no strike"
        err = ProtocolError(RejectCode.LOGPROB_MISMATCH,
                            f"worst completion differs by {stat:.2e} nats/token (tolerance {j.tolerance:.1e}; {verdict})")
        err.strike = j.strike
        if raise_on_fail:
            raise err
        if self.on_verdict is not None:
            self.on_verdict(batch_id, signer, RejectCode.LOGPROB_MISMATCH, stage, strike=j.strike)
        return False

    # ---- start-up calibration (coordinator/trust/audit_policy.py) ----------------------------------------
    @torch.no_grad()
    def calibrate(self, tensors: dict[str, torch.Tensor], prompts: list[list[int]], *, temperature: float,
                  max_new_tokens: int, group_size: int = 8, dtypes=("bf16", "fp16"), seed: int = 0) -> dict:
        """Measure how far honest engines in each of `dtypes` land from this audit's own numbers, on
        completions sampled from the policy `tensors` (the version the swarm starts with), and set the
        policy's tolerance for each. Returns the policy's status."""
        if not self.enabled or not prompts:
            return self.policy.status()
        from asyncrl.models.lora import load_lora

        t0 = time.perf_counter()
        device = next(self.model.parameters()).device
        with self._lock:
            load_lora(self.model, tensors)
            self._loaded = None  # the shadow now holds the calibration adapter, not a kept version
            groups = self._sample(prompts, temperature=temperature, max_new_tokens=max_new_tokens,
                                  group_size=group_size, seed=seed)
            ours, mask = self._score(groups)  # the audit's own path
            for dtype in dtypes:
                torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
                try:
                    with torch.autocast(device_type=device.type, dtype=torch_dtype):
                        engine, _ = self._score(groups)  # an engine in that dtype
                except (RuntimeError, TypeError) as exc:  # autocast cannot emulate it here: keep the loosest
                    self.policy.calibration[dtype] = {"error": str(exc)[:200]}
                    continue
                self.policy.set_calibrated(dtype, per_completion(ours, engine, mask).tolist())
        self.policy.calibration["seconds"] = time.perf_counter() - t0
        self.policy.calibration["completions"] = int(mask.shape[0])
        return self.policy.status()

    def _sample(self, prompts, *, temperature: float, max_new_tokens: int, group_size: int, seed: int):
        """Honest completions from the shadow model (HF generate, sampling), as TrainGroups."""
        tok = self.learner.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        stop = {t for t in (tok.eos_token_id, pad) if t is not None}
        torch.manual_seed(seed)
        device = next(self.model.parameters()).device
        rows = getattr(self.model.config, "vocab_size", len(tok))
        padded = {"suppress_tokens": list(range(len(tok), rows))} if rows > len(tok) else {}  # as the engines
        groups = []
        for ids in prompts:
            inp = torch.tensor([ids], device=device)
            out = self.model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), do_sample=True,
                                      temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                                      num_return_sequences=group_size, pad_token_id=pad, **padded)
            comps = []
            for row in out[:, len(ids):].tolist():
                cut = next((i for i, t in enumerate(row) if t in stop), len(row))
                comps.append(row[:max(1, cut)])
            groups.append(TrainGroup(list(ids), comps, [[0.0] * len(c) for c in comps], [0.0] * len(comps),
                                     version=-1, temperature=temperature))
        return groups

    def learner_stepped(self, seconds: float) -> None:
        """The learner took a step of `seconds` (its thread): status() reports the audit's cost against them."""
        self.stats["learner_seconds"] += seconds

    def engines_status(self) -> dict[str, dict]:
        """Per engine class, its tolerance and whether it is still learning (audit_policy.py)."""
        return self.policy.engines_status()

    def status(self) -> dict:
        s = dict(self.stats)
        s["tolerance"] = self.tolerance
        s["policy"] = self.policy.status()
        s["floor"] = self.floor
        s["held_versions"] = self.held_versions()
        learner_s = s["learner_seconds"]
        s["cost_fraction_of_learner"] = ((s["seconds_ingest"] + s["seconds_train"]) / learner_s) if learner_s else None
        return s
