"""A tiny Qwen2-style model and character tokenizer, built in code and saved as an ordinary
Hugging Face directory.

Why: nothing can be downloaded at run time on CI or the dev machines, yet the loading path must be
the one real users take (`--model Qwen/Qwen2.5-0.5B-Instruct`). So tests and the demo write this
model to disk once and then load it with exactly the same `AutoModelForCausalLM.from_pretrained` /
`AutoTokenizer.from_pretrained` calls as any hub model.

Shape choices: head_dim 64 (vLLM's CPU attention rejects 16), 2 layers, hidden 128, a ~64-token
character vocabulary; random weights (initializer_range 0.02 keeps the initial policy close to
uniform, which the toy task relies on: see docs/toy-task.md).

`instruct=True` writes the same weights with Qwen2.5-Instruct's special-token layout: `<|im_start|>` /
`<|im_end|>` added, the tokenizer's eos is `<|im_end|>`, generation_config.eos_token_id is the *set*
[<|im_end|>, <|endoftext|>], and a ChatML chat template (spaces for newlines: the toy vocabulary has
no "\n"). Tests use it wherever two stop tokens or a chat template matter.

The volunteer and the coordinator each build it locally; the content hash (models/pinning.py) is its
revision, so a copy built differently (another torch or transformers version) is refused.

    python -m asyncrl.models.tinymodel /tmp/tiny [--instruct]   # writes config, weights, tokenizer
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

TINY_MODEL_NAME = "asyncrl/tiny-qwen2"
EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
# Printable characters the toy tasks and prompts use; order fixes token ids.
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 =+-*/:?.,!#()[]<>_'\"|"
MARKER = ".asyncrl-tiny-complete"
EMBED_STD = 0.05
# Bump when anything above changes what write_tiny_model produces: stale caches are rebuilt.
TINY_FORMAT = 2


def build_tokenizer(instruct: bool = False):
    """Character-level fast tokenizer (BPE with no merges == one token per character)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        padding_side="left",
        model_max_length=256,
    )
    if instruct:
        tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
        tokenizer.eos_token = IM_END
        tokenizer.chat_template = CHATML
    return tokenizer


def build_config(vocab_size: int):
    from transformers import Qwen2Config

    # Round the vocabulary up to a multiple of 64, as real checkpoints do (kernels like it).
    padded_vocab = ((vocab_size + 63) // 64) * 64
    return Qwen2Config(
        vocab_size=padded_vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        dtype="float32",
    )


def write_tiny_model(path: str | os.PathLike, *, seed: int = 0, instruct: bool = False) -> Path:
    """Write the tiny model to `path` (idempotent: an already complete directory is kept)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    marker = {"name": TINY_MODEL_NAME, "seed": seed, "format": TINY_FORMAT, "instruct": instruct}
    if (path / MARKER).exists():
        try:
            if json.loads((path / MARKER).read_text()) == marker:
                return path
        except ValueError:
            pass
        (path / MARKER).unlink()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(instruct)
    config = build_config(len(tokenizer))  # same padded size (64) either way: identical weights
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Larger (tied) embeddings than initializer_range gives: with std 0.02 the logit range a
        # unit-RMS hidden state can reach is about +-2.5, too flat for any policy to become sharp
        # when only LoRA (not the embeddings) may change. See docs/toy-task.md.
        model.get_input_embeddings().weight.normal_(0.0, EMBED_STD)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if instruct:  # as Qwen2.5-Instruct: config.json's eos is <|im_end|>, the generation config stops on both
        model.config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / MARKER).write_text(json.dumps(marker))
    return path


def default_tiny_model_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "asyncrl" / "tiny-qwen2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", default=str(default_tiny_model_dir()))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--instruct", action="store_true", help="Qwen2.5-Instruct special tokens and stop set")
    args = parser.parse_args()
    print(write_tiny_model(args.path, seed=args.seed, instruct=args.instruct))


if __name__ == "__main__":
    main()

