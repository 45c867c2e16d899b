"""A checkpoint in a trainer's own format (verl's FSDP shards, ...: formats/) becomes a Hugging
Face folder before anything reads it: converted on local disk beside the workers' own folders
(scratch.py), then evaluated like any other checkpoint by every backend and harness. The
trainer's folders are only read. One copy per content and dtype: the checkpoint's jobs on
other devices (a split job, a helper) use the copy the first one made, and the last job to end
removes it (shared_copies.py). A worker killed while converting leaves a half-made copy that is never
read: the next job converts again.

The converted weights keep the dtype they were saved in (verl's fp32 stays fp32) unless
`eval.model_args.dtype` names one. While it runs, `watcher status` shows the job converting,
with the bytes written of the total.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher import formats, scratch
from ckpt_watcher.checkpoints import adapter
from ckpt_watcher.checkpoints.files import LocalFiles, needed_files
from ckpt_watcher.checkpoints.layouts import native_layout
from ckpt_watcher.errors import NativeFormatError
from ckpt_watcher.formats.hf_folder import ensure_room
from ckpt_watcher.shared_copies import Shared

log = structlog.get_logger("ckpt_watcher.worker.convert")

# eval.model_args.dtype -> the torch dtype the converted weights are written in (None: as saved)
_DTYPES: dict[str, str | None] = {
    "auto": None,
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
}


@dataclass(frozen=True)
class Converted:
    """A converted checkpoint: its Hugging Face folder, its source format, how long it took."""

    path: Path
    source_format: str
    seconds: float  # to convert it, or to find it converted by another job of the checkpoint
    release: Callable[[], None]  # this job is done with it (the last one removes it)


def converted(
    checkpoint: Path,
    model_args: dict[str, Any],
    progress: Callable[[int, int], None],
    base: str | None = None,
    judged: str | None = None,
    command: list[str] | None = None,
) -> Converted | None:
    """The Hugging Face copy of `checkpoint` if it is in a trainer's own format (None if it is
    not); `progress(bytes written, of bytes)` as it is written. `base`: the source's base model
    (DeepSpeed's states take their config and tokenizer from it), which must still be the one
    the checkpoint was judged with (`judged`, its fingerprint), as a LoRA adapter's base."""
    view = LocalFiles(checkpoint)
    fmt = formats.detect(view.files)
    if fmt is None:
        return None
    layout = native_layout(view.files)
    base_path = Path(base) if base is not None else None
    if base_path is not None and layout is not None and layout.needs_base and judged is not None:
        adapter.check_base(view, base_path, judged, str(checkpoint))
    dtype = _dtype(model_args.get("dtype"))

    def make(into: Path) -> None:
        if command:  # the trainer's converter: what it writes is not known, what it reads is
            ensure_room(into, sum(view.files[n] for n in needed_files(view.files)))
        fmt.convert(checkpoint, into, dtype, progress, base_path, command)

    # one copy per content and dtype, shared by the checkpoint's jobs on other devices
    key = hashlib.sha256(f"{judged or checkpoint}|{dtype}|{fmt.name}".encode()).hexdigest()[:24]
    shared = Shared(scratch.shared_root(), key)
    started = time.monotonic()
    out, made = shared.get(make)
    seconds = round(time.monotonic() - started, 3)
    log.info(
        "worker.converted" if made else "worker.conversion_shared",
        checkpoint=str(checkpoint),
        format=fmt.name,
        into=str(out),
        seconds=seconds,
    )
    return Converted(out, fmt.name, seconds, shared.release)


def _dtype(asked: Any) -> str | None:
    if asked is None:
        return None
    key = str(asked).removeprefix("torch.")
    if key not in _DTYPES:
        raise NativeFormatError(
            f"eval.model_args.dtype {asked!r}: a converted checkpoint is written in auto, "
            "bfloat16, float16 or float32"
        )
    return _DTYPES[key]
