"""A read-only view of one checkpoint's files, so the same completeness rules and naming-fix
plan apply to a local folder and to an S3 prefix (the I/O is passed in, the rules are shared)."""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Protocol

from ckpt_watcher.checkpoints.layouts import HF_META, listing, native_layout
from ckpt_watcher.errors import CheckpointChanged

# What an eval reads of a checkpoint (besides its weights): staged from S3, and fingerprinted.
NEEDED = HF_META | {"model.safetensors.index.json"}
# Any one of these is a tokenizer that transformers can load (with tokenizer_config.json or not).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


# The first line of every write mark: marks kept by a version that marked every file (no such
# line) are adopted on their next look rather than taken for a rewrite (discovery.py).
MARK_VERSION = "mark:2"


class CheckpointFiles(Protocol):
    @property
    def files(self) -> dict[str, int]:
        """Top-level file names -> sizes in bytes (listed once per view); for a trainer's
        native format also the files of its config folder, as `<folder>/<name>`
        (layouts.py)."""
        ...

    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        """Bytes of one file (a range of it); FileNotFoundError if it is not there."""
        ...

    def write_mark(self, names: list[str] | None = None) -> str:
        """Changes whenever a write lands in `names` (None: in any file): names, sizes, mtimes
        or ETags. Marks of one kind of view compare; a local folder's and an S3 prefix's never
        do."""
        ...

    def last_write(self) -> float | None:
        """When the newest top-level file was last modified (epoch seconds), if known."""
        ...


class LocalFiles:
    """A checkpoint folder on a local or network filesystem.

    A file symlink counts only if it resolves inside the checkpoint folder (the naming fix's own
    links do); a link leading elsewhere is never read, unless `follow_links` (a base model in the
    Hugging Face cache, whose snapshot files are links into its blob store).
    """

    def __init__(self, root: Path, follow_links: bool = False) -> None:
        self.root = root
        self.follow_links = follow_links

    @cached_property
    def files(self) -> dict[str, int]:
        return listing(self._level)

    def _level(self, prefix: str) -> dict[str, int]:
        """The files of the folder `prefix` ("" or `<relative path>/`) names, as `prefix<name>`."""
        folder = self.root / prefix
        out: dict[str, int] = {}
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            return out
        inside = folder.resolve()
        for e in entries:
            try:
                if (
                    not self.follow_links
                    and e.is_symlink()
                    and Path(e.path).resolve().parent != inside
                ):
                    continue
                if e.is_file():
                    out[prefix + e.name] = e.stat().st_size
            except OSError:
                continue  # deleted while we looked
        return out

    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        if name not in self.files:
            raise FileNotFoundError(name)
        with open(self.root / name, "rb") as f:
            f.seek(start)
            return f.read() if length is None else f.read(length)

    def last_write(self) -> float | None:
        times = []
        for name in self.files:
            try:
                times.append((self.root / name).stat().st_mtime)
            except OSError:
                continue
        return max(times, default=None)

    def write_mark(self, names: list[str] | None = None) -> str:
        paths = sorted(self.root.rglob("*")) if names is None else [self.root / n for n in names]
        parts = [MARK_VERSION]
        for p in paths:
            try:
                # a named file is what an eval reads: through the naming fix's symlink, if any
                st = p.lstat() if names is None else p.stat()
            except OSError:
                continue
            parts.append(f"{p.relative_to(self.root)}:{st.st_size}:{st.st_mtime_ns}")
        return "\n".join(parts)


def eval_files(files: dict[str, int]) -> list[str] | None:
    """The files whose writes move a checkpoint's write mark: those an eval reads, when they
    include weights (so a trainer's optimizer states, logs and markers written later are no
    change to the checkpoint); None (every file, subfolders too) for formats an eval reads no
    named weights of, which only a quiet folder can vouch for."""
    names = needed_files(files)
    weights = [n for n in names if n.endswith((".safetensors", ".bin"))]
    return names if weights or native_layout(files) is not None else None


def eval_mark(view: CheckpointFiles) -> str:
    """The view's write mark over `eval_files`."""
    return view.write_mark(eval_files(view.files))


def comparable(mark: str | None) -> bool:
    """A mark this version can compare (one kept by an earlier version marked other files)."""
    return mark is not None and mark.startswith(MARK_VERSION)


def check_unchanged(view: CheckpointFiles, mark: str | None, where: str) -> None:
    """Raise CheckpointChanged unless the files an eval reads in `view` are those `mark` was
    taken from. A mark this version cannot compare is taken as it is, and so are formats whose
    weights an eval does not read by name (their mark is the whole folder's, which a pinned or
    staged copy does not have)."""
    names = eval_files(view.files)
    if comparable(mark) and names is not None and view.write_mark(names) != mark:
        raise CheckpointChanged(f"{where}: its files changed after it was judged ready")


NOT_YET = "not written yet"  # the end of read_json's answer for a file not there yet


def read_json(files: CheckpointFiles, name: str) -> dict | str:
    """A JSON object file of the checkpoint, or what is wrong with it (it may still be being
    written)."""
    try:
        data = json.loads(files.read(name).decode("utf-8"))
    except FileNotFoundError:
        return f"{name} {NOT_YET}"
    except (OSError, UnicodeDecodeError, ValueError):
        return f"{name} does not parse (yet)"
    if not isinstance(data, dict):
        return f"{name} is not a JSON object"
    return data


def needed_files(files: dict[str, int]) -> list[str]:
    """The names an eval needs, out of a checkpoint's files (a native format's: what its
    conversion reads)."""
    layout = native_layout(files)
    if layout is not None:
        return layout.needed(files)
    names = {n for n in files if n in NEEDED or n.endswith(".safetensors")}
    if not any(n.endswith(".safetensors") for n in names):
        names |= {
            n
            for n in files
            if (n.startswith("pytorch_model") and n.endswith((".bin", ".json")))
            or n == "adapter_model.bin"
        }
    weights = [n for n in names if n.endswith((".safetensors", ".bin"))]
    if ADAPTER_CONFIG in files and weights and all(n in ADAPTER_WEIGHTS for n in weights):
        names.add(ADAPTER_CONFIG)  # an adapter saved alone (adapter.py); beside a model, not read
    return sorted(names)
