"""Adapter codec benchmark on a real LoRA + AdamW trajectory (CPU, a few minutes).

Trains a rank-16 LoRA (all linear layers: q,k,v,o,gate,up,down) with AdamW on a randomly initialised
Qwen2-shaped model built in code (nothing is downloaded), with ordinary next-token LM loss on
synthetic token sequences from a fixed random sparse Markov chain (a learnable objective, so the
updates are genuine Adam updates). Every optimizer step is published: LoRA weights cast to bf16 ->
raw bytes -> `AdapterEncoder` (keyframe every `--keyframe-every`, deltas in between), and a client
that follows the chain decodes every version and checks it bit for bit. Over steps
[--steps-from, --steps-to] it also measures, per step, `encode_keyframe` and `encode_delta` against
the previous step separately, plain zstd of the raw bytes at the same level (the in-run anchor),
and single-thread encode/decode times (best of --repeats runs per version).

    .venv/bin/python bench/codec.py --json-out /tmp/codec.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time

# Single-threaded numeric libraries for the codec timings (training sets torch's own thread count),
# and OpenMP workers that sleep instead of spinning after each training step (they would otherwise
# compete with the codec timings that follow it).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import zstandard as zstd  # noqa: E402

from asyncrl.protocol import codec  # noqa: E402
from asyncrl.protocol.codec import planes as codec_planes  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json-out", required=True, help="where to write the JSON report")
    p.add_argument("--steps-from", type=int, default=20)
    p.add_argument("--steps-to", type=int, default=40)
    p.add_argument("--lr", type=float, default=4e-5)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default: Qwen2.5-1.5B's 35/6 x hidden)")
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--level", type=int, default=codec.DEFAULT_LEVEL, help="zstd level (codec and plain anchor)")
    p.add_argument("--keyframe-every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="timing runs per version (best is kept)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for training")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strict", action="store_true", help="exit 1 if a target check fails")
    args = p.parse_args(argv)
    if args.alpha is None:
        args.alpha = 2.0 * args.rank
    if args.intermediate is None:
        args.intermediate = (args.hidden * 35 // 6 + 63) // 64 * 64
    if not 1 <= args.steps_from <= args.steps_to:
        p.error("need 1 <= --steps-from <= --steps-to")
    return args


def build(args):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(args.seed)
    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=2 if args.hidden // 64 % 2 == 0 else 1,
        head_dim=64,
        max_position_embeddings=max(512, args.seq),
        tie_word_embeddings=True,
        initializer_range=0.02,
    )
    model = get_peft_model(
        Qwen2ForCausalLM(cfg),
        LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=TARGETS),
    )
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in params], lr=args.lr)
    shape = {
        "arch": "Qwen2ForCausalLM (random init)",
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "layers": args.layers,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": 64,
        "vocab": args.vocab,
        "base_params": sum(p.numel() for n, p in model.named_parameters() if not p.requires_grad),
        "lora_params": sum(p.numel() for _, p in params),
    }
    return model, params, opt, shape


class MarkovData:
    """Token sequences from a fixed random sparse Markov chain (each token has 4 successors)."""

    def __init__(self, vocab: int, seed: int):
        import torch

        self.g = torch.Generator().manual_seed(seed + 1)
        self.succ = torch.randint(0, vocab, (vocab, 4), generator=self.g)
        self.vocab = vocab

    def batch(self, b: int, t: int):
        import torch

        x = torch.empty(b, t, dtype=torch.long)
        x[:, 0] = torch.randint(0, self.vocab, (b,), generator=self.g)
        for i in range(1, t):
            x[:, i] = self.succ[x[:, i - 1], torch.randint(0, 4, (b,), generator=self.g)]
        return x


def snapshot(params) -> dict[str, bytes]:
    import torch

    return {n: p.detach().to(torch.bfloat16).contiguous().view(torch.uint16).numpy().tobytes() for n, p in params}


def best_time(fn, repeats: int):
    """(best thread CPU seconds, best wall seconds, result) over `repeats` calls. The codec is
    single-threaded, so CPU time is its cost on one core even when the machine is shared."""
    cpu = wall = float("inf")
    out = None
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.thread_time()
        out = fn()
        cpu = min(cpu, time.thread_time() - c0)
        wall = min(wall, time.perf_counter() - w0)
    return cpu, wall, out


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    model, params, opt, shape = build(args)
    specs = [codec_spec(n, p) for n, p in params]
    raw = codec.raw_size(specs)
    data = MarkovData(args.vocab, args.seed)
    enc = codec.AdapterEncoder(keyframe_every=args.keyframe_every, level=args.level)
    plain = zstd.ZstdCompressor(level=args.level)
    cap = raw + 1

    lossless = True
    held = None  # what a client following the published chain holds
    prev = None
    rows, stream, losses = [], [], []
    kinds = ("enc_key", "enc_delta", "dec_key", "dec_delta", "enc_delta_numpy", "dec_delta_numpy")
    tot = {f"{k}_{c}": 0.0 for k in kinds for c in ("cpu", "wall")}
    kernels = codec_planes.KERNELS is not None  # protocol/codec/_kernels.c was built (setup.py)
    t_start = time.time()
    for step in range(args.steps_to + 1):
        if step > 0:
            x = data.batch(args.batch, args.seq)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        cur = snapshot(params)
        e = enc.encode(step, specs, cur)
        held = codec.decode(e.codec, specs, e.payload, held, max_raw_bytes=cap)
        lossless &= held == cur
        if args.steps_from <= step <= args.steps_to:
            stream.append({"step": step, "codec": e.codec, "ratio": len(e.payload) / raw})
            timed = {
                "enc_key": best_time(lambda: codec.encode_keyframe(specs, cur, level=args.level), 1),
                "enc_delta": best_time(lambda: codec.encode_delta(specs, cur, prev, level=args.level), 1),
            }
            key, delta = timed["enc_key"][2], timed["enc_delta"][2]
            nocx = codec.encode_delta(specs, cur, prev, level=args.level, max_classes=1)
            timed["dec_key"] = best_time(
                lambda: codec.decode(codec.KEYFRAME_CODEC, specs, key, None, max_raw_bytes=cap), args.repeats
            )
            timed["dec_delta"] = best_time(
                lambda: codec.decode(codec.DELTA_CODEC, specs, delta, prev, max_raw_bytes=cap), args.repeats
            )
            lossless &= timed["dec_key"][2] == cur and timed["dec_delta"][2] == cur
            if kernels:  # the numpy path on the same versions, same process: the kernels' speed-up as a ratio
                codec_planes.use_kernels(False)
                timed["enc_delta_numpy"] = best_time(
                    lambda: codec.encode_delta(specs, cur, prev, level=args.level), 1)
                timed["dec_delta_numpy"] = best_time(
                    lambda: codec.decode(codec.DELTA_CODEC, specs, delta, prev, max_raw_bytes=cap), args.repeats)
                codec_planes.use_kernels(True)
                lossless &= timed["enc_delta_numpy"][2] == delta and timed["dec_delta_numpy"][2] == cur
            lossless &= codec.decode(codec.DELTA_CODEC, specs, nocx, prev, max_raw_bytes=cap) == cur
            plain_len = len(plain.compress(b"".join(cur[s.name] for s in specs)))
            for k, (cpu, wall, _) in timed.items():
                tot[f"{k}_cpu"] += cpu
                tot[f"{k}_wall"] += wall
            info = codec.describe(delta)
            rows.append(
                {
                    "step": step,
                    "loss": losses[-1],
                    "plain_zstd_ratio": plain_len / raw,
                    "keyframe_ratio": len(key) / raw,
                    "delta_ratio": len(delta) / raw,
                    "delta_ratio_no_context": len(nocx) / raw,
                    "delta_classes": [len(s["classes"]) for g in info["groups"] for s in g["segments"]],
                    "decode_delta_ms": timed["dec_delta"][0] * 1e3,
                    "decode_keyframe_ms": timed["dec_key"][0] * 1e3,
                    "decode_delta_wall_ms": timed["dec_delta"][1] * 1e3,
                }
            )
        prev = cur
    wall = time.time() - t_start

    n = len(rows)
    mb = raw * n / 1e6

    def mean(k):
        return float(np.mean([r[k] for r in rows]))

    report = {
        "date": _dt.date.today().isoformat(),
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "raw_bytes": raw,
        "plain_zstd_ratio": mean("plain_zstd_ratio"),
        "keyframe_ratio": mean("keyframe_ratio"),
        "keyframe_vs_plain": mean("keyframe_ratio") / mean("plain_zstd_ratio"),
        "delta_ratio": mean("delta_ratio"),
        "delta_ratio_max": max(r["delta_ratio"] for r in rows),
        "delta_ratio_no_context": mean("delta_ratio_no_context"),
        "encode_MBps": mb / tot["enc_delta_cpu"],
        "encode_keyframe_MBps": mb / tot["enc_key_cpu"],
        "decode_MBps": min(mb / tot["dec_delta_cpu"], mb / tot["dec_key_cpu"]),
        "decode_delta_MBps": mb / tot["dec_delta_cpu"],
        "decode_keyframe_MBps": mb / tot["dec_key_cpu"],
        "kernels": "compiled" if kernels else "numpy (protocol/codec/_kernels.c not built)",
        "numpy_path": {
            "encode_MBps": mb / tot["enc_delta_numpy_cpu"],
            "decode_delta_MBps": mb / tot["dec_delta_numpy_cpu"],
            "encode_speedup": tot["enc_delta_numpy_cpu"] / tot["enc_delta_cpu"],
            "decode_speedup": tot["dec_delta_numpy_cpu"] / tot["dec_delta_cpu"],
            "same_bytes": "encode_delta payloads and decodes compared each version (in `lossless`)",
        } if kernels else None,
        "wall_clock": {
            "encode_MBps": mb / tot["enc_delta_wall"],
            "encode_keyframe_MBps": mb / tot["enc_key_wall"],
            "decode_delta_MBps": mb / tot["dec_delta_wall"],
            "decode_keyframe_MBps": mb / tot["dec_key_wall"],
            "load_avg_1m_at_end": os.getloadavg()[0],
        },
        "lossless": bool(lossless),
        "stream": {
            "keyframe_every": args.keyframe_every,
            "keyframes": sum(s["codec"] == codec.KEYFRAME_CODEC for s in stream),
            "deltas": sum(s["codec"] == codec.DELTA_CODEC for s in stream),
            "mean_ratio": float(np.mean([s["ratio"] for s in stream])),
        },
        "settings": {
            "model": shape,
            "objective": "next-token LM loss, synthetic sparse Markov chain tokens",
            "batch": args.batch,
            "seq": args.seq,
            "optimizer": "torch.optim.AdamW (default betas, weight_decay 0.01)",
            "lr": args.lr,
            "rank": args.rank,
            "alpha": args.alpha,
            "targets": TARGETS,
            "steps_from": args.steps_from,
            "steps_to": args.steps_to,
            "dtype": "bf16",
            "level": args.level,
            "codecs": [codec.KEYFRAME_CODEC, codec.DELTA_CODEC],
            "max_classes": codec.MAX_CLASSES,
            "zstd_version": ".".join(map(str, zstd.ZSTD_VERSION)),
            "python_zstandard": zstd.__version__,
            "numpy": np.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "timing": (
                f"single thread; *_MBps = raw bytes / thread CPU seconds (best of {args.repeats} decodes per "
                "version, encode timed once); wall_clock = the same with wall-clock seconds"
            ),
            "seed": args.seed,
            "wall_s": wall,
        },
        "loss_first_last": [losses[0], losses[-1]] if losses else None,
        "per_step": rows,
    }
    report["checks"] = {
        "lossless": report["lossless"],
        "delta_ratio<=0.30": report["delta_ratio"] <= 0.30,
        "delta_ratio<=0.25 (goal)": report["delta_ratio"] <= 0.25,
        "keyframe_ratio<=0.92*plain": report["keyframe_vs_plain"] <= 0.92,
        "encode_MBps>=200 (goal)": report["encode_MBps"] >= 200,
        "decode_MBps>=400 (goal)": report["decode_MBps"] >= 400,
    }
    with open(args.json_out, "w") as f:
        json.dump(report, f, indent=2)

    print(
        f"adapter {raw / 1e6:.2f} MB bf16 ({shape['lora_params']:,} LoRA params, rank {args.rank}) on "
        f"{shape['layers']}x{shape['hidden']} Qwen2, AdamW lr {args.lr:g}, steps {args.steps_from}-{args.steps_to}, "
        f"zstd {report['settings']['zstd_version']} level {args.level}"
    )
    print(
        f"  plain zstd {report['plain_zstd_ratio']:.3f} | keyframe {report['keyframe_ratio']:.3f} "
        f"({report['keyframe_vs_plain']:.3f} x plain) | delta {report['delta_ratio']:.3f} "
        f"(max {report['delta_ratio_max']:.3f}; {report['delta_ratio_no_context']:.3f} without exponent classes)"
    )
    wc = report["wall_clock"]
    print(
        f"  one core (CPU time): encode {report['encode_MBps']:.0f} MB/s (keyframe {report['encode_keyframe_MBps']:.0f})"
        f" | decode delta {report['decode_delta_MBps']:.0f} MB/s, keyframe {report['decode_keyframe_MBps']:.0f} MB/s"
    )
    print(
        f"  wall clock: decode delta {wc['decode_delta_MBps']:.0f} MB/s, keyframe {wc['decode_keyframe_MBps']:.0f} MB/s"
        f" (load average {wc['load_avg_1m_at_end']:.1f}) | lossless {report['lossless']}"
        f" | stream mean {report['stream']['mean_ratio']:.3f}"
    )
    if report["numpy_path"]:
        npp = report["numpy_path"]
        print(f"  kernels: compiled; the numpy path on the same versions: encode {npp['encode_MBps']:.0f} MB/s, "
              f"decode delta {npp['decode_delta_MBps']:.0f} MB/s (speed-up {npp['encode_speedup']:.2f}x / "
              f"{npp['decode_speedup']:.2f}x)")
    else:
        print(f"  kernels: {report['kernels']}")
    print("  checks: " + ", ".join(f"{k} {'ok' if v else 'FAIL'}" for k, v in report["checks"].items()))
    print(f"  loss {losses[0]:.3f} -> {losses[-1]:.3f}; {wall:.0f} s; wrote {args.json_out}")
    return 1 if args.strict and not all(v for k, v in report["checks"].items() if "goal" not in k) else 0


def codec_spec(name: str, p) -> object:
    """A TensorSpec for a LoRA parameter (the same type a manifest carries)."""
    from asyncrl.protocol.messages import TensorSpec

    return TensorSpec(name=name, dtype="bf16", shape=tuple(p.shape))


if __name__ == "__main__":
    sys.exit(main())
