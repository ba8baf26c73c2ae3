"""Learner: GRPO steps on the LoRA adapter from whatever rollout groups have arrived.

Owns the policy (base model + PEFT LoRA), the optimizer, the LR schedule and the version counter. It knows
nothing about the network: the service hands it `TrainGroup`s that ingest already verified, and asks it to
export the adapter for publishing. Staleness filtering (`max_staleness`) happens here because the learner
owns the version counter. docs/learner.md is the operator's view (memory budget, dtype policy, commands).

One step (`step`):
  1. drop stale groups; run the train-time generation audit, if any group asks for it, on a *no-grad* pass
     over just the audited groups (micro-batched like training), and drop the batches it rejects — before
     any gradient exists, so a rejection never redoes the step (cost: one forward of the audited rows);
  2. flatten the groups into rows, group-relative advantages over the whole step, and the step's global
     normaliser (`loss.StepNormaliser`: rows and trained tokens of the *whole* step, every rank);
  3. rows sorted by length and packed into micro-batches of at most `micro_batch_tokens` padded tokens
     (`plan_micro_batches`); each micro-batch is padded to its own longest row, its loss is
     sum(per-token objective * `loss.token_weights`(global normaliser)) and is back-propagated at once, so
     gradients accumulate to exactly the full-batch gradient (tests/coordinator/learner/test_microbatch.py);
  4. statistics (`loss.LossTotals`) are summed across micro-batches on the device and read once per step;
     grad norm (before clipping), clip, AdamW step, LR scheduler step.
Device and dtype: base weights in `dtype` (bf16 on CUDA by default) on `device`; the LoRA parameters and so
AdamW's state are fp32 (master weights). Log-probs come from models/logprobs.py (no [B, T, V] fp32 tensor).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncrl.protocol.messages import LoraSpec

from .corrections import decay_row_weights
from .loss import (
    LossConfig,
    LossTotals,
    StepNormaliser,
    group_advantages,
    overlong_penalty,
    policy_terms,
    token_weights,
)


@dataclass
class TrainGroup:
    """One prompt's G completions, as the learner needs them. Ingest hands over numpy arrays (int32 ids,
    float32 logprobs: views of the verified payload, no per-token Python objects); lists work the same
    (tests, a journal replayed from disk). `encode_hook` writes either as msgpack lists."""

    prompt_ids: list[int]
    completions: list[list[int]]       # or int32 arrays (coordinator/ingest/ingest.py)
    sampling_logprobs: list[list[float]]  # or float32 arrays
    rewards: list[float]
    version: int
    temperature: float = 1.0
    client: str = ""
    batch_id: bytes = b""  # the rollout batch it came in (set when a train-time audit is pending)
    audit: bool = False    # check its sampling logprobs against this step's forward pass (coordinator/trust/audit.py)
    truncated: list[bool] = field(default_factory=list)
    """Per completion: finish_reason "length" as ingest derived it (empty = none); loss.mask_truncated drops them."""
    per_reward: dict[str, list[float | None]] = field(default_factory=dict)
    """Each reward function's own values per completion (None = not applicable; tasks.GroupScore), for the
    per-reward metrics (coordinator/operator/reward_log.py); the learner trains on `rewards`, their weighted total."""
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    """The batch's other sampling knobs (protocol SamplingParams): the learner and the audit score the
    processed distribution the volunteer sampled from (models/sampling.py); the defaults process nothing."""
    env_masks: list | None = None
    """Per completion of a multi-turn episode (envs/): 1 per environment token (no loss, no logprob audit), or
    None for a completion the model sampled whole; None = no episodes in this group."""

    def truncated_flags(self) -> list[bool]:
        return list(self.truncated) if self.truncated else [False] * len(self.completions)


def sampling_knobs(sampling) -> dict:
    """A batch's SamplingParams knobs as TrainGroup's keyword arguments."""
    return {"top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": sampling.min_p,
            "repetition_penalty": sampling.repetition_penalty}


@dataclass
class Row:
    """One completion of a step, as a micro-batch needs it."""

    ids: list[int]           # prompt + completion (an int64 array from rows_of)
    prompt_len: int
    sampling_logprobs: list[float]  # (a float32 array from rows_of)
    reward: float
    group: int               # index of its group in the step
    temperature: float = 1.0
    advantage: float = 0.0
    loss_mask: list[float] | None = None  # per completion token (None = all 1); truncation masks go here
    staleness: int = 0       # learner version - the version that generated it (coordinator/learner/corrections.py)
    weight: float = 1.0      # `stale_weighting` row weight
    sampled: list[float] | None = None  # per completion token: 1 = sampled by the model, 0 = environment token
    knobs: tuple[float, int, float, float] = (1.0, 0, 0.0, 1.0)  # (top_p, top_k, min_p, repetition_penalty)

    @property
    def comp_len(self) -> int:
        return len(self.ids) - self.prompt_len

    def mask(self) -> list[float]:
        return self.loss_mask if self.loss_mask is not None else [1.0] * self.comp_len


def encode_hook(obj):
    """msgspec `enc_hook` for `TrainGroup`s holding numpy arrays (the journal, the DDP broadcast): plain
    msgpack lists, so either form decodes as the annotated `list[list[int]]` / `list[list[float]]`."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def rows_of(groups: list[TrainGroup]) -> list[Row]:
    """Rows in group order (the order the audit hook and `collate_groups` use); ids int64 and sampling
    logprobs float32 arrays, whether the group holds arrays (ingest) or lists."""
    rows = []
    for gi, g in enumerate(groups):
        prompt = np.asarray(g.prompt_ids, dtype=np.int64)
        masks = g.env_masks or [None] * len(g.completions)
        for comp, lp, r, env in zip(g.completions, g.sampling_logprobs, g.rewards, masks):
            row = Row(np.concatenate((prompt, np.asarray(comp, dtype=np.int64))), len(prompt),
                      np.array(lp, dtype=np.float32), float(r), gi, g.temperature,
                      knobs=(g.top_p, g.top_k, g.min_p, g.repetition_penalty))
            if env is not None:  # an episode: its environment tokens are context, never loss (envs/episode.py)
                row.sampled = (1.0 - np.asarray(env, dtype=np.float32)).tolist()
                row.loss_mask = list(row.sampled)
            rows.append(row)
    return rows


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices into `lengths`, longest first, packed so that rows x longest row <= max_tokens per
    micro-batch (a row longer than the budget goes alone). Sorting keeps per-micro-batch padding small."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan: list[list[int]] = []
    for i in order:
        if plan and (len(plan[-1]) + 1) * lengths[plan[-1][0]] <= max_tokens:
            plan[-1].append(i)
        else:
            plan.append([i])
    return plan


