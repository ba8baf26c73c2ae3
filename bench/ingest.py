"""Ingest benchmark: signed rollout batches verified, decoded and re-scored per second on one core (issue 16).

    .venv/bin/python bench/ingest.py --json-out runs/bench/ingest.json

Why: at 10,000 volunteers each submitting a batch every 30 s the coordinator must take ~333 batches/s;
the goal is >= 300 per core. Shapes are real: 8 groups x 8 completions x 512 tokens per batch, token
ids from a 151,936-token vocabulary, `exact` reward. The tokenizer is built in code (no download): a
byte-level BPE with Qwen2.5's vocabulary size, 151,643 synthetic multi-byte tokens plus specials, and
Qwen's byte-level decoder — so `decode` does the work a real Qwen tokenizer does per token.

What is timed, all on this process's single thread (tokenizers' Rayon pool pinned to 1 thread, torch
not involved), in CPU seconds (`time.process_time`):
  signature   envelope.open_envelope: size, magic, Ed25519 over the exact bytes, audience, timestamp
  decode      messages.decode_rollout_batch: strict msgspec decode + shape/range validation
  scoring     coordinator.ingest.ingest.rescore_group for every group: prompt tokens compared with the lease's,
              finish reasons re-derived against the pinned stop set (Qwen's <|endoftext|>, <|im_end|>),
              every `exact` reward recomputed (decoding the completions whose printable-character lower
              bound allows a match: tasks.PrintableTable), the verified arrays handed on as TrainGroups
  end_to_end  the real Ingest.handle (replay guard, batch ids, leases peeked and completed, the three
              above, the learner queue), access control open, no journal, no generation audit
Each stage runs over the same pre-generated batches; `batches_per_s` = end-to-end batches per CPU second.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one core: the tokenizers' thread pool too
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from asyncrl.protocol import envelope, messages  # noqa: E402
from asyncrl.protocol.identity import Identity  # noqa: E402

from bench.results import provenance, write_result  # noqa: E402

VOCAB = 151_936


def qwen_sized_tokenizer(vocab_size: int = VOCAB, seed: int = 0):
    """A byte-level BPE tokenizer with `vocab_size` entries (Qwen2.5's count), synthetic multi-byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    rng = random.Random(seed)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    letters = [c for c in sorted(alphabet) if c.isalpha()] or sorted(alphabet)
    while len(vocab) < vocab_size - len(specials):
        token = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        vocab.setdefault(token, len(vocab))
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": specials[1:]})
    return fast


def make_batches(n: int, *, groups: int, completions: int, tokens: int, tokenizer, board, volunteer: Identity,
                 coordinator: Identity, run_id: str, sampling, seed: int = 0) -> list[bytes]:
    from asyncrl import tasks
    from asyncrl.tasks.sources import encode_prompt

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        leases = board.lease(volunteer.public_key, groups)
        for lease in leases:  # as the LeaseDesk grants it (coordinator/leasing/leasing.py)
            lease.prompt_token_ids = np.asarray(encode_prompt(tokenizer, lease.prompt.text), dtype="<i4").tobytes()
        gs = []
        for lease in leases:
            comps = []
            for _ in range(completions):
                ids = rng.integers(0, VOCAB - 3, size=tokens, dtype=np.int64).astype("<i4")
                text = tokenizer.decode(ids.tolist(), skip_special_tokens=True)
                comps.append(messages.Completion(
                    token_ids=ids.tobytes(), logprobs=(-rng.exponential(1.0, size=tokens)).astype("<f4").tobytes(),
                    reward=tasks.score(lease.prompt.reward, text, lease.prompt.answer), finish_reason="length"))
            gs.append(messages.RolloutGroup(lease_id=lease.lease_id, prompt_id=lease.prompt.prompt_id,
                                            prompt_token_ids=lease.prompt_token_ids, completions=tuple(comps)))
        batch = messages.RolloutBatch(run_id=run_id, adapter_version=0, client_name="bench", sampling=sampling,
                                      groups=tuple(gs), generated_at=time.time())
        out.append(envelope.seal(volunteer, "rollout_batch", messages.encode(batch), audience=coordinator.public_key))
    return out


class Prompts:
    """An endless source of short `exact`-reward prompts (like a math dataset's)."""

    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        from asyncrl.tasks import Prompt

        self.i += 1
        return Prompt(prompt_id=f"p{self.i}", text=f"What is {self.i} + {self.i * 7}? Answer with the number.",
                      answer=str(self.i * 8), reward="exact")


def cpu(fn, items) -> float:
    t0 = time.process_time()
    for item in items:
        fn(item)
    return time.process_time() - t0


def run(args) -> dict:
    from asyncrl.coordinator.ingest.ingest import Ingest, rescore_group
    from asyncrl.coordinator.leasing.taskboard import TaskBoard

    tokenizer = qwen_sized_tokenizer()
    coordinator, volunteer = Identity.generate(), Identity.generate()
    sampling = messages.SamplingParams(temperature=1.0, max_new_tokens=args.tokens)
    max_bytes = 32 << 20
    stops = tuple(tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"]))  # as models/pinning.py pins Qwen's
    rounds = []
    for r in range(args.rounds):
        board = TaskBoard(Prompts(), lease_timeout_s=3600, max_leases_per_client=1 << 30)
        sealed = make_batches(args.batches, groups=args.groups, completions=args.completions, tokens=args.tokens,
                              tokenizer=tokenizer, board=board, volunteer=volunteer, coordinator=coordinator,
                              run_id="bench", sampling=sampling, seed=r)
        opened = [envelope.open_envelope(s, max_bytes=max_bytes, expected_kind="rollout_batch",
                                         expected_audience=coordinator.public_key, window_s=3600) for s in sealed]
        decoded = [messages.decode_rollout_batch(o.payload, max_bytes=max_bytes, vocab_size=VOCAB) for o in opened]
        leases = [[board.peek(g.lease_id, volunteer.public_key) for g in b.groups] for b in decoded]
        t_table = time.process_time()
        ingest = Ingest(identity_public_key=coordinator.public_key, run_id="bench", board=board, tokenizer=tokenizer,
                        vocab_size=VOCAB, current_version=lambda: 0, max_batch_bytes=max_bytes, window_s=3600,
                        queue_groups=args.batches * args.groups + 1, sampling=sampling, stop_token_ids=stops)
        t_table = time.process_time() - t_table  # once per coordinator start: the tokenizer's printable table
        t_sig = cpu(lambda s: envelope.open_envelope(s, max_bytes=max_bytes, expected_kind="rollout_batch",
                                                     expected_audience=coordinator.public_key, window_s=3600), sealed)
        t_dec = cpu(lambda o: messages.decode_rollout_batch(o.payload, max_bytes=max_bytes, vocab_size=VOCAB), opened)
        t_score = cpu(lambda bl: [rescore_group(tokenizer, g, lease, bl[0], ingest.bounds, stop_token_ids=stops)
                                  for g, lease in zip(bl[0].groups, bl[1])], list(zip(decoded, leases)))
        t_decode_text = cpu(lambda bl: [rescore_group(tokenizer, g, lease, bl[0], stop_token_ids=stops)
                                        for g, lease in zip(bl[0].groups, bl[1])],
                            list(zip(decoded, leases))[:max(1, len(decoded) // 10)]) / max(1, len(decoded) // 10)
        t0 = time.perf_counter()
        t_all = cpu(lambda s: _accept(ingest, s), sealed)
        wall = time.perf_counter() - t0
        rounds.append({"signature_s": t_sig, "decode_s": t_dec, "scoring_s": t_score, "end_to_end_s": t_all,
                       "wall_s": wall, "batches": len(sealed), "table_build_s": round(t_table, 3),
                       "scoring_with_full_decode_ms_per_batch": round(1e3 * t_decode_text, 3),
                       "bounds": ingest.bounds is not None})
        print(f"round {r}: {len(sealed) / t_all:7.1f} batches/CPU-s end to end "
              f"(signature {1e3 * t_sig / len(sealed):.2f} ms, decode {1e3 * t_dec / len(sealed):.2f} ms, "
              f"scoring {1e3 * t_score / len(sealed):.2f} ms per batch)", flush=True)
    per = lambda key: [1e3 * r[key] / r["batches"] for r in rounds]  # noqa: E731
    rates = [r["batches"] / r["end_to_end_s"] for r in rounds]
    e2e = statistics.median(per("end_to_end_s"))
    parts = {k: statistics.median(per(f"{k}_s")) for k in ("signature", "decode", "scoring")}
    return {
        "batches_per_s": round(statistics.median(rates), 1),
        "batches_per_s_min": round(min(rates), 1), "batches_per_s_max": round(max(rates), 1),
        "ms_per_batch": {"end_to_end": round(e2e, 3), **{k: round(v, 3) for k, v in parts.items()},
                         "rest": round(e2e - sum(parts.values()), 3)},
        "share": {k: round(v / e2e, 3) for k, v in parts.items()},
        "shape": {"groups": args.groups, "completions_per_group": args.completions, "tokens": args.tokens,
                  "vocab": VOCAB, "reward": "exact", "payload_bytes": len(messages.encode(decoded[0]))},
        "rounds": rounds,
        **provenance(),
    }


def _accept(ingest, sealed: bytes) -> None:
    ack = ingest.handle(sealed, peer="bench")
    if not ack.accepted:
        raise RuntimeError(f"the benchmark's own batch was refused: {ack.code} {ack.detail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=300, help="batches per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--completions", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    result = run(args)
    write_result(args.json_out, result)
    print(json.dumps({k: result[k] for k in ("batches_per_s", "batches_per_s_min", "batches_per_s_max", "ms_per_batch",
                                             "share")}, indent=2))
    print("target (>= 300 batches/s per core):", "met" if result["batches_per_s"] >= 300 else "MISSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
