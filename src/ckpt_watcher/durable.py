"""Crash-safe file writes: a reader sees the old file or the new one, never half of one.

Write to a temporary name beside the target, flush, fsync, then `os.replace` (atomic on POSIX).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_atomic(path: Path, data: bytes | str) -> None:
    """Replace `path` with `data` atomically (tmp + fsync + rename). The temporary name is the
    writer's own (process and thread): two writers of one file at once (a task check that
    outlived a daemon killed -9, and the next daemon's) each replace it whole, where with one
    shared name the second found its file renamed away."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(
    path: Path, data: Any, default: Callable[[Any], Any] | None = None, indent: int | None = 2
) -> None:
    """`write_atomic` of `data` as JSON (non-ASCII kept as is)."""
    write_atomic(path, json.dumps(data, indent=indent, default=default, ensure_ascii=False))


def fsync_dir(folder: Path) -> None:
    """Make a new entry in `folder` durable (after creating a file in it)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
