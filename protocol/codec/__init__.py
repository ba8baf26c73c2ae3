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

Package layout (the wire format is in format.py's docstring and docs/codec.md)::

    format.py    constants, dtypes, payload header write/parse, `describe`, `raw_size`
    planes.py    word transforms: bit rotation, zigzag, exponent classes, byte planes / bit fields
    encoder.py   `encode_keyframe`, `encode_delta` (one engine) and the stateful `AdapterEncoder`
    decoder.py   `decode`: any payload back to the exact bytes, trusting nothing
    chunking.py  `split_chunks`, `chunk_hashes`, `verify_chunk` (sha256 per chunk, in the manifest)

``decode`` raises ProtocolError only (MALFORMED, PAYLOAD_TOO_LARGE, HASH_MISMATCH), for any bytes.
"""

from .chunking import chunk_hashes, split_chunks, verify_chunk
from .decoder import decode
from .encoder import DEFAULT_LEVEL, MAX_CLASSES, AdapterEncoder, encode_delta, encode_keyframe
from .format import CODECS, DELTA_CODEC, KEYFRAME_CODEC, EncodedAdapter, describe, raw_size

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
