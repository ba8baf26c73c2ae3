"""The adapter codec's wire format: constants, dtypes, the payload header (write and parse), `describe`.

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
(same-shaped) parent, which would otherwise decode to garbage silently. The parser checks everything
that does not need the specs, including that the frame lengths add up to exactly the payload.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ProtocolError, RejectCode

KEYFRAME_CODEC = "planes-zstd-v1"
DELTA_CODEC = "delta-zz-planes-zstd-v1"
CODECS = (KEYFRAME_CODEC, DELTA_CODEC)

# The decoder refuses more classes per segment than this (each costs it a pass over the segment).
MAX_DECODE_CLASSES = 16
MAGIC = b"ACDC"
FORMAT = 1
KIND_KEYFRAME = 0
KIND_DELTA = 1
LAYOUT_BYTES = 0
LAYOUT_FIELDS = 1
MAX_WINDOW = 1 << 27


@dataclass(frozen=True)
class Dtype:
    code: int
    itemsize: int
    word: np.dtype
    bits: int
    mant_bits: int  # explicit mantissa bits: exponent = (word >> mant_bits) & exp_mask
    exp_mask: int


DTYPES: dict[str, Dtype] = {
    "bf16": Dtype(0, 2, np.dtype("<u2"), 16, 7, 0xFF),
    "fp16": Dtype(1, 2, np.dtype("<u2"), 16, 10, 0x1F),
    "fp32": Dtype(2, 4, np.dtype("<u4"), 32, 23, 0xFF),
}
BY_CODE = {dt.code: name for name, dt in DTYPES.items()}
GROUP_ORDER = ("bf16", "fp16", "fp32")
# Bit-field layout: LSB-first field widths; fields narrower than a byte are packed across elements.
FIELDS = {16: (1, 1, 2, 4, 8), 32: (1, 1, 2, 4, 8, 8, 8)}


@dataclass(frozen=True)
class EncodedAdapter:
    """One published adapter version: `payload` decodes with `decode(codec, specs, payload, parent)`."""

    codec: str
    parent_version: int | None
    payload: bytes
    raw_bytes: int


def malformed(detail: str) -> ProtocolError:
    return ProtocolError(RejectCode.MALFORMED, detail)


def spec_info(spec: Any) -> tuple[str, str, int]:
    """(name, dtype, element count) of a spec; raises ValueError/TypeError on nonsense."""
    name, dtype, shape = spec.name, spec.dtype, tuple(spec.shape)
    if not isinstance(name, str):
        raise TypeError(f"tensor name must be str, got {type(name).__name__}")
    if dtype not in DTYPES:
        raise ValueError(f"tensor {name!r}: unsupported dtype {dtype!r}")
    n = 1
    for s in shape:
        if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 0:
            raise ValueError(f"tensor {name!r}: bad shape {shape!r}")
        n *= int(s)
    return name, dtype, n


def checked_specs(specs: Sequence[Any]) -> list[tuple[str, str, int]]:
    infos = [spec_info(s) for s in specs]
    names = [i[0] for i in infos]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in specs")
    return infos


def raw_size(specs: Sequence[Any]) -> int:
    """Total raw bytes of the tensors described by `specs`."""
    return sum(n * DTYPES[dt].itemsize for _, dt, n in checked_specs(specs))


def dtype_groups(infos: list[tuple[str, str, int]]) -> list[tuple[str, list[int]]]:
    """[(dtype, [spec indices])] in canonical dtype order, only dtypes that occur."""
    out = []
    for dt in GROUP_ORDER:
        idx = [i for i, info in enumerate(infos) if info[1] == dt]
        if idx:
            out.append((dt, idx))
    return out


def as_words(buf: Any, dt: Dtype, n: int, what: str, *, untrusted: bool) -> np.ndarray:
    mv = memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else buf
    if len(mv) != n * dt.itemsize:
        msg = f"{what}: {len(mv)} bytes, expected {n * dt.itemsize}"
        if untrusted:
            raise malformed(msg)
        raise ValueError(msg)
    return np.frombuffer(mv, dtype=dt.word)


def tensors_crc(infos, tensors: Mapping[str, Any]) -> int:
    crc = 0
    for name, _, _ in infos:
        crc = zlib.crc32(tensors[name], crc)
    return crc & 0xFFFFFFFF


class Reader:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise malformed(f"payload truncated at byte {self.pos} (wanted {n} more)")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))


def parse_header(buf: memoryview) -> tuple[int, int, list, int]:
    """(kind, crc32, [(dtype, order, [(ntensors, bounds, [(layout, frame lengths)])])], frames offset).

    Checks everything that does not need the specs, including that the frame lengths add up to
    exactly the rest of the payload."""
    rd = Reader(buf)
    magic, fmt, kind, crc, ngroups = rd.unpack("<4sBBIB")
    if magic != MAGIC or fmt != FORMAT:
        raise malformed("not an adapter codec payload (magic/format)")
    if kind not in (KIND_KEYFRAME, KIND_DELTA):
        raise malformed(f"unknown payload kind {kind}")
    groups, frame_bytes = [], 0
    for _ in range(ngroups):
        code, ntens = rd.unpack("<BI")
        if code not in BY_CODE:
            raise malformed(f"unknown dtype code {code}")
        dt = DTYPES[BY_CODE[code]]
        if ntens > len(buf):  # each tensor takes 4 header bytes: refuse absurd counts before reading
            raise malformed(f"tensor count {ntens} exceeds the payload")
        order = list(rd.unpack(f"<{ntens}I"))
        (nseg,) = rd.unpack("<B")
        segments, t = [], 0
        for _ in range(nseg):
            cnt, ncls = rd.unpack("<IB")
            if cnt < 1 or t + cnt > ntens:
                raise malformed(f"bad segment size {cnt}")
            t += cnt
            if ncls < 1 or ncls > MAX_DECODE_CLASSES or (kind == KIND_KEYFRAME and ncls != 1):
                raise malformed(f"bad class count {ncls}")
            bounds = list(rd.unpack(f"<{ncls - 1}H"))
            if any(b < 1 or b > dt.exp_mask for b in bounds) or any(x >= y for x, y in zip(bounds, bounds[1:])):
                raise malformed(f"bad class bounds {bounds}")
            classes = []
            for _ in range(ncls):
                (layout,) = rd.unpack("<B")
                if layout not in (LAYOUT_BYTES, LAYOUT_FIELDS):
                    raise malformed(f"unknown plane layout {layout}")
                nplanes = dt.itemsize if layout == LAYOUT_BYTES else len(FIELDS[dt.bits])
                lens = rd.unpack(f"<{nplanes}I")
                frame_bytes += sum(lens)
                classes.append((layout, lens))
            segments.append((cnt, bounds, classes))
        if t != ntens:
            raise malformed("segments do not cover the group's tensors")
        groups.append((BY_CODE[code], order, segments))
    if rd.pos + frame_bytes != len(buf):
        raise malformed("frame lengths do not add up to the payload size")
    return kind, crc, groups, rd.pos


def describe(payload: bytes) -> dict:
    """Human/bench-readable summary of a payload's structure (kind, per dtype group: segments,
    their exponent class bounds, and each class's layout and compressed bytes).
    Raises ProtocolError(MALFORMED) for anything that is not a well-formed payload header."""
    try:
        kind, crc, groups, start = parse_header(memoryview(payload).cast("B"))
    except ProtocolError:
        raise
    except Exception as exc:
        raise malformed(f"undecodable adapter payload ({type(exc).__name__}: {exc})") from None
    return {
        "kind": "keyframe" if kind == KIND_KEYFRAME else "delta",
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
                            {"layout": "bytes" if lay == LAYOUT_BYTES else "fields", "bytes": sum(lens)}
                            for lay, lens in classes
                        ],
                    }
                    for cnt, bounds, classes in segs
                ],
            }
            for dtname, order, segs in groups
        ],
    }
