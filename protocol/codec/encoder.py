"""Encoding: keyframes and deltas (one engine, `encode_payload`), and the stateful `AdapterEncoder`.

Keyframe: per dtype group, tensors ordered by mean exponent, words rotated left by one bit, byte
planes. Delta: d = (cur - parent) mod 2^bits zigzagged; tensors ordered by the *parent's* mean
exponent and cut into at most two segments (LoRA A vs B); each segment split into up to
`MAX_CLASSES` classes by the parent's exponent (`choose_bounds`); each class in the smaller of the
two plane layouts. docs/codec.md has the measurements behind each choice.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import zstandard as zstd

from .format import (
    DELTA_CODEC,
    DTYPES,
    FORMAT,
    KEYFRAME_CODEC,
    KIND_DELTA,
    KIND_KEYFRAME,
    MAGIC,
    MAX_DECODE_CLASSES,
    Dtype,
    EncodedAdapter,
    as_words,
    checked_specs,
    dtype_groups,
    raw_size,
    tensors_crc,
)
from .planes import (
    class_ids,
    compress_class,
    exponent,
    gather_classes,
    rotl1,
    zigzag_inplace,
)

# zstd level: 1 is both the fastest and (on these high-entropy planes) the smallest for keyframes;
# higher levels buy <1% on deltas at 5-100x the encode time (docs/codec.md).
DEFAULT_LEVEL = 1
# At level 1 the match finder gets a 64-entry table (hash_log = chain_log = 6, zstd's minimum)
# instead of 16K entries: the planes hold almost no repeated strings, so the big table only misses
# the cache. Measured on bench/codec.py's planes: compression 1.9x faster, output 0.8 % smaller;
# frames are ordinary zstd (the decoder needs nothing new).
FAST_TABLE_LOG = 6
# Delta context classes: more classes compress better (diminishing after ~10) but each costs the
# decoder one pass over the group to find its members.
MAX_CLASSES = 4
# A class smaller than this is merged into a neighbour (frame overhead, Huffman table warm-up).
MIN_CLASS_ELEMS = 16384
MIN_CLASS_FRACTION = 1 / 128
# Keep merging classes while the cheapest merge costs less than this many bits per element of
# the segment (by the entropy proxy): a class must pay for the decoder's pass over the segment.
MERGE_TOL_BITS = 0.01
# Split a group into two segments only if their mean exponents differ by this many binades.
SEGMENT_MIN_GAP = 2.0
# choose_bounds reads an evenly strided sample of at most about this many elements of a segment: it
# needs a 256 x 17 histogram, and reading every element would cost as much as compressing them.
BOUNDS_SAMPLE = 1 << 16


BITLEN16 = np.zeros(1 << 16, np.uint8)
for _b in range(1, 17):
    BITLEN16[1 << (_b - 1) : 1 << _b] = _b


def bitlen(w: np.ndarray) -> np.ndarray:
    """Bit length of each word (0 for 0), as uint8."""
    if w.dtype.itemsize == 2:
        return BITLEN16[w]
    hi = BITLEN16[(w >> np.uint32(16)).astype(np.uint16)]
    lo = BITLEN16[(w & np.uint32(0xFFFF)).astype(np.uint16)]
    return np.where(hi > 0, hi + np.uint8(16), lo)


def xlogx(h) -> float:
    """n * H(h) in bits for a histogram h (the ideal cost of coding its symbols). Plain Python on
    the 17-33 bins of a bit-length histogram: several times faster than numpy calls on them."""
    tot = sum(h)
    return tot * math.log2(tot) - sum(x * math.log2(x) for x in h if x > 0) if tot > 0 else 0.0


def bitlen_histogram(parents: Sequence[np.ndarray], words: np.ndarray, dt: Dtype) -> np.ndarray:
    """joint[parent exponent, bit length of the code word] for a segment (`parents`: its tensors'
    parent words, `words`: its code words), counted on an evenly strided sample of at most
    ~BOUNDS_SAMPLE elements and scaled to the segment's size (float64). The parents' samples are
    gathered into one array first, so the exponent, the key and the count are one pass each (not
    one set of numpy calls and one 256 x 17 bincount per tensor)."""
    n = words.size
    stride = max(1, n // BOUNDS_SAMPLE)
    nbits = words.dtype.itemsize * 8 + 1
    ws = words[::stride]
    ps = np.empty(ws.size, words.dtype)
    off = at = 0
    for p in parents:
        first = (-off) % stride  # the same elements as words[::stride]
        piece = p[first::stride]
        ps[at : at + piece.size] = piece
        at += piece.size
        off += p.size
    key = exponent(ps[:at], dt).astype(np.intp)
    key *= nbits
    key += bitlen(ws[:at])
    joint = np.bincount(key, minlength=256 * nbits)
    return joint.reshape(256, nbits) * (n / max(at, 1))


def choose_bounds(joint: np.ndarray, n: int, max_classes: int) -> list[int]:
    """Partition the parent's exponent range into <= max_classes contiguous classes.

    Start with one class per exponent value present; repeatedly merge the adjacent pair whose
    union costs the fewest extra bits, where cost = n * entropy of the code words' bit lengths
    (`joint`, from bitlen_histogram: a proxy for how differently the two classes' deltas are
    distributed); classes smaller than MIN_CLASS_ELEMS / MIN_CLASS_FRACTION of the segment's n
    elements are merged first.
    """
    min_size = max(MIN_CLASS_ELEMS, int(n * MIN_CLASS_FRACTION))
    if max_classes <= 1 or n < 2 * min_size:
        return []
    present = np.flatnonzero(joint.sum(axis=1))
    values = [int(v) for v in present]
    groups = [joint[v].tolist() for v in present]
    sizes = [sum(g) for g in groups]
    costs = [xlogx(g) for g in groups]

    def add(a, b):
        return [x + y for x, y in zip(a, b)]

    merged = [xlogx(add(groups[i], groups[i + 1])) - costs[i] - costs[i + 1] for i in range(len(groups) - 1)]

    while len(groups) > 1:  # merged[i]: extra bits for merging groups i and i+1 (kept up to date)
        small = [i for i, sz in enumerate(sizes) if sz < min_size]
        if small:
            i = min(small, key=lambda j: sizes[j])
            j = min((j for j in (i - 1, i) if 0 <= j < len(groups) - 1), key=lambda j: merged[j])
        else:
            j = min(range(len(groups) - 1), key=lambda j: merged[j])
            if len(groups) <= max_classes and merged[j] >= MERGE_TOL_BITS * n:
                break
        groups[j] = add(groups[j], groups[j + 1])
        sizes[j] += sizes[j + 1]
        costs[j] = xlogx(groups[j])
        del groups[j + 1], sizes[j + 1], costs[j + 1], values[j + 1], merged[j]
        for i in (j - 1, j):
            if 0 <= i < len(groups) - 1:
                merged[i] = xlogx(add(groups[i], groups[i + 1])) - costs[i] - costs[i + 1]
    return values[1:]


# A tensor's mean exponent (for the order) is taken over an evenly strided sample of at most this
# many of its elements.
MEAN_SAMPLE = 4096


def mean_exponent(w: np.ndarray, dt: Dtype) -> float:
    if not w.size:
        return 0.0
    e = exponent(w[:: max(1, w.size // MEAN_SAMPLE)], dt)
    return int(np.add.reduce(e, dtype=np.uint64)) / e.size


def mean_exponents(words: dict[int, np.ndarray], idx: list[int], dt: Dtype) -> dict[int, float]:
    """mean_exponent of each tensor, with one exponent pass and one reduceat over all the tensors'
    samples gathered into one array (the same values: integer sums divided by the sample sizes)."""
    pieces = [words[i][:: max(1, words[i].size // MEAN_SAMPLE)] for i in idx]
    sizes = np.array([x.size for x in pieces], dtype=np.intp)
    if not sizes.size or not sizes.all():
        return {i: mean_exponent(words[i], dt) for i in idx}
    e = exponent(np.concatenate(pieces), dt)
    starts = np.zeros(sizes.size, np.intp)
    np.cumsum(sizes[:-1], out=starts[1:])
    sums = np.add.reduceat(e, starts, dtype=np.uint64)
    return {i: int(sm) / int(sz) for i, sm, sz in zip(idx, sums, sizes)}


def order_and_segments(words: dict[int, np.ndarray], idx: list[int], dt: Dtype,
                       split: bool) -> tuple[list[int], list[int]]:
    """Tensor order (by mean exponent, so similar-magnitude tensors are adjacent: LoRA A and B
    matrices differ by ~6 binades) and, if `split`, a cut into two segments at the tensor boundary
    that best separates the two populations (Otsu on the size-weighted per-tensor mean exponent)."""
    sizes = {i: words[i].size for i in idx}
    means = mean_exponents(words, idx, dt)
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


def encode_payload(
    kind: int,
    specs: Sequence[Any],
    tensors: Mapping[str, Any],
    parent: Mapping[str, Any] | None,
    level: int,
    max_classes: int,
) -> bytes:
    infos = checked_specs(specs)
    for name, _, _ in infos:
        if name not in tensors:
            raise ValueError(f"missing tensor {name!r}")
        if parent is not None and name not in parent:
            raise ValueError(f"parent lacks tensor {name!r}")
    cctx = compressor(level)
    header = bytearray(MAGIC)
    groups = dtype_groups(infos)
    header += struct.pack("<BBIB", FORMAT, kind, tensors_crc(infos, tensors), len(groups))
    frames: list[bytes] = []
    for dtname, idx in groups:
        dt = DTYPES[dtname]
        cur_parts = {i: as_words(tensors[infos[i][0]], dt, infos[i][2], infos[i][0], untrusted=False) for i in idx}
        n = sum(infos[i][2] for i in idx)
        words = np.empty(n, dt.word)
        # Tensor by tensor into one buffer (no group-sized temporaries: they would cost page faults).
        if kind == KIND_KEYFRAME:
            order, seg_counts = order_and_segments(cur_parts, idx, dt, split=False)
            off = 0
            for i in order:
                words[off : off + infos[i][2]] = rotl1(cur_parts[i], dt.bits)
                off += infos[i][2]
        else:
            par_parts = {
                i: as_words(parent[infos[i][0]], dt, infos[i][2], "parent " + infos[i][0], untrusted=False) for i in idx
            }
            order, seg_counts = order_and_segments(par_parts, idx, dt, split=max_classes > 1)
            off = 0
            for i in order:
                np.subtract(cur_parts[i], par_parts[i], out=words[off : off + infos[i][2]])
                off += infos[i][2]
            zigzag_inplace(words, dt.bits)
        header += struct.pack(f"<BI{len(order)}IB", dt.code, len(order), *order, len(seg_counts))
        off = t = 0
        for cnt in seg_counts:
            n_seg = sum(infos[i][2] for i in order[t : t + cnt])
            t += cnt
            w_seg = words[off : off + n_seg]
            seg = order[t - cnt : t]
            joint = None if kind == KIND_KEYFRAME else bitlen_histogram([par_parts[i] for i in seg], w_seg, dt)
            bounds: list[int] = [] if joint is None else choose_bounds(joint, n_seg, max_classes)
            if bounds:
                members = gather_classes(w_seg, class_ids([par_parts[i] for i in seg], bounds, dt), len(bounds) + 1)
            else:
                members = [w_seg]
            off += n_seg
            header += struct.pack(f"<IB{len(bounds)}H", cnt, len(members), *bounds)
            edges = [0, *bounds, 256]
            for k in range(len(members)):
                # Share of code words of at most one bit in this class (from the histogram: free).
                rows = None if joint is None else joint[edges[k] : edges[k + 1]]
                small = None if rows is None else float(rows[:, :2].sum() / max(rows.sum(), 1.0))
                wk, members[k] = members[k], None  # each class is freed once compressed (bounded peak)
                layout, fr = compress_class(wk, dt, cctx, try_fields=kind == KIND_DELTA, small_codes=small)
                del wk
                header += struct.pack(f"<B{len(fr)}I", layout, *(len(f) for f in fr))
                frames.extend(fr)
    return b"".join([header, *frames])


def compressor(level: int) -> zstd.ZstdCompressor:
    tuned = {"hash_log": FAST_TABLE_LOG, "chain_log": FAST_TABLE_LOG} if level == 1 else {}
    params = zstd.ZstdCompressionParameters.from_level(level, write_content_size=True, write_checksum=False, **tuned)
    return zstd.ZstdCompressor(compression_params=params)


def encode_keyframe(specs: Sequence[Any], tensors: Mapping[str, Any], *, level: int = DEFAULT_LEVEL) -> bytes:
    """Self-contained payload for `tensors` (name -> raw little-endian bytes of `spec.dtype`)."""
    return encode_payload(KIND_KEYFRAME, specs, tensors, None, level, 1)


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
    return encode_payload(KIND_DELTA, specs, tensors, parent, level, max(1, min(int(max_classes), MAX_DECODE_CLASSES)))


# --------------------------------------------------------------------------------------- encoder state


class AdapterEncoder:
    """Stateful publisher-side encoder: a keyframe for the first version, whenever the tensor
    layout changes, for every version divisible by `keyframe_every`, and whenever `keyframe_every`
    versions have passed since the last keyframe (the publisher may skip versions, so a multiple
    can be missed; chains stay at most `keyframe_every` long); otherwise a delta against the
    previously *encoded* version (which is all it keeps)."""

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
        infos = checked_specs(specs)
        layout = tuple((name, dt, tuple(s.shape)) for (name, dt, _), s in zip(infos, specs))
        if self._prev is not None and version <= self._prev[0]:
            raise ValueError(f"version {version} does not follow {self._prev[0]}")
        snapshot = {name: bytes(tensors[name]) for name, _, _ in infos}
        prev = self._prev
        if (prev is None or prev[1] != layout or version % self.keyframe_every == 0
                or version - self.last_keyframe_version >= self.keyframe_every):
            payload = encode_keyframe(specs, snapshot, level=self.level)
            enc = EncodedAdapter(KEYFRAME_CODEC, None, payload, raw_size(specs))
            self.last_keyframe_version = version
        else:
            payload = encode_delta(specs, snapshot, prev[2], level=self.level)
            enc = EncodedAdapter(DELTA_CODEC, prev[0], payload, raw_size(specs))
        self._prev = (version, layout, snapshot)
        return enc
