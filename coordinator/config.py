"""The coordinator's one config object. Every limit is a named, documented, validated field.

The resolved config is written to `<run_dir>/config.json` at start.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.coordinator.loss import LossConfig

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ConfigError(ValueError):
    pass


@dataclass
class CoordinatorConfig:
    run_id: str = "demo"
    """Names the swarm: DHT keys and stream handlers are scoped by it."""
    model: str = "tiny"
    """A Hugging Face model id or local directory; "tiny" builds the built-in test model."""
    model_revision: str = "main"
    run_dir: str = "runs/demo"
    task: str = "repeat"
    seed: int = 0

    # policy / LoRA
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    publish_dtype: str = "bf16"
    """dtype of published adapters (what volunteers serve with): bf16, fp16 or fp32."""

    # learner
    lr: float = 2e-3
    max_steps: int = 150
    """Stop after this many optimizer steps (0 = run until interrupted)."""
    groups_per_step: int = 8
    """Step as soon as this many prompt groups are queued..."""
    min_groups: int = 2
    max_wait_s: float = 5.0
    """...or after max_wait_s with at least min_groups."""
    publish_every: int = 1
    """Publish a new adapter version every this many optimizer steps."""
    max_staleness: int | None = 4
    """Drop batches generated with an adapter more than this many versions old (None = unlimited)."""
    keyframe_every: int = 10
    loss: LossConfig = field(default_factory=LossConfig)

    # rollouts
    group_size: int = 16
    prompts_per_lease: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    lease_timeout_s: float = 60.0
    max_inflight_groups: int = 16
    """Back-pressure: stop granting leases while leased-but-unreturned plus queued-but-untrained groups
    reach this. Keeps volunteers from racing ahead of the learner (whose backlog would only go stale);
    ~2x groups_per_step keeps the learner fed without building a queue."""
    max_leases_per_client: int = 8

    # network
    host: str = "127.0.0.1"
    port: int = 0
    """TCP port for libp2p (0 = any free port)."""
    announce: tuple[str, ...] = ()
    """Multiaddrs to announce instead of the listen addresses (public IP behind NAT / port forward)."""
    max_batch_bytes: int = 8 * 1024 * 1024
    timestamp_window_s: float = 300.0
    chunk_bytes: int = 1024 * 1024

    def validate(self) -> "CoordinatorConfig":
        checks = [
            (self.lora_r >= 1, "lora_r must be >= 1"),
            (self.publish_dtype in ("bf16", "fp16", "fp32"), "publish_dtype must be bf16, fp16 or fp32"),
            (self.lr > 0, "lr must be > 0"),
            (self.max_steps >= 0, "max_steps must be >= 0"),
            (1 <= self.min_groups <= self.groups_per_step, "need 1 <= min_groups <= groups_per_step"),
            (self.max_wait_s > 0, "max_wait_s must be > 0"),
            (self.publish_every >= 1, "publish_every must be >= 1"),
            (self.max_staleness is None or self.max_staleness >= 0, "max_staleness must be >= 0 or None"),
            (self.keyframe_every >= 1, "keyframe_every must be >= 1"),
            (2 <= self.group_size <= 64, "group_size must be in [2, 64] (GRPO needs a group)"),
            (1 <= self.prompts_per_lease <= 64, "prompts_per_lease must be in [1, 64]"),
            (1 <= self.max_new_tokens <= 32768, "max_new_tokens must be in [1, 32768]"),
            (self.temperature > 0, "temperature must be > 0"),
            (self.lease_timeout_s > 0, "lease_timeout_s must be > 0"),
            (self.max_inflight_groups >= self.groups_per_step, "max_inflight_groups must be >= groups_per_step"),
            (self.max_leases_per_client >= self.prompts_per_lease, "max_leases_per_client must be >= prompts_per_lease"),
            (0 <= self.port <= 65535, "port must be in [0, 65535]"),
            (1024 <= self.max_batch_bytes <= 256 * 1024 * 1024, "max_batch_bytes must be in [1 KiB, 256 MiB]"),
            (4096 <= self.chunk_bytes <= 4 * 1024 * 1024, "chunk_bytes must be in [4 KiB, 4 MiB]"),
            (self.run_id.replace("-", "").replace("_", "").isalnum(), "run_id may hold letters, digits, - and _"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        return self

    def to_json(self) -> str:
        def default(o: Any):
            if dataclasses.is_dataclass(o):
                return dataclasses.asdict(o)
            raise TypeError(type(o))

        return json.dumps(dataclasses.asdict(self), indent=2, default=default)

    def write(self, run_dir: Path) -> None:
        tmp = run_dir / "config.json.tmp"
        tmp.write_text(self.to_json())
        tmp.replace(run_dir / "config.json")
