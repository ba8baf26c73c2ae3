"""Durable files: a reader sees the old file or the new one, never half of one — and after the call
returns, a power cut keeps the new one.

The one writer every state, status, key, checkpoint, journal and outbox file goes through: write a
hidden temp file next to the target (per process and thread, so two writers never share one), fsync
it, rename it over the target, fsync the directory (without that, the rename itself can be lost).
An ack that depends on bytes being on disk (the ingest journal, the client outbox) relies on this.

Append-only logs (contribution receipts on both sides: protocol/receipts.py) use `append_record` /
`read_records`: each record is `u32 length | bytes`, appended and fsynced before the call returns.
A crash mid-append leaves a torn last record; `read_records` stops before it and `append_record`
cuts it off first, so a log is always a sequence of whole records.

It lives in `protocol/` because the bottom layer needs it too (Identity key files) and `protocol`
imports nothing of ours.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory `path` (a rename into it, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str | os.PathLike, data: bytes | str, *, mode: int | None = None) -> None:
    """Write `data` to a new file at `path` and fsync it (no rename: for files inside a temp folder
    that is itself renamed into place, as checkpoints are)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o666 if mode is None else mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    if mode is not None:
        os.chmod(path, mode)  # umask may have narrowed it; a key file must be exactly `mode`


def write_atomic(path: str | os.PathLike, data: bytes | str, *, mode: int | None = None) -> Path:
    """Atomically replace `path` with `data` (temp + fsync + rename + fsync of the directory)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        write_durable(tmp, data, mode=mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_json_atomic(path: str | os.PathLike, obj: Any, *, indent: int | None = None) -> Path:
    return write_atomic(path, json.dumps(obj, indent=indent))


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """The JSON a `write_json_atomic` left at `path`, or `default` when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def is_temp(path: Path) -> bool:
    """True for a temp file `write_atomic` left behind (a crash between write and rename)."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


RECORD_HEADER = 4
MAX_RECORD_BYTES = 1 << 20


def read_records(path: str | os.PathLike, *, offset: int = 0,
                 max_record_bytes: int = MAX_RECORD_BYTES) -> tuple[list[bytes], int]:
    """(whole records from byte `offset` on, the offset where they end) of an `append_record` log;
    ([], offset) when it is missing. A torn or oversized tail record ends the log there (the caller may
    cut it off). `offset` must be a record boundary an earlier call returned."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    records, at = [], 0
    while at + RECORD_HEADER <= len(data):
        n = int.from_bytes(data[at:at + RECORD_HEADER], "big")
        if n > max_record_bytes or at + RECORD_HEADER + n > len(data):
            break
        records.append(data[at + RECORD_HEADER:at + RECORD_HEADER + n])
        at += RECORD_HEADER + n
    return records, offset + at


def append_record(path: str | os.PathLike, record: bytes, *, good_length: int | None = None) -> int:
    """Append one record durably (write + fsync; the directory too when the file is new). `good_length`:
    where the whole records end, from `read_records`; a longer file (a torn append) is cut there first.
    Returns the new length."""
    path = Path(path)
    if len(record) > MAX_RECORD_BYTES:
        raise ValueError(f"record of {len(record)} bytes > {MAX_RECORD_BYTES}")
    new = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        if good_length is not None and os.fstat(fd).st_size > good_length:
            os.ftruncate(fd, good_length)
        view = memoryview(len(record).to_bytes(RECORD_HEADER, "big") + record)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if new:
        fsync_dir(path.parent)
    return size