@dataclass
class StepResult:
    version: int
    loss: float
    reward_mean: float
    groups_used: int
    groups_dropped_stale: int
    staleness: list[int] = field(default_factory=list)
    clip_fraction: float = 0.0
    ratio_mean: float = 1.0
    is_weight_mean: float = 1.0
    seconds: float = 0.0
    tokens: int = 0
    """Non-pad tokens (prompt + completion) through forward and backward this step."""
    metrics: dict = field(default_factory=dict)
    """Loss statistics (coordinator.learner.loss.LossStats.metrics), the staleness histogram, grad_norm (before
    clipping), entropy_mean, lr, micro_batches and tokens_per_s."""


class Learner:
    def __init__(self, model: str, lora: LoraSpec, *, lr: float, loss: LossConfig,
                 max_staleness: int | None, weight_decay: float = 0.0, max_grad_norm: float = 1.0,
                 seed: int = 0, device: str = "cpu", dtype: str | torch.dtype = "fp32",
                 micro_batch_tokens: int = 8192, gradient_checkpointing: bool = False,
                 lr_scheduler: str = "constant", warmup_steps: int = 0, total_steps: int = 0):
        from asyncrl.models.logprobs import CompletionScorer
        from asyncrl.models.lora import load_base_model, resolve_placement, with_lora

        self.device, self.dtype = resolve_placement(device, dtype)
        load_on = self._load_device()
        base, self.tokenizer = load_base_model(model, dtype=self.dtype, device=load_on)
        if gradient_checkpointing:  # non-reentrant: gradients reach the LoRA weights without input grads
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = with_lora(base, lora, seed=seed).to(load_on)
        for p in self.model.parameters():  # fp32 master weights (PEFT's adapter autocast does this too)
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
        self.model.train()
        self.scorer = CompletionScorer(self.model, vocab_limit=len(self.tokenizer))  # the engines' vocabulary
        self._prepare_model()  # FSDP shards the base here (coordinator/learner/ddp.py)
        self.loss_cfg = loss
        self.max_staleness = max_staleness
        self.max_grad_norm = max_grad_norm
        self.micro_batch_tokens = micro_batch_tokens
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        self.scheduler = make_scheduler(self.optimizer, lr_scheduler, warmup_steps=warmup_steps,
                                        total_steps=total_steps)
        self.version = 0  # version of the adapter currently held (== last published or to publish)
        self.audit_hook = None  # fn(groups, logps, mask) -> batch ids to drop (coordinator/trust/audit.py)
        self.steps = 0

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def is_stale(self, version: int) -> bool:
        return self.max_staleness is not None and self.version - version > self.max_staleness

    def next_version(self) -> int:
        """The adapter as it is now becomes a new version (the hub then publishes it); returns its number.
        Batches generated with older versions are judged stale against it."""
        self.version += 1
        return self.version

    def resume_at(self, steps: int, version: int) -> None:
        """A resumed run's position (coordinator/checkpoint.py): `steps` taken, adapter `version` held."""
        self.steps, self.version = steps, version

    def lora_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def step(self, groups: list[TrainGroup]) -> StepResult | None:
        """One optimizer step on `groups` (stale ones dropped). None when nothing usable is left."""
        t0 = time.perf_counter()
        fresh = [g for g in groups if not self.is_stale(g.version)]
        dropped = len(groups) - len(fresh)
        if not fresh:
            return None
        if self.audit_hook is not None and any(g.audit for g in fresh):
            # Generation audit on a no-grad pass over the audited groups, before any gradient exists.
            audited = [g for g in fresh if g.audit]
            logps, mask = self.score_groups(audited)
            rejected = self.audit_hook(audited, logps, mask)
            if rejected:
                fresh = [g for g in fresh if g.batch_id not in rejected]
                if not fresh:
                    return None
        return self._train(fresh, dropped, t0)

    # ---- the step proper ---------------------------------------------------------------------------
    def _train(self, fresh: list[TrainGroup], dropped: int, t0: float) -> StepResult:
        cfg = self.loss_cfg
        rows = rows_of(fresh)
        truncated = [t for g in fresh for t in g.truncated_flags()]  # ingest derived them from the tokens
        penalty = overlong_penalty(torch.tensor([r.comp_len for r in rows]), cfg.max_completion_length,
                                   cfg.overlong_buffer, cfg.overlong_factor)  # DAPO soft overlong punishment
        adv = group_advantages(torch.tensor([r.reward for r in rows]) + penalty, torch.tensor([r.group for r in rows]),
                               cfg.scale_rewards)
        for r, a, cut in zip(rows, adv.tolist(), truncated):
            r.advantage = a
            r.staleness = self.version - fresh[r.group].version
            if cut and cfg.mask_truncated:  # DAPO overlong filtering: no loss from a completion cut at the cap
                r.loss_mask = [0.0] * r.comp_len
        if self.loss_cfg.stale_weighting == "decay":  # over the whole step's rows, before any micro-batch
            weights = decay_row_weights([r.staleness for r in rows], self.loss_cfg.stale_half_life)
            for r, w in zip(rows, weights.tolist()):
                r.weight = w
        norm = StepNormaliser.over(r.mask() for r in rows)  # the whole step's, every rank's rows included
        mine, scale = self._local_rows(rows)
        plan = plan_micro_batches([len(r.ids) for r in mine], self.micro_batch_tokens)
        totals = LossTotals()
        tokens = 0
        n_real = len(plan)
        plan = plan + [plan[-1]] * (self._micro_batch_count(len(plan)) - len(plan))
        self.optimizer.zero_grad(set_to_none=True)
        for k, idx in enumerate(plan):
            batch = self._collate_rows([mine[i] for i in idx])
            part = scale if k < n_real else 0.0  # padding micro-batches (FSDP: same count on every rank) count 0
            with self._sync(last=k == len(plan) - 1):
                out = self._forward(batch)
                ref = None
                if self.loss_cfg.beta > 0:  # reference = the base model: the same weights, adapter switched off
                    with torch.no_grad(), self.model.disable_adapter():
                        ref = self.scorer(batch, entropy=False).logps
                terms = policy_terms(out.logps, batch["sampling_logps"], batch["adv"], batch["mask"],
                                     self.loss_cfg, ref_logps=ref, staleness=batch["staleness"],
                                     row_weights=batch["row_weight"] if self.loss_cfg.stale_weighting != "none"
                                     else None)
                loss = (terms.per_token * token_weights(batch["mask"], self.loss_cfg, norm)).sum()
                (loss * part).backward()
            if part:
                totals.add(loss, terms, batch["adv"], batch["mask"], self.loss_cfg, out.entropy)
                tokens += sum(len(mine[i].ids) for i in idx)  # non-pad tokens, from the host's rows: no sync
        self._finish_gradients()
        totals = self._reduce(totals)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.steps += 1
        stats = totals.stats()
        staleness = [self.version - g.version for g in fresh]
        hist: dict[str, int] = {}
        for s in sorted(staleness):
            hist[str(s)] = hist.get(str(s), 0) + 1
        seconds = time.perf_counter() - t0
        tokens = self._reduce_count(tokens)
        return StepResult(
            version=self.version,
            loss=float(stats.loss),
            reward_mean=sum(r.reward for r in rows) / len(rows),
            groups_used=len(fresh),
            groups_dropped_stale=dropped,
            staleness=staleness,
            clip_fraction=stats.clip_fraction,
            ratio_mean=stats.ratio_mean,
            is_weight_mean=stats.is_weight_mean,
            seconds=seconds,
            tokens=tokens,
            metrics={**stats.metrics(), "truncated_fraction": sum(truncated) / max(1, len(truncated)),
                     "overlong_penalty_mean": float(penalty.mean()), "staleness_hist": hist,
                     "staleness_max": max(staleness),
                     "staleness_mean": sum(staleness) / len(staleness), "groups_dropped_stale": dropped,
                     "grad_norm": grad_norm, "lr": lr, "micro_batches": n_real,
                     "tokens_per_s": tokens / seconds if seconds > 0 else 0.0},
        )

    # ---- seams DistributedLearner / ShardedLearner override (coordinator/learner/ddp.py) --------------------------
    def _load_device(self) -> str:
        return self.device

    def _prepare_model(self) -> None:
        pass

    def _micro_batch_count(self, n: int) -> int:
        """How many micro-batches this rank runs (FSDP: the most any rank needs; extras count 0)."""
        return n

    def _finish_gradients(self) -> None:
        pass

    def _local_rows(self, rows: list[Row]) -> tuple[list[Row], float]:
        """The rows this process trains, and the factor on their loss (0 for a placeholder)."""
        return rows, 1.0

    def _sync(self, last: bool):
        return nullcontext()

    def _forward(self, batch):
        return self.scorer(batch)

    def _reduce(self, totals: LossTotals) -> LossTotals:
        return totals

    def _reduce_count(self, n: int) -> int:
        return n

    # ---- scoring without gradients (audit) -----------------------------------------------------------
    @torch.no_grad()
    def score_groups(self, groups: list[TrainGroup], model=None) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, Tmax] completion log-probs (rows in group order, on CPU) and the generated-token mask, under
        `model` (default: the learner's own policy), micro-batched like a training step."""
        return score_rows(self.scorer if model is None else model, rows_of(groups), self.tokenizer.pad_token_id,
                          self.device, self.micro_batch_tokens)

    def _collate(self, groups: list[TrainGroup]) -> dict[str, torch.Tensor]:
        return collate_groups(groups, self.tokenizer.pad_token_id, self.device)

    def _collate_rows(self, rows: list[Row]) -> dict[str, torch.Tensor]:
        return collate_rows(rows, self.tokenizer.pad_token_id, self.device)

    def _completion_logprobs(self, batch) -> torch.Tensor:
        return self.scorer(batch).logps


def make_scheduler(optimizer, kind: str, *, warmup_steps: int = 0, total_steps: int = 0):
    """transformers' schedules (TRL's `lr_scheduler_type`): constant (with warmup), cosine or linear decay
    to 0 at `total_steps`. A LambdaLR whose state_dict is plain JSON (checkpointed, restored by --resume)."""
    from transformers import get_scheduler

    if kind not in ("constant", "cosine", "linear"):
        raise ValueError(f"lr_scheduler must be constant, cosine or linear, not {kind!r}")
    if kind != "constant" and total_steps <= 0:
        raise ValueError(f"lr_scheduler {kind} needs a positive number of training steps (max_steps)")
    name = "constant_with_warmup" if kind == "constant" else kind
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps,
                         num_training_steps=total_steps if kind != "constant" else None)


