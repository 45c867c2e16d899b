"""What an engine needs of a checkpoint before its weights: the model's config, tokenizer and
generation files, once they are all there and whole. A trainer writes them first (Hugging Face
`save_pretrained` beside its shards, verl's `huggingface/` folder before its ranks' files), so
a run's model is known while its step is still being written (jobs/early.py). A LoRA step
saved alone names its base in its adapter config. A step on S3 is read through its listing
(`find_in`), and those files fetched to a folder of ours (`fetch`)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from ckpt_watcher.checkpoints.layouts import HF_META
from ckpt_watcher.durable import write_atomic

if TYPE_CHECKING:
    from ckpt_watcher.checkpoints.files import CheckpointFiles

CONFIG = "config.json"
ADAPTER = "adapter_config.json"  # a LoRA step saved alone: its base is the model
TOKENIZERS = ("tokenizer.json", "tokenizer_config.json")
# where a step's config sits, below the step's folder: its top, verl's (actor/)huggingface/
PLACES = ("", "huggingface", "actor/huggingface")
NAMES = HF_META | {"spiece.model"}
MAX_BYTES = 256 << 20  # a meta file larger than this is not one (nothing is fetched)
# an adapter's weights fetched ahead at most (a rank-64 adapter of a 70B model: 1.6 GB)
ADAPTER_MAX_BYTES = 8 << 30


def find(step: Path, tokenizer_required: bool = True) -> list[Path] | None:
    """The meta files of the step's model (config, tokenizer, generation config...) in the first
    place that has a whole set, else None. JSON files must parse: one being written is half
    written for a moment."""
    for place in PLACES:
        files = _whole(step / place if place else step, tokenizer_required)
        if files is not None:
            return files
    return None


def _whole(folder: Path, tokenizer_required: bool) -> list[Path] | None:
    try:
        names = sorted(n for n in NAMES if (folder / n).is_file())
    except OSError:
        return None
    if not _judged(names, lambda n: (folder / n).read_bytes(), tokenizer_required):
        return None
    return [folder / n for n in names]


def _judged(names: list[str], read: Callable[[str], bytes], tokenizer_required: bool) -> bool:
    """The files `names` (of one folder) are a whole set: a config, a tokenizer where one is
    required, and every JSON file parses."""
    if CONFIG not in names or (tokenizer_required and not set(TOKENIZERS) & set(names)):
        return False
    for name in names:
        if name.endswith(".json"):
            try:
                json.loads(read(name))
            except (OSError, ValueError):
                return False
    return True


def find_in(files: CheckpointFiles, tokenizer_required: bool = True) -> list[str] | None:
    """As `find`, for a step read through its listing (an S3 prefix): the names, relative to
    the step, of the first place with a whole set."""
    listed = files.files
    for place in PLACES:
        prefix = f"{place}/" if place else ""
        names = _meta_listed(listed, prefix)
        if _judged(names, _reader(files, prefix), tokenizer_required):
            return [prefix + n for n in names]
    return None


def _reader(files: CheckpointFiles, prefix: str) -> Callable[[str], bytes]:
    return lambda name: files.read(prefix + name)


def adapter_in(files: CheckpointFiles) -> list[str] | None:
    """A LoRA step saved alone, read through its listing (an S3 prefix): its adapter config
    (whole) and weights, and the tokenizer and generation files beside them; None until both
    are there. An object is listed once whole (S3 writes objects at once), so the adapter can
    be read before the step is judged complete."""
    listed = files.files
    weights = "adapter_model.safetensors"
    if ADAPTER not in listed or listed.get(weights, ADAPTER_MAX_BYTES + 1) > ADAPTER_MAX_BYTES:
        return None
    try:
        json.loads(files.read(ADAPTER))
    except (OSError, ValueError):
        return None
    return [ADAPTER, weights, *_meta_listed(listed, "")]


def _meta_listed(listed: dict[str, int], prefix: str) -> list[str]:
    """The meta files a listing holds under `prefix` (none larger than MAX_BYTES)."""
    return sorted(n for n in NAMES if listed.get(prefix + n, MAX_BYTES + 1) <= MAX_BYTES)


def fetch(files: CheckpointFiles, names: list[str], into: Path) -> Path:
    """The files `names` of the step copied into the folder `into` (made anew), each under its
    own name; returns `into`."""
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    for name in names:
        write_atomic(into / PurePosixPath(name).name, files.read(name))
    return into


def adapter(step: Path) -> Path | None:
    """The step's `adapter_config.json` when it is whole (a LoRA adapter saved alone, whose base
    an engine can load before the adapter is complete), else None."""
    path = step / ADAPTER
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return path
