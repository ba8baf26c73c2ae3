"""The transformers engine stops on the published stop *set* (Qwen2.5-Instruct layout: <|im_end|> and
<|endoftext|>), keeps the stop token as the last token, and reports finish_reason by the shared rule.
The vLLM engine is held to the same rule in tests/client/test_engine_vllm.py."""

from __future__ import annotations

import collections

import pytest

from asyncrl.client.engine import TransformersEngine
from asyncrl.models.tinymodel import write_tiny_model
from asyncrl.protocol.messages import LoraSpec, SamplingParams, derive_finish_reason

LORA = LoraSpec(r=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj"))
# The random tiny model mostly repeats its last token, so greedy decoding after a stop token stops at once
# and after a letter runs to the length limit: every ending, deterministically.
STOP_PROMPTS = ["hi<|im_end|>", "hi<|endoftext|>", "rep:a="]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("stop") / "tiny-instruct", instruct=True)
    return TransformersEngine(str(path), LORA, seed=3)


def test_stop_set_is_read_from_generation_config_and_tokenizer(engine):
    tok = engine.tokenizer
    assert engine.stop_token_ids == tuple(sorted([tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]))
    assert tok.eos_token == "<|im_end|>"  # the tokenizer alone knows only one of them


def test_greedy_stops_on_each_stop_token(engine):
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in STOP_PROMPTS]
    got = [g[0] for g in engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=12))]
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert [(s.token_ids, s.finish_reason) for s in got[:2]] == [([im_end], "stop"), ([eot], "stop")]
    assert got[2].finish_reason == "length" and len(got[2].token_ids) == 12


def test_sampled_completions_follow_the_rule_and_end_on_both_stop_tokens(engine):
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in ("rep:a=", "abc", "12+34=")]
    endings = collections.Counter()
    for prompt, group in zip(prompts, engine.generate(prompts, 16, SamplingParams(max_new_tokens=24))):
        for s in group:
            assert not set(s.token_ids[:-1]) & set(engine.stop_token_ids)
            assert s.finish_reason == derive_finish_reason(s.token_ids, engine.stop_token_ids, max_new_tokens=24)
            endings[s.token_ids[-1] if s.finish_reason == "stop" else "length"] += 1
    assert set(engine.stop_token_ids) <= set(endings) and endings["length"] > 0, endings
