"""Decoding: any payload back to the exact bytes that were encoded, trusting nothing.

Sizes come from the specs (checked against `max_raw_bytes` before any decompression), every zstd
frame must declare its exact content size (checked before zstd allocates anything), and any
inconsistency raises ProtocolError (MALFORMED, PAYLOAD_TOO_LARGE, or HASH_MISMATCH for a crc32
mismatch) — never another exception. A delta class's element count is read from its frames'
declared sizes; the counts must add up to the segment (MALFORMED, before anything is allocated for
them) and match the parent's exponent classes element by element (HASH_MISMATCH otherwise: a delta
applied to the wrong parent).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import zstandard as zstd

from ..errors import ProtocolError, RejectCode
from .format import (
    DELTA_CODEC,
    DTYPES,
    KEYFRAME_CODEC,
    KIND_DELTA,
    KIND_KEYFRAME,
    LAYOUT_BYTES,
    MAX_WINDOW,
    as_words,
    checked_specs,
    dtype_groups,
    malformed,
    parse_header,
    tensors_crc,
)
from .planes import (
    class_ids,
    plane_sizes,
    rotr1,
    scatter_classes,
    unpack,
)


def unzstd(dctx: zstd.ZstdDecompressor, frame: memoryview, expected: int, max_raw_bytes: int) -> bytes:
    try:
        declared = zstd.frame_content_size(frame)
    except zstd.ZstdError as exc:
        raise malformed(f"bad zstd frame header: {exc}") from None
    if declared < 0:
        raise malformed("zstd frame does not declare its content size")
    if declared > max_raw_bytes:
        raise ProtocolError(RejectCode.PAYLOAD_TOO_LARGE, f"zstd frame expands to {declared} bytes > {max_raw_bytes}")
    if declared != expected:
        raise malformed(f"zstd frame expands to {declared} bytes, expected {expected}")
    try:
        out = dctx.decompress(frame, max_output_size=expected, allow_extra_data=False)
    except zstd.ZstdError as exc:
        raise malformed(f"corrupt zstd frame: {exc}") from None
    if len(out) != expected:
        raise malformed(f"zstd frame produced {len(out)} bytes, expected {expected}")
    return out


def class_size(buf: memoryview, pos: int, lens, layout: int) -> int:
    """Element count of a class, from the declared content size of its first whole-byte plane (the
    first plane for byte planes, the fifth for bit fields); `unzstd` later checks every frame."""
    skip = 0 if layout == LAYOUT_BYTES else 4
    start = pos + sum(lens[:skip])
    try:
        size = zstd.frame_content_size(buf[start : start + lens[skip]])
    except zstd.ZstdError as exc:
        raise malformed(f"bad zstd frame header: {exc}") from None
    if size < 0:
        raise malformed("zstd frame does not declare its content size")
    return size


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
        return decode_payload(codec, specs, payload, parent, max_raw_bytes)
    except ProtocolError:
        raise
    except MemoryError:
        raise ProtocolError(RejectCode.PAYLOAD_TOO_LARGE, "out of memory while decoding") from None
    except Exception as exc:  # safety net: input bytes never escape as another exception type
        raise malformed(f"undecodable adapter payload ({type(exc).__name__}: {exc})") from None


def decode_payload(codec, specs, payload, parent, max_raw_bytes) -> dict[str, bytes]:
    if codec == KEYFRAME_CODEC:
        kind = KIND_KEYFRAME
    elif codec == DELTA_CODEC:
        kind = KIND_DELTA
        if parent is None:
            raise malformed("delta payload needs its parent version")
    else:
        raise malformed(f"unknown codec {codec!r}")
    try:
        infos = checked_specs(specs)
    except (ValueError, TypeError, AttributeError) as exc:
        raise malformed(f"bad tensor specs: {exc}") from None
    total = sum(n * DTYPES[dt].itemsize for _, dt, n in infos)
    if total > max_raw_bytes:
        raise ProtocolError(RejectCode.PAYLOAD_TOO_LARGE, f"adapter is {total} raw bytes > {max_raw_bytes}")
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise malformed(f"payload must be bytes, got {type(payload).__name__}")
    buf = memoryview(payload).cast("B")
    pkind, crc, parsed, frames_start = parse_header(buf)
    if pkind != kind:
        raise malformed(f"payload kind {pkind} does not match codec {codec!r}")
    groups = dtype_groups(infos)
    if [g[0] for g in parsed] != [g[0] for g in groups]:
        raise malformed(f"payload dtype groups {[g[0] for g in parsed]} do not match the specs'")
    plan = []
    for (dtname, order, segs), (_, idx) in zip(parsed, groups):
        if sorted(order) != idx:
            raise malformed("tensor order is not a permutation of the group's specs")
        segments, t = [], 0
        for cnt, bounds, classes in segs:
            segments.append((sum(infos[i][2] for i in order[t : t + cnt]), (t, t + cnt), bounds, classes))
            t += cnt
        plan.append((DTYPES[dtname], order, segments))

    # Pass 2: decode.
    dctx = zstd.ZstdDecompressor(max_window_size=MAX_WINDOW)
    pos = frames_start
    out: dict[str, bytes] = {}
    for dt, order, segments in plan:
        sizes = [infos[i][2] for i in order]
        n = sum(sizes)
        parts = []  # the parent's words, in the group's order
        for i in order if kind == KIND_DELTA else ():
            name = infos[i][0]
            if name not in parent:
                raise malformed(f"parent lacks tensor {name!r}")
            parts.append(as_words(parent[name], dt, infos[i][2], "parent " + name, untrusted=True))
        words = None if len(segments) == 1 and len(segments[0][3]) == 1 else np.empty(n, dt.word)
        off = 0
        for seg_n, (first, last), bounds, classes in segments:
            # Each class's size is read from its frames (the plane of whole bytes has one byte per
            # element); together they must cover the segment, and scatter_classes checks them against
            # the parent's classes element by element.
            counts, at = [], pos
            for layout, lens in classes if len(classes) > 1 else ():
                counts.append(class_size(buf, at, lens, layout))
                at += sum(lens)
            counts = counts or [seg_n]
            if sum(counts) != seg_n:
                raise malformed(f"class sizes {counts} do not add up to the segment's {seg_n} elements")
            # A delta's code words are zigzag-decoded on the way: by unpack where the segment is one
            # class (written straight into `words`), by the scatter's own pass where there are classes.
            one = len(classes) == 1
            streams = []
            for cnt, (layout, lens) in zip(counts, classes):
                planes = []
                for ln, expected in zip(lens, plane_sizes(layout, cnt, dt)):
                    planes.append(unzstd(dctx, buf[pos : pos + ln], expected, max_raw_bytes))
                    pos += ln
                dest = None if not one or words is None else words[off : off + seg_n]
                streams.append(unpack(planes, layout, cnt, dt, unzigzag=one and kind == KIND_DELTA, out=dest))
            if words is None:
                words = streams[0]
            elif not one and not scatter_classes(words[off : off + seg_n], class_ids(parts[first:last], bounds, dt),
                                                 streams, unzigzag=kind == KIND_DELTA):
                raise ProtocolError(RejectCode.HASH_MISMATCH, "class sizes differ from the parent's exponent classes "
                                    "(delta applied to the wrong parent?)")
            streams = planes = None  # the segment is in `words` now; freed before the output is built
            off += seg_n
        off = 0
        for k, (i, size) in enumerate(zip(order, sizes)):
            w = words[off : off + size]
            if kind == KIND_KEYFRAME:
                w = rotr1(w, dt.bits)
            else:
                w += parts[k]  # the parent, tensor by tensor
            out[infos[i][0]] = w.tobytes()
            off += size
    if tensors_crc(infos, out) != crc:
        raise ProtocolError(
            RejectCode.HASH_MISMATCH,
            "decoded adapter fails its crc32" + (" (delta applied to the wrong parent?)" if kind == KIND_DELTA else ""),
        )
    return {name: out[name] for name, _, _ in infos}
