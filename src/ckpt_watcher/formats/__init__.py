"""Trainers' own checkpoint formats, which the worker converts into a Hugging Face folder before
an eval reads it (worker/convert.py). Which files a format has is checkpoints/layouts.py (by
names only); each format's module here reads them, as a `NativeFormat`:

- `structure`: is everything there and whole, from listings and a few bytes per file
  (checkpoints/completeness.py asks it, given the format `detect` finds: discovery.py passes it
  in, so the checkpoints' floor never imports the formats above it);
- `convert`: the Hugging Face folder (config, tokenizer, safetensors), written tensor by tensor
  from the shards, which are read without running any of their pickled code.

Nothing here imports torch until a conversion runs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ckpt_watcher.checkpoints.completeness import Problem
from ckpt_watcher.checkpoints.layouts import native_layout

if TYPE_CHECKING:
    from ckpt_watcher.checkpoints.files import CheckpointFiles

__all__ = ["NativeFormat", "Problem", "detect"]


class NativeFormat(Protocol):
    name: str  # layouts.py's, in status and the ledger (`source_format`)

    def structure(
        self,
        files: CheckpointFiles,
        tokenizer_required: bool,
        base: Path | None = None,
        command: list[str] | None = None,
    ) -> Problem | str:
        """The problem, or (all there and whole) what proves it complete; `base`: the source's
        base model, where a format keeps no config (layouts.py's `needs_base`); `command`: the
        source's convert command, for the formats only a trainer's converter reads."""
        ...

    def convert(
        self,
        folder: Path,
        out: Path,
        dtype: str | None,
        progress: Callable[[int, int], None],
        base: Path | None = None,
        command: list[str] | None = None,
    ) -> None:
        """Write the Hugging Face folder of the checkpoint in `folder` into `out` (empty), in
        `dtype` (a torch dtype name; None: as saved); `progress(bytes written, of bytes)`."""
        ...


def detect(names: Collection[str]) -> NativeFormat | None:
    """The native format of a checkpoint whose files are `names`, if any."""
    layout = native_layout(names)
    if layout is None:
        return None
    from ckpt_watcher.formats import dcp, deepspeed, nemo_rl, verl_fsdp

    every = (verl_fsdp.FORMAT, deepspeed.FORMAT, nemo_rl.FORMAT, dcp.FORMAT)
    return {f.name: f for f in every}[layout.name]
