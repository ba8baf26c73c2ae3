"""The transformers engine's GPU path, checked on CPU: the prefill computes the LM head at the last position
only (`logits_to_keep=1`), so its logits are [rows, 1, vocab] whatever the prompt length — at Qwen2.5's
151,936-token vocabulary, 64 rows x 300 prompt tokens would otherwise be ~6 GB of bf16 logits — and the
engine picks and names its engine and dtype (`choose_engine`)."""

from __future__ import annotations

import torch

from asyncrl.client.engine import TransformersEngine, choose_engine, cpu_has_bf16_units
from asyncrl.protocol.messages import LoraSpec, SamplingParams

QWEN_VOCAB = 151_936


class LogitShapes:
    """A forward hook on the LM head: the shape of every logits tensor it produced."""

    def __init__(self, head: torch.nn.Module):
        self.shapes: list[tuple[int, ...]] = []
        head.register_forward_hook(lambda module, args, output: self.shapes.append(tuple(output.shape)))


def wide_vocab_model(path):
    """A 1-layer Qwen2 with Qwen2.5's vocabulary (random weights) and the tiny tokenizer's files."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from asyncrl.models.tinymodel import build_tokenizer

    cfg = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def test_prefill_keeps_one_position_of_logits_flat_in_prompt_length(tmp_path):
    engine = TransformersEngine(wide_vocab_model(tmp_path / "m"), LoraSpec(r=4, alpha=8.0, dropout=0.0,
                                target_modules=("q_proj", "v_proj")), stop_token_ids=[0], seed=0)
    shapes = LogitShapes(engine.model.get_base_model().lm_head)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3)
    per_prompt_len = {}
    for prompt_len in (8, 96):
        shapes.shapes.clear()
        groups = engine.generate([[5] * prompt_len, [7] * (prompt_len // 2)], 4, sampling)
        assert [len(g) for g in groups] == [4, 4]
        per_prompt_len[prompt_len] = list(shapes.shapes)
    for prompt_len, seen in per_prompt_len.items():
        assert seen[0] == (8, 1, QWEN_VOCAB), (prompt_len, seen[0])  # the prefill: 8 rows, one position
        assert all(s == (8, 1, QWEN_VOCAB) for s in seen)
    # the largest logits tensor (bytes) is the same at 8 and at 96 prompt tokens
    assert max(map(_numel, per_prompt_len[8])) == max(map(_numel, per_prompt_len[96]))


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_auto_names_its_choice_and_takes_fp32_on_a_cpu_without_bf16_units():
    kind, dtype, why = choose_engine("auto")
    assert kind == "transformers" and "vLLM not used" in why  # no CUDA device here
    assert dtype == (torch.bfloat16 if cpu_has_bf16_units() else torch.float32)
    assert ("no bf16 units" in why) != cpu_has_bf16_units()
    assert choose_engine("transformers")[0] == "transformers"
    assert choose_engine("vllm")[:2] == ("vllm", None)
