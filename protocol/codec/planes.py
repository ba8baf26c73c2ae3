"""Word transforms shared by the encoder and the decoder: bit rotation, zigzag deltas, exponent
classes, and the two plane layouts (byte planes; bit fields 1-1-2-4-8...), each plane one zstd frame.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import zstandard as zstd

from .format import (
    FIELDS,
    LAYOUT_BYTES,
    LAYOUT_FIELDS,
    Dtype,
)


def rotl1(w: np.ndarray, bits: int) -> np.ndarray:
    return (w << w.dtype.type(1)) | (w >> w.dtype.type(bits - 1))


def rotr1(w: np.ndarray, bits: int) -> np.ndarray:
    return (w >> w.dtype.type(1)) | (w << w.dtype.type(bits - 1))


def zigzag(d: np.ndarray, bits: int) -> np.ndarray:
    """d: unsigned wrap-around difference -> zigzag code (small |d| -> small code)."""
    s = d.view(np.dtype(f"<i{bits // 8}"))
    return ((s << s.dtype.type(1)) ^ (s >> s.dtype.type(bits - 1))).view(d.dtype)


def unzigzag(w: np.ndarray) -> np.ndarray:
    one = w.dtype.type(1)
    sign = w & one
    np.negative(sign, out=sign)
    out = w >> one
    out ^= sign
    return out


def exponent(w: np.ndarray, dt: Dtype) -> np.ndarray:
    e = (w >> w.dtype.type(dt.mant_bits)) & w.dtype.type(dt.exp_mask)
    return e.astype(np.uint8)


def class_mask(e: np.ndarray, bounds: Sequence[int], k: int) -> np.ndarray:
    """Boolean mask of class k: bounds[k-1] <= e < bounds[k] (open-ended at both ends)."""
    if k == 0:
        return e < np.uint8(bounds[0])
    if k == len(bounds):
        return e >= np.uint8(bounds[-1])
    mask = e >= np.uint8(bounds[k - 1])
    mask &= e < np.uint8(bounds[k])
    return mask


# The decoder scatters classes back chunk by chunk, so its temporary index arrays stay <= 8 MiB
# however big the adapter (same speed as whole segments; less memory and fewer page faults).
SCATTER_CHUNK = 1 << 20


def scatter_classes(out: np.ndarray, e: np.ndarray, bounds: Sequence[int], streams: list[np.ndarray]) -> None:
    """out[i] = next unused element of streams[class of e[i]], i in increasing order."""
    pos = [0] * len(streams)
    for c0 in range(0, out.size, SCATTER_CHUNK):
        ec, oc = e[c0 : c0 + SCATTER_CHUNK], out[c0 : c0 + SCATTER_CHUNK]
        for k, stream in enumerate(streams):
            idx = np.flatnonzero(class_mask(ec, bounds, k))
            oc[idx] = stream[pos[k] : pos[k] + idx.size]
            pos[k] += idx.size


def plane_sizes(layout: int, n: int, dt: Dtype) -> list[int]:
    if layout == LAYOUT_BYTES:
        return [n] * dt.itemsize
    return [-(-n * w // 8) if w < 8 else n for w in FIELDS[dt.bits]]


def pack(w: np.ndarray, layout: int, dt: Dtype) -> list[np.ndarray]:
    n = w.size
    if layout == LAYOUT_BYTES:
        b = w.view(np.uint8).reshape(n, dt.itemsize)
        return [np.ascontiguousarray(b[:, j]) for j in range(dt.itemsize)]
    planes, pos = [], 0
    for width in FIELDS[dt.bits]:
        v = ((w >> w.dtype.type(pos)) & w.dtype.type((1 << width) - 1)).astype(np.uint8)
        pos += width
        if width == 8:
            planes.append(v)
        elif width == 1:
            planes.append(np.packbits(v, bitorder="little"))
        else:
            per = 8 // width
            pad = (-n) % per
            if pad:
                v = np.concatenate([v, np.zeros(pad, np.uint8)])
            v = v.reshape(-1, per)
            packed = v[:, 0].copy()
            for j in range(1, per):
                packed |= v[:, j] << np.uint8(j * width)
            planes.append(packed)
    return planes


# Packed byte -> its 2-bit (resp. 4-bit) fields, one per output byte, already shifted to their place
# in the low byte (bits 2-3, resp. 4-7): the decoder expands a packed plane with one table lookup
# per input byte (numpy's uint8 shifts are ~10x slower than its table lookups and ORs).
LUT2 = np.array([sum((((b >> (2 * j)) & 3) << 2) << (8 * j) for j in range(4)) for b in range(256)], dtype="<u4")
LUT4 = np.array([((b & 15) << 4) | ((b >> 4) << 12) for b in range(256)], dtype="<u2")


def unpack(planes: list[bytes], layout: int, n: int, dt: Dtype) -> np.ndarray:
    word = dt.word
    if layout == LAYOUT_BYTES:
        if dt.itemsize == 2:
            w = np.frombuffer(planes[1], np.uint8).astype(word)
            w <<= word.type(8)
            w |= np.frombuffer(planes[0], np.uint8)
            return w
        out = np.empty((n, dt.itemsize), np.uint8)
        for j, p in enumerate(planes):
            out[:, j] = np.frombuffer(p, np.uint8)
        return out.view(word).reshape(n)
    # Bit fields (1, 1, 2, 4, then whole bytes): rebuild the low byte, then the upper byte planes.
    lo = np.unpackbits(np.frombuffer(planes[0], np.uint8), count=n, bitorder="little")
    b1 = np.unpackbits(np.frombuffer(planes[1], np.uint8), count=n, bitorder="little")
    b1 += b1
    lo |= b1
    lo |= np.take(LUT2, np.frombuffer(planes[2], np.uint8)).view(np.uint8)[:n]
    lo |= np.take(LUT4, np.frombuffer(planes[3], np.uint8)).view(np.uint8)[:n]
    if dt.itemsize == 2:
        w = np.frombuffer(planes[4], np.uint8).astype(word)
        w <<= word.type(8)
        w |= lo
        return w
    out = np.empty((n, dt.itemsize), np.uint8)
    out[:, 0] = lo
    for j, p in enumerate(planes[4:], start=1):
        out[:, j] = np.frombuffer(p, np.uint8)
    return out.view(word).reshape(n)


def compress_class(w: np.ndarray, dt: Dtype, cctx: zstd.ZstdCompressor, try_fields: bool):
    best = None
    for layout in (LAYOUT_BYTES, LAYOUT_FIELDS) if try_fields else (LAYOUT_BYTES,):
        frames = [cctx.compress(p.tobytes()) for p in pack(w, layout, dt)]
        size = sum(len(f) for f in frames)
        if best is None or size < best[0]:
            best = (size, layout, frames)
    return best[1], best[2]
