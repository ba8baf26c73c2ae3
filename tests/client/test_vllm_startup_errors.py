"""vLLM start-up failures become one line with the fix (client/engine_vllm.py `explain_startup_failure`), read
from the very texts vLLM raises: vllm/v1/worker/utils.py (free memory below the requested utilization),
vllm/v1/core/kv_cache_utils.py (no KV cache memory at all; not enough for one max-length request),
vllm/lora/peft_helper.py (adapter rank above max_lora_rank), vllm/v1/engine/utils.py (the engine process died;
its reason only in the log). The texts below are those f-strings filled in as vLLM fills them."""

from __future__ import annotations

import pytest

from asyncrl.client.engine_vllm import _lora_rank_bucket, explain_startup_failure

FREE_MEMORY = ("Free memory on device cuda:0 (5.12/79.19 GiB) on startup is less than desired GPU memory utilization "
               "(0.85, 67.31 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")
NO_CACHE = ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the "
            "engine (this flag also controls CPU memory reservation on the CPU backend, despite its name). See "
            "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")
KV_TOO_SMALL = ("To serve at least one request with the model's max seq len (32768), (1.75 GiB KV cache is needed, "
                "which is larger than the available KV cache memory (0.94 GiB). Based on the available memory, the "
                "estimated maximum model length is 17536. Try increasing `gpu_memory_utilization` (which also controls "
                "CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See "
                "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")
RANK = "LoRA rank 64 is greater than max_lora_rank 16."
CORE_DIED = "Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': 1}"


@pytest.mark.parametrize("text, must", [
    (FREE_MEMORY, ["5.12 GiB free of 79.19", "--gpu-memory-utilization 0.85", "67.31", "lower it"]),
    (NO_CACHE, ["no memory for a KV cache", "--gpu-memory-utilization 0.9", "raise it"]),
    (KV_TOO_SMALL, ["32768-token context", "1.75 GiB", "0.94 GiB", "--max-model-len 17536"]),
    (RANK, ["LoRA rank 64", "max_lora_rank 16", "--engine transformers"]),
    (CORE_DIED, ["failed to start", "log lines above", "--engine transformers"]),
])
def test_each_vllm_start_up_failure_reads_as_one_line_with_its_fix(text, must):
    hint = explain_startup_failure(ValueError(text), 0.9)
    assert hint is not None and "\n" not in hint
    for part in must:
        assert part in hint, (part, hint)


def test_the_cause_is_found_under_a_wrapping_exception_and_unknown_failures_pass_through():
    try:
        try:
            raise ValueError(KV_TOO_SMALL)
        except ValueError as inner:
            raise RuntimeError("engine start failed") from inner
    except RuntimeError as outer:
        assert "--max-model-len 17536" in explain_startup_failure(outer, 0.9)
    assert explain_startup_failure(RuntimeError("CUDA error: an illegal memory access"), 0.9) is None


def test_a_rank_above_what_vllm_serves_is_refused_before_vllm_starts_with_the_same_fix():
    with pytest.raises(ValueError) as caught:
        _lora_rank_bucket(1024)
    assert "--engine transformers" in explain_startup_failure(caught.value, 0.9)
    assert _lora_rank_bucket(16) == 16 and _lora_rank_bucket(17) == 32
