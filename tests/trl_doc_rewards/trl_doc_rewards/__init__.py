"""TRL's documented custom reward functions, copied verbatim from TRL's docs (docs/source/grpo_trainer.md,
"Using a custom reward function", Examples 1-6), one module per example because several share the name
`reward_func`. Registered through the `asyncrl.rewards` entry points of the `trl-doc-rewards` distribution
next to this folder (put this folder on PYTHONPATH). tests/integration/test_trl_doc_rewards.py trains on them."""
