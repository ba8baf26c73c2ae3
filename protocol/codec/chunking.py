"""Chunking: a payload cut into fixed-size chunks, each named in the signed manifest by its sha256."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from ..errors import ProtocolError, RejectCode


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
