"""Durable files: a reader sees the old file or the new one, never half of one — and after the call
returns, a power cut keeps the new one.

The one writer every state, status, key, checkpoint, journal and outbox file goes through: write a
hidden temp file next to the target (per process and thread, so two writers never share one), fsync
it, rename it over the target, fsync the directory (without that, the rename itself can be lost).
An ack that depends on bytes being on disk (the ingest journal, the client outbox) relies on this.

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
