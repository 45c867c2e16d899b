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
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher.checkpoints.files import NEEDED
from ckpt_watcher.errors import NativeFormatError
from ckpt_watcher.formats.safetensors_out import Planned, write_model
from ckpt_watcher.formats.torchzip import LazyTensor

log = structlog.get_logger("ckpt_watcher.formats")

BLOCK_BYTES = 64 << 20  # what a conversion holds of a tensor at a time (cast: up to 1.5 times)
HEADROOM = 1.05  # of what a conversion writes, free on the scratch disk before it starts


@dataclass(frozen=True)
class Pieces:
    """What one tensor is made of: saved tensors concatenated along `dim`, the first `numel`
    elements of that (None: all; a ZeRO-3 partition is padded)."""

    parts: list[LazyTensor]
    dim: int = 0
    numel: int | None = None


def tiling(
    slices: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> tuple[list[int], str, bool]:
    """How a tensor's slices (each its offsets in the tensor and its shape) make it: the order
    to take them in; "" where they lie as FSDP's do (whole in every dim but the first, end to
    end along it from row 0: no gap, no overlap), else what is wrong; and whether what is wrong
    is only rows missing (slices still to come). The rows they make are the tensor's only where
    no slice is missing at the end: a caller compares them with what the tensor must be (its
    config, or the metadata that lists it)."""
    order = sorted(range(len(slices)), key=lambda i: tuple(slices[i][0]))
    if any(len(shape) == 0 for _, shape in slices):  # a scalar: one whole slice
        ok = len(slices) == 1 and len(slices[0][0]) == 0
        return order, "" if ok else "a scalar in several slices", False
    row = 0
    rest = tuple(slices[order[0]][1][1:]) if order else ()
    for i in order:
        offsets, shape = slices[i]
        if len(offsets) != len(shape) or any(offsets[1:]) or tuple(shape[1:]) != rest:
            return (
                order,
                f"a slice at {list(offsets)} of shape {list(shape)} is not whole past dim 0",
                False,
            )
        if offsets[0] != row:
            gap = offsets[0] > row
            kind = "missing" if gap else "given twice"
            return order, f"rows {min(row, offsets[0])}-{max(row, offsets[0]) - 1} {kind}", gap
        row += shape[0]
    return order, "", False


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
    order, problem, _ = tiling([(offsets, piece.shape) for offsets, piece in found])
    ordered = [found[i] for i in order]
    if problem:
        raise NativeFormatError(
            f"{where}: {key}'s slices (offsets {[list(o) for o, _ in ordered]}) do not lie end "
            f"to end along dim 0 ({problem}): only FSDP's slices are reassembled here; set the "
            f"source's convert command to {converter}"
        )
    row = sum(piece.shape[0] for _, piece in ordered)
    if row != shape[0] or (ordered and ordered[0][1].shape[1:] != shape[1:]):
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
    tied = config.get("tie_word_embeddings") is True
    if tied and "lm_head.weight" in tensors:
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    check_shapes(tensors, meta, {"lm_head.weight"} if tied else set())
    plan = [planned for planned, _ in tensors.values()]
    total = sum(p.nbytes for p in plan)
    ensure_room(out, total)
    write_model(out, plan, lambda p: stream(tensors[p.name][1], p), lambda n: progress(n, total))
    for name in sorted(NEEDED - {"model.safetensors.index.json"}):
        if (meta / name).is_file():
            shutil.copyfile(meta / name, out / name)


def ensure_room(out: Path, nbytes: int) -> None:
    """OSError unless `out`'s disk has room for `nbytes`: what a conversion writes, not what it
    reads (a ZeRO-3 step's optimizer states are read, 12 bytes a parameter, and 2 or 4 written)."""
    free = shutil.disk_usage(out).free
    if free < nbytes * HEADROOM:
        raise OSError(
            f"the converted copy needs about {nbytes / 2**30:.1f} GiB in {out.parent}, which has "
            f"{free / 2**30:.1f} GiB free: free space there, or point TMPDIR at a larger local disk"
        )


def check_shapes(
    tensors: dict[str, tuple[Planned, Pieces]], meta: Path, unsaved: Collection[str] = ()
) -> None:
    """Every tensor the model of `meta`'s config has is there (but `unsaved`: a tied head), of
    the shape that model gives it: a save with a rank's slices missing (its tensors short of
    rows), a tensor missing, or a model of another config is refused, never converted into a
    smaller or partly random model. A config transformers cannot build here (a model of remote
    code) is checked by what its format's own metadata says alone."""
    expected = model_shapes(meta)
    wrong = [
        f"{key} {list(planned.shape)} (its config's: {list(expected[key])})"
        for key, (planned, _) in sorted(tensors.items())
        if key in expected and tuple(expected[key]) != planned.shape
    ]
    wrong += [f"{key} missing" for key in sorted(set(expected) - set(tensors) - set(unsaved))]
    if wrong:
        raise NativeFormatError(
            f"{len(wrong)} tensor(s) not as {meta / 'config.json'} gives them: "
            f"{'; '.join(wrong[:3])}: a rank's files missing, or a config of another model"
        )


def model_shapes(meta: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the model `meta/config.json` describes, from that model
    built on torch's meta device (no memory, no weights); {} where transformers cannot build it
    (logged)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(meta))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # remote code, an architecture this transformers lacks
        log.warning("convert.shapes_unchecked", config=str(meta), error=f"{type(e).__name__}: {e}")
        return {}
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


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
