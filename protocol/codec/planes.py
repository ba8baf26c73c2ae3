"""Word transforms shared by the encoder and the decoder: bit rotation, zigzag deltas, exponent
classes (and the stable partition of a segment by class), and the two plane layouts (byte planes;
bit fields 1-1-2-4-8...), each plane one zstd frame.

Speed notes (docs/codec.md has the figures). Everything is whole-array numpy; no Python loop runs
per element. Per element the delta path costs a handful of integer ufunc passes (numpy's fastest
operations: add, multiply, and, or, shifts by a constant on uint16/32/64), one table-free stable
partition by class, one zstd pass and one crc32 pass. The partition and its inverse, the class of
each parent element and the decoder's plane unpacking run in the compiled `_kernels` module when it
was built (one pass each where numpy makes several: the delta decode is memory-bound, so passes are
what cost); without it they fall back to the numpy code, which writes and reads the same bytes.
Two habits keep the numpy code fast:
- no strided copies and no uint8 left shifts (numpy runs both ~10x slower than a cast or a
  multiply), no `np.take` on a lookup table (it widens every uint8 index to intp first);
- temporaries of the partition live in buffers of CLASS_CHUNK elements that are reused, because a
  fresh multi-MiB allocation costs page faults (kernel time) worth more than the work itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import zstandard as zstd

from .format import (
    FIELDS,
    LAYOUT_BYTES,
    LAYOUT_FIELDS,
    Dtype,
)

try:  # protocol/codec/_kernels.c, built by `pip install` where a C compiler exists (setup.py: optional)
    from . import _kernels as KERNELS
except ImportError:  # pragma: no cover - exercised by the tests through `use_kernels(False)`
    KERNELS = None


def use_kernels(on: bool) -> None:
    """Switch the compiled kernels on or off (tests and bench/codec.py compare the two paths). Off
    is the numpy path; on needs the module to have been built (ImportError otherwise)."""
    global KERNELS
    if on:
        from . import _kernels
        KERNELS = _kernels
    else:
        KERNELS = None


def rotl1(w: np.ndarray, bits: int) -> np.ndarray:
    return (w << w.dtype.type(1)) | (w >> w.dtype.type(bits - 1))


def rotr1(w: np.ndarray, bits: int) -> np.ndarray:
    return (w >> w.dtype.type(1)) | (w << w.dtype.type(bits - 1))


ZIGZAG_CHUNK = 1 << 18  # the zigzag passes run this many words at a time, with one reusable temporary


def zigzag_inplace(d: np.ndarray, bits: int) -> np.ndarray:
    """d: unsigned wrap-around difference -> zigzag code (small |d| -> small code), in place."""
    s = d.view(np.dtype(f"<i{bits // 8}"))
    shift = s.dtype.type(bits - 1)
    sign = np.empty(min(s.size, ZIGZAG_CHUNK), s.dtype)
    for c0 in range(0, s.size, ZIGZAG_CHUNK):
        sc, tc = s[c0 : c0 + ZIGZAG_CHUNK], sign[: min(ZIGZAG_CHUNK, s.size - c0)]
        np.right_shift(sc, shift, out=tc)  # 0 or -1
        sc += sc
        sc ^= tc
    return d


def unzigzag_inplace(w: np.ndarray) -> np.ndarray:
    """Zigzag code -> wrap-around difference, in place, ZIGZAG_CHUNK words at a time."""
    one = w.dtype.type(1)
    sign = np.empty(min(w.size, ZIGZAG_CHUNK), w.dtype)
    for c0 in range(0, w.size, ZIGZAG_CHUNK):
        wc = w[c0 : c0 + ZIGZAG_CHUNK]
        sc = sign[: wc.size]
        np.bitwise_and(wc, one, out=sc)
        np.negative(sc, out=sc)
        wc >>= one
        wc ^= sc
    return w


def exponent(w: np.ndarray, dt: Dtype) -> np.ndarray:
    e = w >> w.dtype.type(dt.mant_bits)
    if dt.exp_mask != 0xFF:
        e &= w.dtype.type(dt.exp_mask)
    return e.astype(np.uint8)  # bf16/fp32: the sign sits just above the 8 exponent bits and is cut off


def class_ids(parents: Sequence[np.ndarray], bounds: Sequence[int], dt: Dtype) -> np.ndarray:
    """Class of each element of the concatenated `parents` (word arrays, e.g. a segment's tensors):
    how many bounds are <= its exponent, as uint8. exponent >= b exactly when the magnitude bits are
    >= b << mant_bits, so no exponent array is built; one compare per bound, tensor by tensor (no
    segment-sized temporaries); the compiled kernel does all bounds in one pass."""
    n = sum(p.size for p in parents)
    cls = np.empty(n, np.uint8)
    if KERNELS is not None:
        KERNELS.classes(cls, parents, [b << dt.mant_bits for b in bounds])
        return cls
    mag = parents[0].dtype.type((1 << (dt.bits - 1)) - 1) if parents else None
    limits = [parents[0].dtype.type(b << dt.mant_bits) for b in bounds] if parents else []
    off = 0
    for p in parents:
        m = p & mag
        c = cls[off : off + p.size]
        if limits:
            np.greater_equal(m, limits[0], out=c.view(np.bool_))
            for lim in limits[1:]:
                c += (m >= lim).view(np.uint8)
        else:
            c[:] = 0
        off += p.size
    return cls


# ---- the stable partition of a segment by class (encoder: gather; decoder: scatter back) ----------
#
# Class k's stream is the segment's class-k elements in their original order. Both directions work
# CLASS_CHUNK elements at a time, so their temporaries stay small and are reused.
#
# Each element's slot in "[spare] + the chunk's class-0 members + class-1 members + ..." comes from
# ONE cumulative sum: element i adds 1 to the 16-bit lane of its class in a uint64, so lane k of the
# running sum counts the class-k elements so far; adding each lane's start and reading the element's
# own lane gives its slot. The encoder scatters the chunk to its slots, the decoder gathers from
# them. Up to LANE_CLASSES classes fit in the lanes (the encoder never uses more); a header may name
# up to 16 and the decoder takes a per-class `flatnonzero` path for those.
LANE_CLASSES = 4
CLASS_CHUNK = (1 << 16) - 2  # a lane counts up to CLASS_CHUNK + 1 without reaching the next lane
_LANE = np.uint8(16)
_LANE_MASK = np.uint64(0xFFFF)


class _Lanes:
    """Reusable chunk buffers for the slot computation."""

    def __init__(self) -> None:
        self.acc = np.empty(CLASS_CHUNK, np.uint64)
        self.shift = np.empty(CLASS_CHUNK, np.uint64)

    def counts(self, cc: np.ndarray) -> list[int]:
        """Per-class member counts of the chunk; leaves the running lane sums in self.acc."""
        s, sh = self.acc[: cc.size], self.shift[: cc.size]
        np.copyto(sh, cc * _LANE, casting="unsafe")  # 16 * class: a uint8 multiply, then one widening copy
        np.left_shift(np.uint64(1), sh, out=s)
        np.cumsum(s, out=s)
        total = int(s[-1])
        return [(total >> (16 * k)) & 0xFFFF for k in range(LANE_CLASSES)]

    def slots(self, m: int, counts: Sequence[int]) -> np.ndarray:
        """After counts(): each element's slot (1..m) in [spare] + class 0 members + class 1 ..."""
        s, sh = self.acc[:m], self.shift[:m]
        lanes, at = 0, 0
        for k, c in enumerate(counts):
            lanes |= at << (16 * k)
            at += c
        s += np.uint64(lanes)
        np.right_shift(s, sh, out=s)
        s &= _LANE_MASK
        return s.view(np.int64)


def gather_classes(w: np.ndarray, cls: np.ndarray, nclasses: int) -> list[np.ndarray]:
    """The elements of each class, in their original order: a stable partition of `w` by `cls`.
    The class sizes come first (one uint8 compare and count per class), so each chunk's members are
    copied once, straight into their class's array (no pieces to concatenate: the peak stays at
    one copy of the segment)."""
    out = [np.empty(int(np.count_nonzero(cls == np.uint8(k))), w.dtype) for k in range(nclasses)]
    if KERNELS is not None:
        KERNELS.partition(w, cls, out)
        return out
    pos = [0] * nclasses
    lanes = _Lanes() if nclasses <= LANE_CLASSES else None
    buf = np.empty(CLASS_CHUNK + 1, w.dtype)
    for c0 in range(0, w.size, CLASS_CHUNK):
        cc, wc = cls[c0 : c0 + CLASS_CHUNK], w[c0 : c0 + CLASS_CHUNK]
        if lanes is None:  # more classes than lanes (max_classes > 4): one compress per class
            for k in range(nclasses):
                m = cc == np.uint8(k)
                c = int(np.count_nonzero(m))
                np.compress(m, wc, out=out[k][pos[k] : pos[k] + c])
                pos[k] += c
            continue
        chunk = lanes.counts(cc)[:nclasses]
        buf[lanes.slots(cc.size, chunk)] = wc
        at = 1
        for k, c in enumerate(chunk):
            out[k][pos[k] : pos[k] + c] = buf[at : at + c]
            pos[k] += c
            at += c
    return out


def scatter_classes(out: np.ndarray, cls: np.ndarray, streams: Sequence[np.ndarray], unzigzag: bool = False) -> bool:
    """Inverse of gather_classes: out[i] = the next unused element of streams[cls[i]], zigzag-decoded
    if `unzigzag` (in the same pass when compiled). False (with `out` partly written) unless every
    stream is used up exactly: the stream sizes come from the payload, the classes from the parent,
    and the two must agree."""
    if KERNELS is not None:
        return KERNELS.unpartition(out, cls, streams, unzigzag)
    if not _scatter_numpy(out, cls, streams):
        return False
    if unzigzag:
        unzigzag_inplace(out)
    return True


def _scatter_numpy(out: np.ndarray, cls: np.ndarray, streams: Sequence[np.ndarray]) -> bool:
    """scatter_classes in numpy: the lanes for up to LANE_CLASSES classes, flatnonzero beyond."""
    pos = [0] * len(streams)
    lanes = _Lanes() if len(streams) <= LANE_CLASSES else None
    src = np.empty(CLASS_CHUNK + 1, out.dtype)
    for c0 in range(0, out.size, CLASS_CHUNK):
        cc, oc = cls[c0 : c0 + CLASS_CHUNK], out[c0 : c0 + CLASS_CHUNK]
        if lanes is None:  # more classes than lanes: one flatnonzero per class
            for k, stream in enumerate(streams):
                idx = np.flatnonzero(cc == np.uint8(k))
                if pos[k] + idx.size > stream.size:
                    return False
                oc[idx] = stream[pos[k] : pos[k] + idx.size]
                pos[k] += idx.size
            continue
        chunk = lanes.counts(cc)[: len(streams)]
        if sum(chunk) != cc.size:  # an element of a class with no stream (its lane is cut off above)
            return False
        at = 1
        for k, c in enumerate(chunk):
            if pos[k] + c > streams[k].size:
                return False
            src[at : at + c] = streams[k][pos[k] : pos[k] + c]
            pos[k] += c
            at += c
        np.take(src, lanes.slots(cc.size, chunk), out=oc, mode="clip")  # slots are in range by construction
    return all(p == s.size for p, s in zip(pos, streams))


# ---- plane layouts --------------------------------------------------------------------------------


def plane_sizes(layout: int, n: int, dt: Dtype) -> list[int]:
    if layout == LAYOUT_BYTES:
        return [n] * dt.itemsize
    return [-(-n * w // 8) if w < 8 else n for w in FIELDS[dt.bits]]


def byte_plane(w: np.ndarray, j: int) -> np.ndarray:
    """Byte j of every word (least significant = 0): a cast, or a shift written straight into the
    uint8 plane (numpy buffers the cast: no word-sized temporary)."""
    if not j:
        return w.astype(np.uint8)
    return np.right_shift(w, w.dtype.type(8 * j), out=np.empty(w.size, np.uint8), casting="unsafe")


def _padded(v: np.ndarray, per: int) -> np.ndarray:
    pad = (-v.size) % per
    return np.concatenate([v, np.zeros(pad, np.uint8)]) if pad else v


def pack(w: np.ndarray, layout: int, dt: Dtype) -> list[np.ndarray]:
    return list(iter_planes(w, layout, dt))


def iter_planes(w: np.ndarray, layout: int, dt: Dtype) -> Iterator[np.ndarray]:
    """The planes of `layout`, one at a time: a caller that compresses each before asking for the
    next holds one plane (and its temporaries), not all of them."""
    if layout == LAYOUT_BYTES:
        for j in range(dt.itemsize):
            yield byte_plane(w, j)
        return
    lo = w.astype(np.uint8)  # bits 0-7 of every word; the fields are cut from it
    yield np.packbits(lo & np.uint8(1), bitorder="little")
    yield np.packbits((lo >> np.uint8(1)) & np.uint8(1), bitorder="little")
    # Bits 2-3 of 4 consecutive words into one byte: a little-endian uint32 view holds the 4 fields at
    # bits 0, 8, 16, 24; x | x >> 6 puts field 1 beside field 0 (and 3 beside 2), | >> 12 brings
    # fields 2-3 down, and the cast keeps the low byte.
    x = _padded((lo >> np.uint8(2)) & np.uint8(3), 4).view("<u4")
    x |= x >> np.uint32(6)
    x |= x >> np.uint32(12)
    yield x.astype(np.uint8)
    del x
    # Bits 4-7 of 2 consecutive words, the same way through a uint16 view.
    y = _padded(lo >> np.uint8(4), 2).view("<u2")
    del lo
    y |= y >> np.uint16(4)
    yield y.astype(np.uint8)
    del y
    for j in range(1, dt.itemsize):
        yield byte_plane(w, j)


def unpack(planes: list[bytes], layout: int, n: int, dt: Dtype, *, unzigzag: bool = False,
           out: np.ndarray | None = None) -> np.ndarray:
    """The n words whose planes (of `layout`, as iter_planes cut them) are `planes`, zigzag-decoded
    when `unzigzag`; written into `out` (n words) when given. The compiled kernel does it in one pass;
    the numpy path below rebuilds the low byte, then the words, then unzigzags."""
    if out is None:
        out = np.empty(n, dt.word)
    if KERNELS is not None:
        KERNELS.unpack(out, layout == LAYOUT_FIELDS, planes, unzigzag)
        return out
    out[...] = _unpack_numpy(planes, layout, n, dt)
    return unzigzag_inplace(out) if unzigzag else out


def _unpack_numpy(planes: list[bytes], layout: int, n: int, dt: Dtype) -> np.ndarray:
    word = dt.word
    if layout == LAYOUT_BYTES:
        lo = np.frombuffer(planes[0], np.uint8)
        upper = planes[1:]
    else:
        # Bit fields (1, 1, 2, 4, then whole bytes): rebuild the low byte with integer ops on wider
        # views, one pass each, then the upper byte planes.
        lo = np.unpackbits(np.frombuffer(planes[0], np.uint8), count=n, bitorder="little")
        b1 = np.unpackbits(np.frombuffer(planes[1], np.uint8), count=n, bitorder="little")
        b1 += b1
        lo |= b1
        x = np.frombuffer(planes[2], np.uint8).astype("<u4")  # the packing above, backwards
        x |= x << np.uint32(12)
        x &= np.uint32(0x000F000F)
        x |= x << np.uint32(6)
        x &= np.uint32(0x03030303)
        x <<= np.uint32(2)
        lo |= x.view(np.uint8)[:n]
        y = np.frombuffer(planes[3], np.uint8).astype("<u2")
        y |= y << np.uint16(4)
        y &= np.uint16(0x0F0F)
        y <<= np.uint16(4)
        lo |= y.view(np.uint8)[:n]
        upper = planes[4:]
    # Most significant plane first, then w = w * 256 + the next plane down: one allocation, and
    # multiply/add are the fastest integer ufuncs numpy has at these widths.
    w = np.frombuffer(upper[-1], np.uint8).astype(word)
    for p in [*upper[-2::-1], lo]:
        w *= word.type(256)
        np.add(w, p if isinstance(p, np.ndarray) else np.frombuffer(p, np.uint8), out=w, casting="unsafe")
    return w


# The layout of a delta class follows from the share of its code words that are at most one bit
# long (0 or 1; the encoder reads it off its bit-length histogram): measured on bench/codec.py's
# trajectory, bit fields win by >= 30 % from a share of 0.83 up, byte planes by ~2 % at 0.58 and
# below. Between FIELDS_BELOW and FIELDS_ABOVE (and without a share) the class's strided sample (one
# element in LAYOUT_SAMPLE_STRIDE) is compressed both ways; classes of at most LAYOUT_SAMPLE_MIN
# elements are compressed both ways in full.
FIELDS_BELOW = 0.5
FIELDS_ABOVE = 0.8
LAYOUT_SAMPLE_MIN = 1 << 16
LAYOUT_SAMPLE_STRIDE = 8


def compress_class(w: np.ndarray, dt: Dtype, cctx: zstd.ZstdCompressor, try_fields: bool,
                   small_codes: float | None = None):
    """(layout, frames) for one class, in whichever layout compresses smaller."""
    layouts = (LAYOUT_BYTES, LAYOUT_FIELDS) if try_fields else (LAYOUT_BYTES,)
    if len(layouts) > 1 and w.size > LAYOUT_SAMPLE_MIN:
        if small_codes is not None and small_codes <= FIELDS_BELOW:
            layouts = (LAYOUT_BYTES,)
        elif small_codes is not None and small_codes >= FIELDS_ABOVE:
            layouts = (LAYOUT_FIELDS,)
        else:
            sample = w[::LAYOUT_SAMPLE_STRIDE]
            sizes = [sum(len(cctx.compress(p)) for p in iter_planes(sample, lay, dt)) for lay in layouts]
            layouts = (layouts[int(np.argmin(sizes))],)
    best = None
    for layout in layouts:
        frames = [cctx.compress(p) for p in iter_planes(w, layout, dt)]
        size = sum(len(f) for f in frames)
        if best is None or size < best[0]:
            best = (size, layout, frames)
    return best[1], best[2]
