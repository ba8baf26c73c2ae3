"""Synthetic Qwen2.5-1.5B-shaped rank-16 LoRA adapter that evolves like early AdamW training.

Used by the transport benchmark (`bench/broadcast.py`) and `bench.swarmlab`. The point is realistic *bytes* for the
codec and the transport, not a model: real tensor names and shapes (all 7 linear layers of 28
layers, hidden 1536, intermediate 8960, 12 heads / 2 KV heads of dim 128), bf16 on the wire
(36.9 MB raw), and consecutive versions that differ the way optimizer steps make them differ:

* A starts like PEFT's kaiming-uniform init (|A| <= 1/sqrt(in_features)), B starts at zero;
* every version is one Adam step (beta1 0.9, beta2 0.999, bias-corrected) on gradients that are
  persistent (AR(1), rho 0.8) plus fresh noise, with lr 1e-4 and decoupled weight decay 0.01.
  B therefore grows from 0 by ~lr-sized, sign-like steps; A moves by a fraction of its bf16 ULP,
  so most A elements change by 0 or +-1 ULP between versions — what real early LoRA steps look like.

fp32 master weights, published as bf16 (round to nearest even), like the coordinator's export.

    python -m bench.synthetic_adapter   # prints sizes and codec ratios for 6 versions
"""

from __future__ import annotations

import numpy as np

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM, RANK = 1536, 8960, 28, 12, 2, 128, 16
LINEARS = {  # name -> (in_features, out_features)
    "self_attn.q_proj": (HIDDEN, HEADS * HEAD_DIM),
    "self_attn.k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "self_attn.o_proj": (HEADS * HEAD_DIM, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTERMEDIATE),
    "mlp.up_proj": (HIDDEN, INTERMEDIATE),
    "mlp.down_proj": (INTERMEDIATE, HIDDEN),
}


def adapter_shapes(layers: int = LAYERS, rank: int = RANK) -> list[tuple[str, tuple[int, int], int]]:
    """(PEFT state-dict name, shape, in_features) for every LoRA tensor, sorted by name."""
    out = []
    for layer in range(layers):
        for mod, (fin, fout) in LINEARS.items():
            prefix = f"base_model.model.model.layers.{layer}.{mod}"
            out.append((f"{prefix}.lora_A.weight", (rank, fin), fin))
            out.append((f"{prefix}.lora_B.weight", (fout, rank), fin))
    return sorted(out)


def to_bf16_bytes(x: np.ndarray) -> bytes:
    """fp32 -> bf16 (round to nearest even) as little-endian bytes."""
    u = x.astype("<f4").view("<u4")
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


class SyntheticAdapter:
    """One Adam step per `step()`; `tensors()` gives the bf16 bytes of the current version."""

    def __init__(self, *, layers: int = LAYERS, rank: int = RANK, lr: float = 1e-4, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.shapes = adapter_shapes(layers, rank)
        sizes = [int(np.prod(s)) for _, s, _ in self.shapes]
        self.offsets = np.cumsum([0, *sizes])
        n = int(self.offsets[-1])
        self.w = np.zeros(n, np.float32)
        for (name, shape, fin), lo, hi in zip(self.shapes, self.offsets[:-1], self.offsets[1:]):
            if ".lora_A." in name:
                bound = 1.0 / np.sqrt(fin)
                self.w[lo:hi] = self.rng.uniform(-bound, bound, hi - lo).astype(np.float32)
        self.m = np.zeros(n, np.float32)
        self.v = np.zeros(n, np.float32)
        self.g = np.zeros(n, np.float32)
        self.lr, self.t = lr, 0

    @property
    def raw_bytes(self) -> int:
        return int(self.offsets[-1]) * 2

    def specs(self):
        from asyncrl.protocol.messages import TensorSpec

        return [TensorSpec(name, "bf16", tuple(shape)) for name, shape, _ in self.shapes]

    def step(self) -> None:
        self.t += 1
        noise = self.rng.standard_normal(self.w.size, dtype=np.float32)
        self.g *= 0.8
        self.g += 0.6 * noise
        self.m = 0.9 * self.m + 0.1 * self.g
        self.v = 0.999 * self.v + 0.001 * self.g * self.g
        m_hat = self.m / (1 - 0.9 ** self.t)
        v_hat = self.v / (1 - 0.999 ** self.t)
        self.w *= 1 - self.lr * 0.01
        self.w -= self.lr * m_hat / (np.sqrt(v_hat) + 1e-8)

    def tensors(self) -> dict[str, bytes]:
        return {name: to_bf16_bytes(self.w[lo:hi])
                for (name, _, _), lo, hi in zip(self.shapes, self.offsets[:-1], self.offsets[1:])}


if __name__ == "__main__":
    import time

    from asyncrl.protocol import codec

    ad = SyntheticAdapter()
    enc = codec.AdapterEncoder(keyframe_every=10)
    print(f"raw {ad.raw_bytes / 1e6:.1f} MB in {len(ad.shapes)} tensors")
    parent = None
    for version in range(6):
        ad.step()
        tensors = ad.tensors()
        t = time.perf_counter()
        out = enc.encode(version, ad.specs(), tensors)
        t_enc = time.perf_counter() - t
        t = time.perf_counter()
        dec = codec.decode(out.codec, ad.specs(), out.payload, parent, max_raw_bytes=ad.raw_bytes)
        t_dec = time.perf_counter() - t
        assert dec == tensors
        parent = dec
        print(f"v{version} {out.codec:26s} {len(out.payload) / 1e6:6.2f} MB  ratio {len(out.payload) / ad.raw_bytes:.3f}"
              f"  encode {t_enc:.2f}s decode {t_dec:.2f}s")
