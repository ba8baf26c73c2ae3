"""Start-up cross-checks: the batch bound is never below a real full batch, and a config whose full batch
cannot fit max_batch_bytes (or whose model leaves no room for a prompt) stops with PreflightError."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.coordinator.config import CoordinatorConfig
from asyncrl.coordinator.leasing import preflight
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity


def full_batch(groups: int, group_size: int, max_new_tokens: int, prompt_tokens: int) -> messages.RolloutBatch:
    """Every completion at max_new_tokens, ids near the vocabulary's top, names at their longest."""
    rng = np.random.default_rng(0)
    name = "v" * 128

    def comp():
        return messages.Completion(token_ids=rng.integers(100_000, 151_936, max_new_tokens, dtype="<i4").tobytes(),
                                   logprobs=(-rng.random(max_new_tokens, dtype=np.float32) * 9).astype("<f4").tobytes(),
                                   reward=-12345.678, finish_reason="length")

    gs = tuple(messages.RolloutGroup(lease_id=f"{i}-" + "f" * 120, prompt_id=f"p-{i}-" + "x" * 200,
                                     prompt_token_ids=rng.integers(0, 151_936, prompt_tokens, dtype="<i4").tobytes(),
                                     completions=tuple(comp() for _ in range(group_size))) for i in range(groups))
    return messages.RolloutBatch(run_id=name, adapter_version=123456, client_name=name, groups=gs,
                                 generated_at=1.7e9, sampling=messages.SamplingParams(temperature=0.7, top_p=0.95,
                                                                                      top_k=50, max_new_tokens=max_new_tokens))


@pytest.mark.parametrize("groups,group_size,max_new_tokens,prompt_tokens", [(1, 1, 1, 1), (4, 8, 1024, 300), (2, 16, 256, 2000)])
def test_bound_covers_a_real_sealed_full_batch(groups, group_size, max_new_tokens, prompt_tokens):
    sealed = envelope.seal(Identity.generate(), "rollout_batch",
                           messages.encode(full_batch(groups, group_size, max_new_tokens, prompt_tokens)),
                           audience=Identity.generate().public_key)
    bound = preflight.sealed_batch_bytes(prompts_per_lease=groups, group_size=group_size,
                                         max_new_tokens=max_new_tokens, prompt_tokens=prompt_tokens)
    assert len(sealed) <= bound <= len(sealed) + 4096 + 64 * groups * group_size  # tight, never short


def test_a_full_batch_that_cannot_fit_stops_the_start():
    cfg = CoordinatorConfig(prompts_per_lease=4, group_size=16, max_new_tokens=16384, max_batch_bytes=8 << 20)
    with pytest.raises(preflight.PreflightError):  # 4 x 16 x 16384 x 8 bytes = 8 MiB before any prompt
        preflight.check_batch_fits(cfg, longest_prompt_tokens=8000)
    fits = CoordinatorConfig(prompts_per_lease=2, group_size=8, max_new_tokens=1024)
    assert preflight.check_batch_fits(fits, longest_prompt_tokens=512) <= fits.max_batch_bytes


class ModelConfig:
    max_position_embeddings = 2048


def test_prompt_budget_is_context_minus_max_new_tokens():
    assert preflight.prompt_budget(ModelConfig(), 512) == 1536
    with pytest.raises(preflight.PreflightError):
        preflight.prompt_budget(ModelConfig(), 2048)


def test_the_manifest_context_is_the_longest_prompt_plus_max_new_tokens_when_the_task_says():
    from asyncrl.tasks.prompt import Prompt
    from asyncrl.tasks.sources import BuiltinSource, RecordsSource, SourceReport

    records = [Prompt("a", "short", "1", "exact"), Prompt("b", "longer prompt", "2", "math")]
    source = RecordsSource("t", records, seed=0)
    source.report = SourceReport(records=2, longest_prompt_tokens=37)
    assert preflight.context_needed(source, 256) == 37 + 256
    # a multi-turn environment's context grows turn by turn: not said, the volunteer keeps the model's limit
    episodes = RecordsSource("e", records + [Prompt("c", "play", "", "env:echo")], seed=0)
    episodes.report = SourceReport(records=3, longest_prompt_tokens=37)
    assert preflight.context_needed(episodes, 256) == 0
    assert preflight.context_needed(BuiltinSource("repeat", 0), 256) == 0  # toys are not checked whole
