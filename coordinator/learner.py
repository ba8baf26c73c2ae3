"""Learner: GRPO steps on the LoRA adapter from whatever rollout groups have arrived.

Owns the policy (base model + PEFT LoRA), the optimizer and the version counter. It knows nothing
about the network: the service hands it `TrainGroup`s that ingest already verified, and asks it to
export the adapter for publishing. Staleness filtering (`max_staleness`) happens here because the
learner owns the version counter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from asyncrl.protocol.messages import LoraSpec

from .loss import LossConfig, group_advantages, grpo_loss


@dataclass
class TrainGroup:
    """One prompt's G completions, as the learner needs them."""

    prompt_ids: list[int]
    completions: list[list[int]]
    sampling_logprobs: list[list[float]]
    rewards: list[float]
    version: int
    temperature: float = 1.0
    client: str = ""
    batch_id: bytes = b""  # the rollout batch it came in (set when a train-time audit is pending)
    audit: bool = False    # check its sampling logprobs against this step's forward pass (coordinator/audit.py)


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
    """Loss statistics (coordinator.loss.LossStats.metrics) plus the staleness histogram."""


class Learner:
    def __init__(self, model: str, lora: LoraSpec, *, lr: float, loss: LossConfig,
                 max_staleness: int | None, weight_decay: float = 0.0, max_grad_norm: float = 1.0,
                 seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32):
        from asyncrl.models.lora import load_base_model, with_lora

        base, self.tokenizer = load_base_model(model, dtype=dtype)
        self.model = with_lora(base, lora, seed=seed).to(device)
        self.model.train()
        self.device = device
        self.loss_cfg = loss
        self.max_staleness = max_staleness
        self.max_grad_norm = max_grad_norm
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        self.version = 0  # version of the adapter currently held (== last published or to publish)
        self.audit_hook = None  # fn(groups, logps, mask) -> batch ids to drop (coordinator/audit.py)
        self.steps = 0

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def is_stale(self, version: int) -> bool:
        return self.max_staleness is not None and self.version - version > self.max_staleness

    def lora_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def step(self, groups: list[TrainGroup]) -> StepResult | None:
        """One optimizer step on `groups` (stale ones dropped). None when nothing usable is left."""
        t0 = time.perf_counter()
        fresh = [g for g in groups if not self.is_stale(g.version)]
        dropped = len(groups) - len(fresh)
        if not fresh:
            return None
        batch = self._collate(fresh)
        logps = self._completion_logprobs(batch)
        if self.audit_hook is not None and any(g.audit for g in fresh):
            # Generation audit on this very forward pass; a failing batch goes before any gradient exists.
            rejected = self.audit_hook(fresh, logps.detach(), batch["mask"])
            if rejected:
                fresh = [g for g in fresh if g.batch_id not in rejected]
                if not fresh:
                    return None
                batch = self._collate(fresh)
                logps = self._completion_logprobs(batch)
        ref = None
        if self.loss_cfg.beta > 0:  # reference = the base model: the same weights, adapter switched off
            with torch.no_grad(), self.model.disable_adapter():
                ref = self._completion_logprobs(batch)
        adv = group_advantages(batch["rewards"], batch["group_ids"], self.loss_cfg.scale_rewards).to(logps.device)
        stats = grpo_loss(logps, batch["sampling_logps"], adv, batch["mask"], self.loss_cfg, ref_logps=ref)
        self.optimizer.zero_grad(set_to_none=True)
        stats.loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], self.max_grad_norm)
        self.optimizer.step()
        self.steps += 1
        staleness = [self.version - g.version for g in fresh]
        hist: dict[str, int] = {}
        for s in sorted(staleness):
            hist[str(s)] = hist.get(str(s), 0) + 1
        return StepResult(
            version=self.version,
            loss=float(stats.loss.detach()),
            reward_mean=float(batch["rewards"].mean()),
            groups_used=len(fresh),
            groups_dropped_stale=dropped,
            staleness=staleness,
            clip_fraction=stats.clip_fraction,
            ratio_mean=stats.ratio_mean,
            is_weight_mean=stats.is_weight_mean,
            seconds=time.perf_counter() - t0,
            tokens=int(batch["attn"].sum()),
            metrics={**stats.metrics(), "staleness_hist": hist, "staleness_max": max(staleness),
                     "staleness_mean": sum(staleness) / len(staleness), "groups_dropped_stale": dropped},
        )

    def _collate(self, groups: list[TrainGroup]) -> dict[str, torch.Tensor]:
        return collate_groups(groups, self.tokenizer.pad_token_id, self.device)

    def _completion_logprobs(self, batch) -> torch.Tensor:
        return completion_logprobs(self.model, batch)


def collate_groups(groups: list[TrainGroup], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] prompt+completion rows; completion positions flagged in `mask`."""
    rows, prompt_lens, comp_lens, rewards, gids, samp, temps = [], [], [], [], [], [], []
    for gi, g in enumerate(groups):
        for comp, lp, r in zip(g.completions, g.sampling_logprobs, g.rewards):
            rows.append(list(g.prompt_ids) + list(comp))
            prompt_lens.append(len(g.prompt_ids))
            comp_lens.append(len(comp))
            samp.append(lp)
            rewards.append(r)
            gids.append(gi)
            temps.append(g.temperature)
    width = max(len(r) for r in rows)
    tmax = max(comp_lens)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), tmax))
    slp = torch.zeros((len(rows), tmax))
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        attn[i, :len(r)] = 1
        mask[i, :comp_lens[i]] = 1
        slp[i, :comp_lens[i]] = torch.tensor(samp[i], dtype=torch.float32)
    return {"ids": ids.to(device), "attn": attn.to(device), "mask": mask.to(device),
            "sampling_logps": slp.to(device), "rewards": torch.tensor(rewards, dtype=torch.float32),
            "group_ids": torch.tensor(gids), "prompt_lens": torch.tensor(prompt_lens),
            "comp_lens": torch.tensor(comp_lens), "temps": torch.tensor(temps, dtype=torch.float32)}


def completion_logprobs(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log pi(token) for every completion token, [B, Tmax], under the same temperature as sampling.

    Cost matters here (bench/learner_throughput.py): the LM head runs only from the first position
    that predicts a completion token (`logits_to_keep`), and the log-probability of the taken
    token is gather - logsumexp (TRL's selective_log_softmax) instead of a full-vocabulary
    log_softmax copy; the [B, T] result is then shifted into completion-aligned columns.
    """
    ids = batch["ids"]
    B, tmax = batch["mask"].shape
    width = ids.shape[1]
    start = int(batch["prompt_lens"].min()) - 1  # first position whose next token is a completion token
    keep = width - start
    logits = model(input_ids=ids, attention_mask=batch["attn"], logits_to_keep=keep).logits
    logits = logits[:, :-1]  # the last position predicts nothing we train on
    if logits.dtype != torch.float32:
        logits = logits.float()
    temps = batch["temps"]
    if not bool((temps == 1.0).all()):
        logits = logits / temps.to(logits.device).view(-1, 1, 1)
    targets = ids[:, start + 1:]
    logp = logits.gather(2, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    # completion token j of row i sits at position prompt_len + j, predicted by position - 1
    col = batch["prompt_lens"].view(-1, 1) - 1 - start + torch.arange(tmax).view(1, -1)
    col = col.clamp(max=max(0, logp.shape[1] - 1)).to(logp.device)
    return logp.gather(1, col) * batch["mask"]
