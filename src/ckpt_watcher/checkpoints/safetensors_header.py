"""Read a safetensors header without reading the data: the expected file size and tensor names.

Format: 8-byte little-endian header length N, N bytes of JSON mapping tensor names to
{dtype, shape, data_offsets: [begin, end]} (offsets relative to the end of the header),
then the data. A complete file is exactly 8 + N + max(end) bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_watcher.errors import HeaderUnreadable

if TYPE_CHECKING:
    from ckpt_watcher.checkpoints.files import CheckpointFiles

# The format caps headers at 100 MB; anything bigger is a corrupt length field.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class SafetensorsHeader:
    header_len: int
    tensors: frozenset[str]
    data_end: int
    # each tensor's entry ({dtype, shape, data_offsets}) and the `__metadata__` strings
    entries: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def expected_size(self) -> int:
        return 8 + self.header_len + self.data_end


def parse_header(prefix: bytes, header_len: int) -> SafetensorsHeader:
    """Parse a header from its JSON bytes (`prefix` = the N bytes after the length field)."""
    try:
        meta = json.loads(prefix.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise HeaderUnreadable(f"header is not valid JSON ({e.__class__.__name__})", True) from e
    if not isinstance(meta, dict):
        raise HeaderUnreadable("header is not a JSON object", True)
    end = 0
    names = []
    extra = meta.pop("__metadata__", None)
    for name, info in meta.items():
        try:
            begin, stop = info["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise HeaderUnreadable(f"tensor {name!r} has no valid data_offsets", True) from e
        if not (isinstance(begin, int) and isinstance(stop, int) and 0 <= begin <= stop):
            raise HeaderUnreadable(f"tensor {name!r} has invalid data_offsets", True)
        end = max(end, stop)
        names.append(name)
    return SafetensorsHeader(
        header_len, frozenset(names), end, meta, extra if isinstance(extra, dict) else {}
    )


def read_header(files: CheckpointFiles, name: str) -> SafetensorsHeader:
    """Read one file's header through a checkpoint view: two reads, 8 + N bytes in all."""
    raw = files.read(name, 0, 8)
    if len(raw) < 8:
        raise HeaderUnreadable("file is shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw)
    if n == 0 or n > MAX_HEADER_BYTES:
        raise HeaderUnreadable(f"header length {n} is not plausible", True)
    body = files.read(name, 8, n)
    if len(body) < n:
        raise HeaderUnreadable("header is cut short")
    return parse_header(body, n)


def read_local_header(path: Path) -> SafetensorsHeader:
    """Read the header of a local safetensors file."""
    from ckpt_watcher.checkpoints.files import LocalFiles

    return read_header(LocalFiles(path.parent), path.name)
