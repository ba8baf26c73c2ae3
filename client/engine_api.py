"""What every generation engine is: the `Engine` interface, the `Sample` it returns, and `EngineUnavailable`.

`Engine.generate(prompts, group_size, sampling)` returns, per prompt, `group_size` samples with the
per-token log-probabilities *of the distribution that was sampled from* (after repetition penalty,
temperature, min-p, top-k and top-p: models/sampling.py) — the behaviour policy the learner corrects against.
`Engine.load_adapter(version, specs, blobs)` hot-swaps the LoRA adapter for a new version.

Implementations: `TransformersEngine` (client/engine.py, which also picks the engine: `make_engine`) and
`VLLMEngine` (client/engine_vllm.py). Both import this module and neither imports the other's, so the
interface loads without torch. Imports: asyncrl.protocol only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from asyncrl.protocol.messages import SamplingParams


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (ends with a stop token) or "length" (protocol.messages.derive_finish_reason)


class Engine(Protocol):
    name: str

    def load_adapter(self, version: int, specs, blobs: dict[str, bytes]) -> None: ...

    def generate(self, prompts: Sequence[list[int]], group_size: int,
                 sampling: SamplingParams) -> list[list[Sample]]: ...


class EngineUnavailable(RuntimeError):
    """The requested engine cannot run here (the message says why and what to do)."""