def score_rows(scorer, rows: list[Row], pad_id: int, device, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad completion log-probs of `rows` ([rows, Tmax] in the given order, CPU) and the [rows, Tmax]
    mask of generated tokens (1 for j < comp_len: every sampled token, whatever the loss mask says; an
    episode's environment tokens are 0 — nothing was sampled there, so the audit does not look at them)."""
    tmax = max((r.comp_len for r in rows), default=0)
    logps = torch.zeros((len(rows), tmax))
    for idx in plan_micro_batches([len(r.ids) for r in rows], max_tokens):
        batch = collate_rows([rows[i] for i in idx], pad_id, device)
        part = scorer(batch, entropy=False).logps.float().cpu()
        logps[idx, :part.shape[1]] = part
    generated = (torch.arange(tmax).unsqueeze(0) < torch.tensor([r.comp_len for r in rows]).unsqueeze(1)).float()
    for i, r in enumerate(rows):
        if r.sampled is not None:
            generated[i, :r.comp_len] = torch.tensor(r.sampled)
    return logps, generated


def collate_groups(groups: list[TrainGroup], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] prompt+completion rows of `groups`, in group order (see collate_rows)."""
    rows = rows_of(groups)
    batch = collate_rows(rows, pad_id, device)
    batch["rewards"] = torch.tensor([r.reward for r in rows], dtype=torch.float32)
    batch["group_ids"] = torch.tensor([r.group for r in rows])
    return batch


def collate_rows(rows: list[Row], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Right-padded [B, W] ids/attn (W = this micro-batch's longest row); [B, Tmax] loss `mask` and sampling
    logprobs in completion-aligned columns; [B] prompt_lens, comp_lens, temps, advantages `adv`, version gaps
    `staleness` and `row_weight`; and [B] `top_p`, `top_k`, `min_p`, `repetition_penalty` when some row
    was sampled with one of those knobs (models/logprobs.py then scores the processed distribution)."""
    width = max(len(r.ids) for r in rows)
    tmax = max(r.comp_len for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), tmax))
    slp = torch.zeros((len(rows), tmax))
    for i, r in enumerate(rows):
        ids[i, :len(r.ids)] = torch.as_tensor(r.ids)
        attn[i, :len(r.ids)] = 1
        mask[i, :r.comp_len] = torch.tensor(r.mask(), dtype=torch.float32)
        slp[i, :r.comp_len] = torch.as_tensor(r.sampling_logprobs, dtype=torch.float32)
    batch = {"ids": ids.to(device), "attn": attn.to(device), "mask": mask.to(device),
            "sampling_logps": slp.to(device),
            "adv": torch.tensor([r.advantage for r in rows], dtype=torch.float32).to(device),
            "prompt_lens": torch.tensor([r.prompt_len for r in rows]),
            "comp_lens": torch.tensor([r.comp_len for r in rows]),
            "temps": torch.tensor([r.temperature for r in rows], dtype=torch.float32),
            "staleness": torch.tensor([r.staleness for r in rows]).to(device),
            "row_weight": torch.tensor([r.weight for r in rows], dtype=torch.float32).to(device)}
    if any(r.knobs != Row.knobs for r in rows):
        for i, (key, dtype) in enumerate((("top_p", torch.float32), ("top_k", torch.long), ("min_p", torch.float32),
                                          ("repetition_penalty", torch.float32))):
            batch[key] = torch.tensor([r.knobs[i] for r in rows], dtype=dtype)
    return batch


def completion_logprobs(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log pi(token) for every completion token, [B, Tmax], under the same temperature as sampling
    (models/logprobs.py: only completion positions reach the LM head, chunked, no [B, T, V] fp32 tensor).
    `model` is a (PEFT) causal LM or an existing `CompletionScorer`."""
    from asyncrl.models.logprobs import CompletionScorer

    scorer = model if isinstance(model, CompletionScorer) else CompletionScorer(model)
    return scorer(batch, entropy=False).logps
