"""Content fingerprints: which weights a result was computed on.

A fingerprint is computed from bytes only, through a `CheckpointFiles` view, so a folder and its
S3 copy get the same value:

- the files are those an eval reads (`needed_files`: config, tokenizer, index, weights); markers,
  optimizer states and trainer logs do not count;
- each file gets a digest of its size and content; the checkpoint's fingerprint hashes the
  *set* of digests, names left out, so the naming fix's extra link to the same bytes (local
  folders only; S3 is fixed in the staged copy) changes nothing;
- `sampled` (the default) reads small files whole, a safetensors file's header whole, and
  `SAMPLED_BLOCKS` blocks of `BLOCK` bytes spread evenly through every larger file: about 1 MiB
  per weight file, ranged GETs on S3, never a download;
- `full` reads every byte (in `FULL_CHUNK` pieces, so memory stays bounded).

The value names its mode (`sampled:...`, `full:...`): the two modes never compare equal.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Literal

from ckpt_watcher.checkpoints.files import CheckpointFiles, needed_files

Mode = Literal["sampled", "full"]
SAMPLED_BLOCKS = 16
BLOCK = 64 * 1024
SMALL_FILE = 1 << 20  # files up to this size are read whole in either mode
FULL_CHUNK = 64 << 20


def fingerprint(files: CheckpointFiles, mode: Mode = "sampled") -> str:
    """The checkpoint's content fingerprint (`<mode>:<32 hex digits>`)."""
    sizes = files.files
    names = needed_files(sizes)
    if not names:
        raise FileNotFoundError("no files an eval reads: nothing to fingerprint")
    digests = sorted({file_digest(files, name, sizes[name], mode) for name in names})
    whole = hashlib.sha256(b"".join(digests)).hexdigest()[:32]
    return f"{mode}:{whole}"


def file_digest(files: CheckpointFiles, name: str, size: int, mode: Mode) -> bytes:
    """One file's digest: its size and (all or sampled) content."""
    h = hashlib.sha256(struct.pack("<Q", size))
    if size <= SMALL_FILE or mode == "full":
        for start in range(0, max(size, 1), FULL_CHUNK):
            h.update(files.read(name, start, min(FULL_CHUNK, size - start)))
        return h.digest()
    if name.endswith(".safetensors"):
        head = files.read(name, 0, 8)
        (n,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
        h.update(head + files.read(name, 8, min(n, size - 8)))
    for offset in sample_offsets(size):
        h.update(files.read(name, offset, BLOCK))
    return h.digest()


def sample_offsets(size: int) -> list[int]:
    """Where the sampled blocks start: the first and last block and evenly between."""
    last = max(0, size - BLOCK)
    return sorted({last * i // (SAMPLED_BLOCKS - 1) for i in range(SAMPLED_BLOCKS)})
