"""asyncrl.models — the base model and its LoRA adapter, as both sides load them.

  lora.py       loading a base model (`from_pretrained`, hub id or local directory) in a dtype onto a
                device (`resolve_placement`: --device / --dtype), attaching LoRA, adapter <-> bytes in
                the published dtype, PEFT directories for vLLM
  logprobs.py   completion log-probs and entropies through a chunked LM head (no [B, T, V] fp32 logits):
                `CompletionScorer`, shared by the learner, the KL reference pass and the audit
  sampling.py   the sampling knobs' logit processing (repetition penalty, min-p, top-k, top-p in vLLM's
                order): the transformers engine samples with it, the scorer scores with it
  pinning.py    the base model pinned to an immutable revision (hub commit / content hash), tokenizer and
                stop-set hashes; the volunteer's verification and its PinCodes
  sources.py    where a pinned base's files come from (tiny, local directory, hub id, GGUF): the coordinator's
                `resolve` and a volunteer's `locate`
  gguf.py       GGUF files as a base (`--model PATH.gguf`, `smollm2-135m-instruct`): converted once to a
                Hugging Face directory cached by the GGUF's sha256, pinned by that hash plus the conversion's
  tinymodel.py  the built-in tiny Qwen2-style model, written as an ordinary HF directory (tests, demo);
                `instruct=True` gives it Qwen2.5-Instruct's two stop tokens and a ChatML template

Imports only `asyncrl.protocol` of ours; the coordinator (training, export) and the client
(generation) both build on it.
"""
