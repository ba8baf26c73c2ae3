"""Benchmarks (one runnable script each, `--json-out PATH`) and the model-free lab peers they share.

Not installed with the package: `swarmlab.py` (lightweight publisher/follower processes over the real
transport) and `synthetic_adapter.py` (a Qwen2.5-1.5B-shaped LoRA that evolves like AdamW) are
fixtures for benchmarks and tests, run from a checkout (`python -m bench.swarmlab ...`).
Results and how to read them: docs/benchmarks.md.
"""
