"""Lossless adapter codec: keyframes and deltas of LoRA tensors, chunking and chunk hashes.

Pure: stdlib, numpy and zstandard only (no torch, no hivemind). Tensors travel as the raw
little-endian bytes of their published dtype (bf16, fp16 or fp32) and come back bit-identical:
-0.0, subnormals, infinities, NaN payloads and sign flips between versions included.

Two codecs (docs/codec.md has the measurements behind every choice):

* ``KEYFRAME_CODEC`` ("planes-zstd-v1"). Per dtype group, the tensors are concatenated in an order
  the encoder picks (by mean exponent, so LoRA A and B matrices form two homogeneous runs), each
  word is rotated left by one bit (the sign moves to bit 0, so the top byte of a bf16/fp32 word is
  exactly its exponent), the words are split into byte planes, and each plane is one zstd frame.
  The exponent plane compresses to ~2.8 bits/word; the sign+mantissa plane is incompressible.

* ``DELTA_CODEC`` ("delta-zz-planes-zstd-v1"). Against the parent version: d = (cur - parent) mod
  2^bits on the raw bit patterns, zigzag-encoded (+-1 ULP -> 2/1, 0 -> 0). How big d is depends on
  the parent's exponent (an Adam step of ~lr is many ULPs of a small weight and a fraction of an
  ULP of a large one) and the decoder holds the parent, so the parent's exponent is free context:
  tensors are ordered by mean parent exponent and cut into at most two *segments* (LoRA A vs B),
  and each segment's elements are partitioned into up to ``MAX_CLASSES`` *classes* by contiguous
  ranges of the parent's exponent (bounds chosen by the encoder, written in the header). Each class
  is coded on its own (own zstd frames, so own entropy tables) in whichever layout is smaller: byte
  planes, or "bit fields" (bits 0, 1, 2-3 and 4-7 packed across 8/4/2 elements per byte, then the
  remaining byte planes), which lets zstd's byte-wise Huffman coder go below one bit per element on
  classes that barely move.

Payload layout (all integers little-endian)::

    magic "ACDC" | u8 format (=1) | u8 kind (0 keyframe, 1 delta) | u32 crc32 | u8 ngroups
    group   := u8 dtype (0 bf16, 1 fp16, 2 fp32) | u32 ntensors | u32 x ntensors tensor order
               (indices into the spec list; groups in dtype order bf16, fp16, fp32) | u8 nsegments
    segment := u32 ntensors (the next ones in the order) | u8 nclasses (a keyframe: 1; at most 16)
               | u16 x (nclasses - 1) lower exponent bound of classes 1.. (strictly increasing)
    class   := u8 layout (0 byte planes, 1 bit fields) | u32 x nplanes frame lengths
               (byte planes: itemsize planes, least significant first; bit fields: 5 planes for
               16-bit words, 7 for 32-bit; a class's elements are the segment's elements whose
               parent exponent lies in its range, in their original order)
    frames  := one zstd frame per plane (each declaring its content size), in header order; nothing
               may follow them.

crc32 is over the decoded tensors' bytes in spec order; it catches a delta applied to the wrong
(same-shaped) parent, which would otherwise decode to garbage silently.

``decode`` trusts nothing: sizes come from the specs (checked against ``max_raw_bytes`` before any
decompression), every frame must declare its exact content size (checked before zstd allocates
anything), and any inconsistency raises ``ProtocolError`` (MALFORMED, PAYLOAD_TOO_LARGE or, for a
crc32 mismatch, HASH_MISMATCH) -- never another exception.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard as zstd

from .errors import ProtocolError, RejectCode

__all__ = [
    "KEYFRAME_CODEC",
    "DELTA_CODEC",
    "CODECS",
    "DEFAULT_LEVEL",
    "MAX_CLASSES",
    "EncodedAdapter",
    "AdapterEncoder",
    "encode_keyframe",
    "encode_delta",
    "decode",
    "describe",
    "raw_size",
    "split_chunks",
    "chunk_hashes",
    "verify_chunk",
]

KEYFRAME_CODEC = "planes-zstd-v1"
DELTA_CODEC = "delta-zz-planes-zstd-v1"
CODECS = (KEYFRAME_CODEC, DELTA_CODEC)

# zstd level: 1 is both the fastest and (on these high-entropy planes) the smallest for keyframes;
# higher levels buy <1% on deltas at 5-100x the encode time (docs/codec.md).
DEFAULT_LEVEL = 1
# Delta context classes: more classes compress better (diminishing after ~10) but each costs the
# decoder one pass over the group to find its members.
MAX_CLASSES = 4
# A class smaller than this is merged into a neighbour (frame overhead, Huffman table warm-up).
MIN_CLASS_ELEMS = 16384
MIN_CLASS_FRACTION = 1 / 128
# The decoder refuses more classes per segment than this (each costs it a pass over the segment).
MAX_DECODE_CLASSES = 16
# Keep merging classes while the cheapest merge costs less than this many bits per element of
# the segment (by the entropy proxy): a class must pay for the decoder's pass over the segment.
MERGE_TOL_BITS = 0.01
# Split a group into two segments only if their mean exponents differ by this many binades.
SEGMENT_MIN_GAP = 2.0

_MAGIC = b"ACDC"
_FORMAT = 1
_KIND_KEYFRAME = 0
_KIND_DELTA = 1
_LAYOUT_BYTES = 0
_LAYOUT_FIELDS = 1
_MAX_WINDOW = 1 << 27


@dataclass(frozen=True)
class _Dtype:
    code: int
    itemsize: int
    word: np.dtype
    bits: int
    mant_bits: int  # explicit mantissa bits: exponent = (word >> mant_bits) & exp_mask
    exp_mask: int


_DTYPES: dict[str, _Dtype] = {
    "bf16": _Dtype(0, 2, np.dtype("<u2"), 16, 7, 0xFF),
    "fp16": _Dtype(1, 2, np.dtype("<u2"), 16, 10, 0x1F),
    "fp32": _Dtype(2, 4, np.dtype("<u4"), 32, 23, 0xFF),
}
_BY_CODE = {dt.code: name for name, dt in _DTYPES.items()}
_GROUP_ORDER = ("bf16", "fp16", "fp32")
# Bit-field layout: LSB-first field widths; fields narrower than a byte are packed across elements.
_FIELDS = {16: (1, 1, 2, 4, 8), 32: (1, 1, 2, 4, 8, 8, 8)}


@dataclass(frozen=True)
class EncodedAdapter:
    """One published adapter version: `payload` decodes with `decode(codec, specs, payload, parent)`."""

    codec: str
    parent_version: int | None
    payload: bytes
    raw_bytes: int


# --------------------------------------------------------------------------------------- helpers


def _malformed(detail: str) -> ProtocolError:
    return ProtocolError(RejectCode.MALFORMED, detail)


def _spec_info(spec: Any) -> tuple[str, str, int]:
    """(name, dtype, element count) of a spec; raises ValueError/TypeError on nonsense."""
    name, dtype, shape = spec.name, spec.dtype, tuple(spec.shape)
    if not isinstance(name, str):
        raise TypeError(f"tensor name must be str, got {type(name).__name__}")
    if dtype not in _DTYPES:
        raise ValueError(f"tensor {name!r}: unsupported dtype {dtype!r}")
    n = 1
    for s in shape:
        if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 0:
            raise ValueError(f"tensor {name!r}: bad shape {shape!r}")
        n *= int(s)
    return name, dtype, n


def _checked_specs(specs: Sequence[Any]) -> list[tuple[str, str, int]]:
    infos = [_spec_info(s) for s in specs]
    names = [i[0] for i in infos]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in specs")
    return infos


def raw_size(specs: Sequence[Any]) -> int:
    """Total raw bytes of the tensors described by `specs`."""
    return sum(n * _DTYPES[dt].itemsize for _, dt, n in _checked_specs(specs))


def _groups(infos: list[tuple[str, str, int]]) -> list[tuple[str, list[int]]]:
    """[(dtype, [spec indices])] in canonical dtype order, only dtypes that occur."""
    out = []
    for dt in _GROUP_ORDER:
        idx = [i for i, info in enumerate(infos) if info[1] == dt]
        if idx:
            out.append((dt, idx))
    return out


def _words(buf: Any, dt: _Dtype, n: int, what: str, *, untrusted: bool) -> np.ndarray:
    mv = memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else buf
    if len(mv) != n * dt.itemsize:
        msg = f"{what}: {len(mv)} bytes, expected {n * dt.itemsize}"
        if untrusted:
            raise _malformed(msg)
        raise ValueError(msg)
    return np.frombuffer(mv, dtype=dt.word)


def _rotl1(w: np.ndarray, bits: int) -> np.ndarray:
    return (w << w.dtype.type(1)) | (w >> w.dtype.type(bits - 1))


def _rotr1(w: np.ndarray, bits: int) -> np.ndarray:
    return (w >> w.dtype.type(1)) | (w << w.dtype.type(bits - 1))


def _zigzag(d: np.ndarray, bits: int) -> np.ndarray:
    """d: unsigned wrap-around difference -> zigzag code (small |d| -> small code)."""
    s = d.view(np.dtype(f"<i{bits // 8}"))
    return ((s << s.dtype.type(1)) ^ (s >> s.dtype.type(bits - 1))).view(d.dtype)


def _unzigzag(w: np.ndarray) -> np.ndarray:
    one = w.dtype.type(1)
    sign = w & one
    np.negative(sign, out=sign)
    out = w >> one
    out ^= sign
    return out


def _exponent(w: np.ndarray, dt: _Dtype) -> np.ndarray:
    e = (w >> w.dtype.type(dt.mant_bits)) & w.dtype.type(dt.exp_mask)
    return e.astype(np.uint8)


def _class_mask(e: np.ndarray, bounds: Sequence[int], k: int) -> np.ndarray:
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
_SCATTER_CHUNK = 1 << 20


def _scatter_classes(out: np.ndarray, e: np.ndarray, bounds: Sequence[int], streams: list[np.ndarray]) -> None:
    """out[i] = next unused element of streams[class of e[i]], i in increasing order."""
    pos = [0] * len(streams)
    for c0 in range(0, out.size, _SCATTER_CHUNK):
        ec, oc = e[c0 : c0 + _SCATTER_CHUNK], out[c0 : c0 + _SCATTER_CHUNK]
        for k, stream in enumerate(streams):
            idx = np.flatnonzero(_class_mask(ec, bounds, k))
            oc[idx] = stream[pos[k] : pos[k] + idx.size]
            pos[k] += idx.size


_BITLEN16 = np.zeros(1 << 16, np.uint8)
for _b in range(1, 17):
    _BITLEN16[1 << (_b - 1) : 1 << _b] = _b


def _bitlen(w: np.ndarray) -> np.ndarray:
    """Bit length of each word (0 for 0), as uint8."""
    if w.dtype.itemsize == 2:
        return _BITLEN16[w]
    hi = _BITLEN16[(w >> np.uint32(16)).astype(np.uint16)]
    lo = _BITLEN16[(w & np.uint32(0xFFFF)).astype(np.uint16)]
    return np.where(hi > 0, hi + np.uint8(16), lo)


def _xlogx(h: np.ndarray) -> float:
    """n * H(h) in bits for a histogram h (the ideal cost of coding its symbols)."""
    tot = float(h.sum())
    nz = h[h > 0].astype(np.float64)
    return float(tot * math.log2(tot) - (nz * np.log2(nz)).sum()) if tot else 0.0


def _choose_bounds(e: np.ndarray, words: np.ndarray, max_classes: int) -> list[int]:
    """Partition the parent's exponent range into <= max_classes contiguous classes.

    Start with one class per exponent value present; repeatedly merge the adjacent pair whose
    union costs the fewest extra bits, where cost = n * entropy of the code words' bit lengths
    (a proxy for how differently the two classes' deltas are distributed); classes smaller than
    MIN_CLASS_ELEMS / MIN_CLASS_FRACTION of the group are merged first.
    """
    n = e.size
    min_size = max(MIN_CLASS_ELEMS, int(n * MIN_CLASS_FRACTION))
    if max_classes <= 1 or n < 2 * min_size:
        return []
    nbits = words.dtype.itemsize * 8 + 1
    joint = np.bincount(e.astype(np.intp) * nbits + _bitlen(words), minlength=256 * nbits).reshape(256, nbits)
    groups = [[int(v), joint[v].astype(np.int64)] for v in np.flatnonzero(joint.sum(axis=1))]

    def cost(i: int) -> float:  # extra bits for merging groups i and i+1
        a, b = groups[i][1], groups[i + 1][1]
        return _xlogx(a + b) - _xlogx(a) - _xlogx(b)

    while len(groups) > 1:
        sizes = [int(g[1].sum()) for g in groups]
        small = [i for i, sz in enumerate(sizes) if sz < min_size]
        if small:
            i = min(small, key=lambda j: sizes[j])
            j = min((j for j in (i - 1, i) if 0 <= j < len(groups) - 1), key=cost)
        else:
            j = min(range(len(groups) - 1), key=cost)
            if len(groups) <= max_classes and cost(j) >= MERGE_TOL_BITS * n:
                break
        groups[j][1] = groups[j][1] + groups[j + 1][1]
        del groups[j + 1]
    return [g[0] for g in groups[1:]]


def _plane_sizes(layout: int, n: int, dt: _Dtype) -> list[int]:
    if layout == _LAYOUT_BYTES:
        return [n] * dt.itemsize
    return [-(-n * w // 8) if w < 8 else n for w in _FIELDS[dt.bits]]


def _pack(w: np.ndarray, layout: int, dt: _Dtype) -> list[np.ndarray]:
    n = w.size
    if layout == _LAYOUT_BYTES:
        b = w.view(np.uint8).reshape(n, dt.itemsize)
        return [np.ascontiguousarray(b[:, j]) for j in range(dt.itemsize)]
    planes, pos = [], 0
    for width in _FIELDS[dt.bits]:
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
_LUT2 = np.array([sum((((b >> (2 * j)) & 3) << 2) << (8 * j) for j in range(4)) for b in range(256)], dtype="<u4")
_LUT4 = np.array([((b & 15) << 4) | ((b >> 4) << 12) for b in range(256)], dtype="<u2")


def _unpack(planes: list[bytes], layout: int, n: int, dt: _Dtype) -> np.ndarray:
    word = dt.word
    if layout == _LAYOUT_BYTES:
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
    lo |= np.take(_LUT2, np.frombuffer(planes[2], np.uint8)).view(np.uint8)[:n]
    lo |= np.take(_LUT4, np.frombuffer(planes[3], np.uint8)).view(np.uint8)[:n]
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


def _compress_class(w: np.ndarray, dt: _Dtype, cctx: zstd.ZstdCompressor, try_fields: bool):
    best = None
    for layout in (_LAYOUT_BYTES, _LAYOUT_FIELDS) if try_fields else (_LAYOUT_BYTES,):
        frames = [cctx.compress(p.tobytes()) for p in _pack(w, layout, dt)]
        size = sum(len(f) for f in frames)
        if best is None or size < best[0]:
            best = (size, layout, frames)
    return best[1], best[2]


def _crc(infos, tensors: Mapping[str, Any]) -> int:
    crc = 0
    for name, _, _ in infos:
        crc = zlib.crc32(tensors[name], crc)
    return crc & 0xFFFFFFFF


# --------------------------------------------------------------------------------------- encoder


def _order_and_segments(
    parts: dict[int, np.ndarray], idx: list[int], dt: _Dtype, split: bool
) -> tuple[list[int], list[int]]:
    """Tensor order (by mean exponent, so similar-magnitude tensors are adjacent: LoRA A and B
    matrices differ by ~6 binades) and, if `split`, a cut into two segments at the tensor boundary
    that best separates the two populations (Otsu on the size-weighted per-tensor mean exponent)."""
    sizes = {i: parts[i].size for i in idx}
    means = {i: float(_exponent(parts[i], dt).mean()) if sizes[i] else 0.0 for i in idx}
    order = sorted(idx, key=lambda i: (means[i], i))
    n = sum(sizes.values())
    min_seg = 2 * max(MIN_CLASS_ELEMS, int(n * MIN_CLASS_FRACTION))
    if not split or n < 2 * min_seg:
        return order, [len(order)]
    w = np.array([sizes[i] for i in order], dtype=np.float64)
    m = np.array([means[i] for i in order])
    cw, cm = np.cumsum(w), np.cumsum(w * m)
    best, cut = 0.0, 0
    for j in range(1, len(order)):
        w1, w2 = cw[j - 1], n - cw[j - 1]
        if w1 < min_seg or w2 < min_seg:
            continue
        gap = cm[j - 1] / w1 - (cm[-1] - cm[j - 1]) / w2
        score = w1 * w2 * gap * gap
        if score > best and abs(gap) >= SEGMENT_MIN_GAP:
            best, cut = score, j
    return order, ([cut, len(order) - cut] if cut else [len(order)])


def _encode(
    kind: int,
    specs: Sequence[Any],
    tensors: Mapping[str, Any],
    parent: Mapping[str, Any] | None,
    level: int,
    max_classes: int,
) -> bytes:
    infos = _checked_specs(specs)
    for name, _, _ in infos:
        if name not in tensors:
            raise ValueError(f"missing tensor {name!r}")
        if parent is not None and name not in parent:
            raise ValueError(f"parent lacks tensor {name!r}")
    cctx = zstd.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    header = bytearray(_MAGIC)
    groups = _groups(infos)
    header += struct.pack("<BBIB", _FORMAT, kind, _crc(infos, tensors), len(groups))
    frames: list[bytes] = []
    for dtname, idx in groups:
        dt = _DTYPES[dtname]
        cur_parts = {i: _words(tensors[infos[i][0]], dt, infos[i][2], infos[i][0], untrusted=False) for i in idx}
        if kind == _KIND_KEYFRAME:
            order, seg_counts = _order_and_segments(cur_parts, idx, dt, split=False)
            words = _rotl1(np.concatenate([cur_parts[i] for i in order]), dt.bits)
            e = None
        else:
            par_parts = {
                i: _words(parent[infos[i][0]], dt, infos[i][2], "parent " + infos[i][0], untrusted=False) for i in idx
            }
            order, seg_counts = _order_and_segments(par_parts, idx, dt, split=max_classes > 1)
            par = np.concatenate([par_parts[i] for i in order])
            words = _zigzag(np.concatenate([cur_parts[i] for i in order]) - par, dt.bits)
            e = _exponent(par, dt)
        header += struct.pack(f"<BI{len(order)}IB", dt.code, len(order), *order, len(seg_counts))
        off = t = 0
        for cnt in seg_counts:
            n_seg = sum(infos[i][2] for i in order[t : t + cnt])
            t += cnt
            w_seg = words[off : off + n_seg]
            if e is None:
                bounds: list[int] = []
                members: list[np.ndarray | None] = [None]
            else:
                e_seg = e[off : off + n_seg]
                bounds = _choose_bounds(e_seg, w_seg, max_classes)
                members = (
                    [np.flatnonzero(_class_mask(e_seg, bounds, k)) for k in range(len(bounds) + 1)] if bounds else [None]
                )
            off += n_seg
            header += struct.pack(f"<IB{len(bounds)}H", cnt, len(members), *bounds)
            for m in members:
                wk = w_seg if m is None else w_seg[m]
                layout, fr = _compress_class(wk, dt, cctx, try_fields=kind == _KIND_DELTA)
                header += struct.pack(f"<B{len(fr)}I", layout, *(len(f) for f in fr))
                frames.extend(fr)
    return bytes(header) + b"".join(frames)


def encode_keyframe(specs: Sequence[Any], tensors: Mapping[str, Any], *, level: int = DEFAULT_LEVEL) -> bytes:
    """Self-contained payload for `tensors` (name -> raw little-endian bytes of `spec.dtype`)."""
    return _encode(_KIND_KEYFRAME, specs, tensors, None, level, 1)


def encode_delta(
    specs: Sequence[Any],
    tensors: Mapping[str, Any],
    parent: Mapping[str, Any],
    *,
    level: int = DEFAULT_LEVEL,
    max_classes: int = MAX_CLASSES,
) -> bytes:
    """Payload that turns `parent` (same specs) into `tensors`; decode needs that exact parent.

    `max_classes` (1..16) bounds the exponent classes per segment: more compress a little better
    and cost the decoder one pass over the segment each; 1 also disables the A/B segment split."""
    if parent is None:
        raise ValueError("encode_delta needs a parent")
    return _encode(_KIND_DELTA, specs, tensors, parent, level, max(1, min(int(max_classes), MAX_DECODE_CLASSES)))


# --------------------------------------------------------------------------------------- decoder


class _Reader:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise _malformed(f"payload truncated at byte {self.pos} (wanted {n} more)")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))


def _unzstd(dctx: zstd.ZstdDecompressor, frame: memoryview, expected: int, max_raw_bytes: int) -> bytes:
    try:
        declared = zstd.frame_content_size(frame)
    except zstd.ZstdError as exc:
        raise _malformed(f"bad zstd frame header: {exc}") from None
    if declared < 0:
        raise _malformed("zstd frame does not declare its content size")
    if declared > max_raw_bytes:
        raise ProtocolError(RejectCode.PAYLOAD_TOO_LARGE, f"zstd frame expands to {declared} bytes > {max_raw_bytes}")
    if declared != expected:
        raise _malformed(f"zstd frame expands to {declared} bytes, expected {expected}")
    try:
        out = dctx.decompress(frame, max_output_size=expected, allow_extra_data=False)
    except zstd.ZstdError as exc:
        raise _malformed(f"corrupt zstd frame: {exc}") from None
    if len(out) != expected:
        raise _malformed(f"zstd frame produced {len(out)} bytes, expected {expected}")
    return out


def _parse_header(buf: memoryview) -> tuple[int, int, list, int]:
    """(kind, crc32, [(dtype, order, [(ntensors, bounds, [(layout, frame lengths)])])], frames offset).

    Checks everything that does not need the specs, including that the frame lengths add up to
    exactly the rest of the payload."""
    rd = _Reader(buf)
    magic, fmt, kind, crc, ngroups = rd.unpack("<4sBBIB")
    if magic != _MAGIC or fmt != _FORMAT:
        raise _malformed("not an adapter codec payload (magic/format)")
    if kind not in (_KIND_KEYFRAME, _KIND_DELTA):
        raise _malformed(f"unknown payload kind {kind}")
    groups, frame_bytes = [], 0
    for _ in range(ngroups):
        code, ntens = rd.unpack("<BI")
        if code not in _BY_CODE:
            raise _malformed(f"unknown dtype code {code}")
        dt = _DTYPES[_BY_CODE[code]]
        if ntens > len(buf):  # each tensor takes 4 header bytes: refuse absurd counts before reading
            raise _malformed(f"tensor count {ntens} exceeds the payload")
        order = list(rd.unpack(f"<{ntens}I"))
        (nseg,) = rd.unpack("<B")
        segments, t = [], 0
        for _ in range(nseg):
            cnt, ncls = rd.unpack("<IB")
            if cnt < 1 or t + cnt > ntens:
                raise _malformed(f"bad segment size {cnt}")
            t += cnt
            if ncls < 1 or ncls > MAX_DECODE_CLASSES or (kind == _KIND_KEYFRAME and ncls != 1):
                raise _malformed(f"bad class count {ncls}")
            bounds = list(rd.unpack(f"<{ncls - 1}H"))
            if any(b < 1 or b > dt.exp_mask for b in bounds) or any(x >= y for x, y in zip(bounds, bounds[1:])):
                raise _malformed(f"bad class bounds {bounds}")
            classes = []
            for _ in range(ncls):
                (layout,) = rd.unpack("<B")
                if layout not in (_LAYOUT_BYTES, _LAYOUT_FIELDS):
                    raise _malformed(f"unknown plane layout {layout}")
                nplanes = dt.itemsize if layout == _LAYOUT_BYTES else len(_FIELDS[dt.bits])
                lens = rd.unpack(f"<{nplanes}I")
                frame_bytes += sum(lens)
                classes.append((layout, lens))
            segments.append((cnt, bounds, classes))
        if t != ntens:
            raise _malformed("segments do not cover the group's tensors")
        groups.append((_BY_CODE[code], order, segments))
    if rd.pos + frame_bytes != len(buf):
        raise _malformed("frame lengths do not add up to the payload size")
    return kind, crc, groups, rd.pos


def describe(payload: bytes) -> dict:
    """Human/bench-readable summary of a payload's structure (kind, per dtype group: segments,
    their exponent class bounds, and each class's layout and compressed bytes).
    Raises ProtocolError(MALFORMED) for anything that is not a well-formed payload header."""
    try:
        kind, crc, groups, start = _parse_header(memoryview(payload).cast("B"))
    except ProtocolError:
        raise
    except Exception as exc:
        raise _malformed(f"undecodable adapter payload ({type(exc).__name__}: {exc})") from None
    return {
        "kind": "keyframe" if kind == _KIND_KEYFRAME else "delta",
        "crc32": crc,
        "header_bytes": start,
        "groups": [
            {
                "dtype": dtname,
                "tensors": len(order),
                "segments": [
                    {
                        "tensors": cnt,
                        "class_bounds": bounds,
                        "classes": [
                            {"layout": "bytes" if lay == _LAYOUT_BYTES else "fields", "bytes": sum(lens)}
                            for lay, lens in classes
                        ],
                    }
                    for cnt, bounds, classes in segs
                ],
            }
            for dtname, order, segs in groups
        ],
    }


def decode(
    codec: str,
    specs: Sequence[Any],
    payload: bytes,
    parent: Mapping[str, bytes] | None,
    *,
    max_raw_bytes: int,
) -> dict[str, bytes]:
    """Inverse of encode_keyframe/encode_delta: name -> raw bytes, bit-identical to what was encoded.

    Raises ProtocolError only: MALFORMED (unknown codec, delta without parent, parent of the wrong
    shape, bad header, corrupt or inconsistent zstd frames), PAYLOAD_TOO_LARGE (specs or any frame
    larger than `max_raw_bytes`; checked before anything is allocated), HASH_MISMATCH (decoded
    bytes fail the payload's crc32: typically a delta applied to the wrong parent version).
    """
    try:
        return _decode(codec, specs, payload, parent, max_raw_bytes)
    except ProtocolError:
        raise
    except MemoryError:
        raise ProtocolError(RejectCode.PAYLOAD_TOO_LARGE, "out of memory while decoding") from None
    except Exception as exc:  # safety net: input bytes never escape as another exception type
        raise _malformed(f"undecodable adapter payload ({type(exc).__name__}: {exc})") from None


def _decode(codec, specs, payload, parent, max_raw_bytes) -> dict[str, bytes]:
    if codec == KEYFRAME_CODEC:
        kind = _KIND_KEYFRAME
    elif codec == DELTA_CODEC:
        kind = _KIND_DELTA
        if parent is None:
            raise _malformed("delta payload needs its parent version")
    else:
        raise _malformed(f"unknown codec {codec!r}")
    try:
        infos = _checked_specs(specs)
    except (ValueError, TypeError, AttributeError) as exc:
        raise _malformed(f"bad tensor specs: {exc}") from None
    total = sum(n * _DTYPES[dt].itemsize for _, dt, n in infos)
    if total > max_raw_bytes:
        raise ProtocolError(RejectCode.PAYLOAD_TOO_LARGE, f"adapter is {total} raw bytes > {max_raw_bytes}")
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise _malformed(f"payload must be bytes, got {type(payload).__name__}")
    buf = memoryview(payload).cast("B")
    pkind, crc, parsed, frames_start = _parse_header(buf)
    if pkind != kind:
        raise _malformed(f"payload kind {pkind} does not match codec {codec!r}")
    groups = _groups(infos)
    if [g[0] for g in parsed] != [g[0] for g in groups]:
        raise _malformed(f"payload dtype groups {[g[0] for g in parsed]} do not match the specs'")
    plan = []
    for (dtname, order, segs), (_, idx) in zip(parsed, groups):
        if sorted(order) != idx:
            raise _malformed("tensor order is not a permutation of the group's specs")
        segments, t = [], 0
        for cnt, bounds, classes in segs:
            segments.append((sum(infos[i][2] for i in order[t : t + cnt]), bounds, classes))
            t += cnt
        plan.append((_DTYPES[dtname], order, segments))

    # Pass 2: decode.
    dctx = zstd.ZstdDecompressor(max_window_size=_MAX_WINDOW)
    pos = frames_start
    out: dict[str, bytes] = {}
    for dt, order, segments in plan:
        sizes = [infos[i][2] for i in order]
        n = sum(sizes)
        if kind == _KIND_DELTA:
            parts = []
            for i in order:
                name = infos[i][0]
                if name not in parent:
                    raise _malformed(f"parent lacks tensor {name!r}")
                parts.append(_words(parent[name], dt, infos[i][2], "parent " + name, untrusted=True))
            par = np.concatenate(parts)
            e = _exponent(par, dt)
        words = None if len(segments) == 1 and len(segments[0][2]) == 1 else np.empty(n, dt.word)
        off = 0
        for seg_n, bounds, classes in segments:
            e_seg = e[off : off + seg_n] if kind == _KIND_DELTA else None
            counts = [seg_n] if not bounds else [int(np.count_nonzero(_class_mask(e_seg, bounds, k))) for k in range(len(classes))]
            streams = []
            for cnt, (layout, lens) in zip(counts, classes):
                planes = []
                for ln, expected in zip(lens, _plane_sizes(layout, cnt, dt)):
                    planes.append(_unzstd(dctx, buf[pos : pos + ln], expected, max_raw_bytes))
                    pos += ln
                streams.append(_unpack(planes, layout, cnt, dt))
            if words is None:
                words = streams[0]
            elif not bounds:
                words[off : off + seg_n] = streams[0]
            else:
                _scatter_classes(words[off : off + seg_n], e_seg, bounds, streams)
            off += seg_n
        if kind == _KIND_KEYFRAME:
            flat = _rotr1(words, dt.bits)
        else:
            flat = _unzigzag(words)
            flat += par
        off = 0
        for i, size in zip(order, sizes):
            out[infos[i][0]] = flat[off : off + size].tobytes()
            off += size
    if _crc(infos, out) != crc:
        raise ProtocolError(
            RejectCode.HASH_MISMATCH,
            "decoded adapter fails its crc32" + (" (delta applied to the wrong parent?)" if kind == _KIND_DELTA else ""),
        )
    return {name: out[name] for name, _, _ in infos}


# --------------------------------------------------------------------------------------- encoder state


class AdapterEncoder:
    """Stateful publisher-side encoder: a keyframe for the first version, whenever the tensor
    layout changes, and for every version divisible by `keyframe_every`; otherwise a delta
    against the previously encoded version (which is all it keeps)."""

    def __init__(self, keyframe_every: int = 10, level: int = DEFAULT_LEVEL) -> None:
        if keyframe_every < 1:
            raise ValueError("keyframe_every must be >= 1")
        self.keyframe_every = int(keyframe_every)
        self.level = int(level)
        self._prev: tuple[int, tuple, dict[str, bytes]] | None = None
        self.last_keyframe_version: int | None = None

    @property
    def last_version(self) -> int | None:
        return None if self._prev is None else self._prev[0]

    def encode(self, version: int, specs: Sequence[Any], tensors: Mapping[str, Any]) -> EncodedAdapter:
        specs = list(specs)
        infos = _checked_specs(specs)
        layout = tuple((name, dt, tuple(s.shape)) for (name, dt, _), s in zip(infos, specs))
        if self._prev is not None and version <= self._prev[0]:
            raise ValueError(f"version {version} does not follow {self._prev[0]}")
        snapshot = {name: bytes(tensors[name]) for name, _, _ in infos}
        prev = self._prev
        if prev is None or prev[1] != layout or version % self.keyframe_every == 0:
            payload = encode_keyframe(specs, snapshot, level=self.level)
            enc = EncodedAdapter(KEYFRAME_CODEC, None, payload, raw_size(specs))
            self.last_keyframe_version = version
        else:
            payload = encode_delta(specs, snapshot, prev[2], level=self.level)
            enc = EncodedAdapter(DELTA_CODEC, prev[0], payload, raw_size(specs))
        self._prev = (version, layout, snapshot)
        return enc


# --------------------------------------------------------------------------------------- chunks


def split_chunks(payload: bytes, chunk_bytes: int) -> list[bytes]:
    """Cut `payload` into chunks of `chunk_bytes` (the last one shorter); b"" gives []."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    mv = memoryview(payload).cast("B")
    return [bytes(mv[i : i + chunk_bytes]) for i in range(0, len(mv), chunk_bytes)]


def chunk_hashes(chunks: Sequence[bytes]) -> tuple[bytes, ...]:
    """sha256 digest of each chunk, in order (what the signed manifest carries)."""
    return tuple(hashlib.sha256(c).digest() for c in chunks)


def verify_chunk(chunk: bytes, expected_hash: bytes) -> None:
    """Raise ProtocolError(HASH_MISMATCH) unless sha256(chunk) == expected_hash."""
    if not hmac.compare_digest(hashlib.sha256(chunk).digest(), bytes(expected_hash)):
        raise ProtocolError(RejectCode.HASH_MISMATCH, f"chunk of {len(chunk)} bytes does not match its sha256")
