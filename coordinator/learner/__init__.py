"""The learner: GRPO on LoRA, one optimizer step at a time, on one process or under torchrun.

  learner.py      `Learner`: model + LoRA, micro-batched steps under a token budget, its version counter
  loss.py         the GRPO loss variants (grpo, dr_grpo, dapo), advantages, the global step normaliser
  loss_config.py  `LossConfig`: the loss's settings, shared with the run's config
  corrections.py  off-policy corrections against the volunteers' sampling log-probs
  ddp.py          `DistributedLearner` / `ShardedLearner` (torch DDP, FSDP2) and the rank-0 broadcast
  ddp_check.py    a self-check that 1 and N ranks compute the same step (run under torchrun)

Imports nothing else of coordinator/: it knows groups of rows, not where they came from.
"""
