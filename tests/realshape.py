"""A random Qwen2-shaped model at a real vocabulary size, built in code and saved as an ordinary Hugging
Face directory (nothing is downloaded; `--model <dir>` loads it through the same code as a hub model).

Tokenizer: byte-level BPE over the 256 byte symbols (any text encodes, as with Qwen's), ChatML specials
and a chat template in Qwen2.5's shape (`<|im_start|>role\\n...<|im_end|>`), padded with plain tokens to
`vocab_size` (default 32,768), so sampling from the random model draws from a real-sized vocabulary.
Stop tokens: `<|im_end|>` (the template's end of turn) and `<|endoftext|>`, as Qwen2.5-Instruct.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "{% if not (loop.last and m['role'] == 'assistant' and not add_generation_prompt) %}<|im_end|>\n"
                 "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_tokenizer(vocab_size: int = 32768, context: int = 32768):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {sym: i for i, sym in enumerate(sorted(alphabet))}
    for i in range(vocab_size - len(vocab) - len(SPECIALS)):  # plain filler tokens, reachable only by sampling
        vocab[f"w{i:05d}"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=context)
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) == vocab_size
    return fast


def build_config(vocab_size: int = 32768, context: int = 32768):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=context,
                       rope_theta=1e6, tie_word_embeddings=True, initializer_range=0.02, dtype="float32",
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def write_model(path: Path, *, vocab_size: int = 32768, context: int = 32768, seed: int = 0) -> Path:
    """Weights, config, generation config (both stop tokens) and tokenizer in `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer(vocab_size, context)
    config = build_config(vocab_size, context)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config.eos_token_id, config.pad_token_id = stops[0], stops[1]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = stops
    model.generation_config.pad_token_id = stops[1]
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    json.loads((path / "config.json").read_text())  # written and readable
    return path
