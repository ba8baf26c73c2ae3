"""asyncrl.models — the base model and its LoRA adapter, as both sides load them.

  lora.py       loading a base model (`from_pretrained`, hub id or local directory), attaching LoRA,
                adapter <-> bytes in the published dtype, PEFT directories for vLLM
  tinymodel.py  the built-in tiny Qwen2-style model, written as an ordinary HF directory (tests, demo)

Imports only `asyncrl.protocol` of ours; the coordinator (training, export) and the client
(generation) both build on it.
"""
