"""The Hugging Face folder a conversion writes: the weights, streamed from the trainer's pieces
into safetensors (safetensors_out.py), and the config and tokenizer copied beside them.

A tensor is made of `Pieces`: the saved tensors whose concatenation along `dim` is it. Pieces
along dim 0 are the tensor's consecutive runs of elements, so they are copied block by block
(`BLOCK_BYTES`, cast per block): a conversion holds a block, not a tensor. Along another dim
the pieces are read and concatenated whole.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_watcher.checkpoints.files import NEEDED
from ckpt_watcher.errors import NativeFormatError
from ckpt_watcher.formats.safetensors_out import Planned, write_model
from ckpt_watcher.formats.torchzip import LazyTensor

BLOCK_BYTES = 64 << 20  # what a conversion holds of a tensor at a time (cast: up to 1.5 times)


@dataclass(frozen=True)
class Pieces:
    """What one tensor is made of: saved tensors concatenated along `dim`, the first `numel`
    elements of that (None: all; a ZeRO-3 partition is padded)."""

    parts: list[LazyTensor]
    dim: int = 0
    numel: int | None = None


def tiled(
    key: str,
    found: Sequence[tuple[Sequence[int], LazyTensor]],
    shape: tuple[int, ...],
    where: Path,
    converter: str,
) -> Pieces:
    """A tensor of `shape` from its slices (each with its offsets in it): FSDP's slices, whole
    in every dim but the first and end to end along it, else NativeFormatError naming the
    trainer's `converter`."""
    ordered = sorted(found, key=lambda op: tuple(op[0]))
    row = 0
    for offsets, piece in ordered:
        if offsets[0] != row or any(offsets[1:]) or piece.shape[1:] != shape[1:]:
            raise NativeFormatError(
                f"{where}: {key}'s slices (offsets {[list(o) for o, _ in ordered]}) do not lie end "
                "to end along dim 0: only FSDP's slices are reassembled here; set the source's "
                f"convert command to {converter}"
            )
        row += piece.shape[0]
    if row != shape[0]:
        raise NativeFormatError(f"{where}: {key}'s slices make {row} of {shape[0]} rows")
    return Pieces([p for _, p in ordered])


def write_hf_folder(
    out: Path,
    tensors: dict[str, tuple[Planned, Pieces]],
    meta: Path,
    progress: Callable[[int, int], None],
) -> None:
    """Write the model's weights and `meta`'s config and tokenizer files into `out`. A head tied
    to the embeddings (`tie_word_embeddings: true`) is written once, as transformers saves it."""
    config = json.loads((meta / "config.json").read_text())
    if config.get("tie_word_embeddings") is True and "lm_head.weight" in tensors:
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    plan = [planned for planned, _ in tensors.values()]
    total = sum(p.nbytes for p in plan)
    write_model(out, plan, lambda p: stream(tensors[p.name][1], p), lambda n: progress(n, total))
    for name in sorted(NEEDED - {"model.safetensors.index.json"}):
        if (meta / name).is_file():
            shutil.copyfile(meta / name, out / name)


def stream(pieces: Pieces, planned: Planned) -> Iterator[Any]:
    """The tensor's elements in order, in the planned dtype, a block at a time where it can."""
    import torch

    dtype = getattr(torch, planned.dtype)
    if pieces.dim == 0 and all(p.contiguous for p in pieces.parts):
        left = pieces.numel if pieces.numel is not None else sum(p.numel for p in pieces.parts)
        for part in pieces.parts:
            for block in part.blocks(BLOCK_BYTES):
                if left <= 0:
                    return
                block = block[:left]
                left -= block.numel()
                yield block.to(dtype)
        return
    parts = [p.read() for p in pieces.parts]
    whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces.dim)
    del parts
    yield whole.to(dtype).contiguous()
