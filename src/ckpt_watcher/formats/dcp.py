"""torch distributed checkpoints (DCP) of a model saved as `{"model": model.state_dict()}`:
accelerate under FSDP2 (TRL's FSDP2 recipes: `checkpoint-N/pytorch_model_fsdp_0/`, its default
sharded state dict), NeMo-RL's `model_save_format: torch_save` (`policy/weights/`). Their keys
are Hugging Face names under `model.`, so they are read here, with no converter.

A DCP folder holds `.metadata`, which the coordinator writes last, once every rank has written
its data files, and the data files `__R_I.distcp`. `.metadata` is a pickle (read with
torchzip's restrictions) that lists every tensor's shape, dtype and pieces; each piece is a
torch.save archive at an offset of a data file. FSDP's pieces lie end to end along dim 0, so a
tensor is copied piece by piece, block by block (hf_folder.py). Config and tokenizer are those
beside the DCP folder (the Trainer's), else the source's base model.

Keys of another naming (torchtitan's own names, Megatron's) need the trainer's mapping: such a
DCP is converted by the source's `convert` command (command.py), which also wins wherever set.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_watcher.checkpoints.files import NEEDED, TOKENIZER_FILES, CheckpointFiles, LocalFiles
from ckpt_watcher.checkpoints.layouts import DCP
from ckpt_watcher.errors import NativeFormatError
from ckpt_watcher.formats import Problem
from ckpt_watcher.formats.command import CONVERTERS
from ckpt_watcher.formats.command import FORMAT as COMMAND
from ckpt_watcher.formats.hf_folder import Pieces, tiled, write_hf_folder
from ckpt_watcher.formats.safetensors_out import Planned
from ckpt_watcher.formats.torchzip import LazyTensor, read_embedded, read_pickle

MARKER = ".metadata"
MODEL = "model"  # the state dict's entry that is the model: `{"model": model.state_dict()}`


@dataclass(frozen=True)
class Piece:
    """Where one piece of a tensor lies: its offsets in the tensor, its shape, and the bytes of
    its torch.save archive (a data file, named relative to the DCP folder)."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    start: int
    length: int


@dataclass(frozen=True)
class Entry:
    """A model tensor as `.metadata` lists it."""

    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]


class Dcp:
    name = DCP.name

    def structure(
        self,
        files: CheckpointFiles,
        tokenizer_required: bool,
        base: Path | None = None,
        command: list[str] | None = None,
    ) -> Problem | str:
        if command:
            return COMMAND.structure(files, tokenizer_required, base, command)
        names = files.files
        marker = _marker(names)
        if marker is None:
            return Problem("incomplete", f"no {MARKER} yet (a DCP writes it last)")
        try:
            model = read_model(files.read(marker), marker)
        except NativeFormatError as e:
            return Problem("invalid", f"{e}. It is {CONVERTERS}")
        folder = marker[: -len(MARKER)]
        for file, end in sorted(_ends(model).items()):
            size = names.get(folder + file)
            if size is None or size < end:  # a copy (an S3 sync) may bring .metadata first
                have = "not there" if size is None else f"{size} bytes"
                return Problem(
                    "incomplete",
                    f"{folder}{file}: {have}; {marker} places pieces up to byte {end}",
                    quiet_verdict="invalid",
                )
        for what, present in (
            ("config.json", "config.json" in names),
            ("tokenizer", not tokenizer_required or any(t in names for t in TOKENIZER_FILES)),
        ):
            if not present and base is None:
                return Problem(
                    "incomplete",
                    f"no {what} beside the DCP yet (where the trainer saves none, set the "
                    "source's base_model)",
                    quiet_verdict="invalid",
                )
        return f"marker {marker}: {len(model)} tensors with Hugging Face names under `model.`"

    def convert(
        self,
        folder: Path,
        out: Path,
        dtype: str | None,
        progress: Callable[[int, int], None],
        base: Path | None = None,
        command: list[str] | None = None,
    ) -> None:
        if command:
            return COMMAND.convert(folder, out, dtype, progress, base, command)
        names = LocalFiles(folder).files
        marker = _marker(names)
        if marker is None:
            raise NativeFormatError(f"{folder}: no {MARKER}")
        dcp = folder / marker[: -len(MARKER)]
        tensors: dict[str, tuple[Planned, Pieces]] = {}
        for key, entry in read_model((folder / marker).read_bytes(), marker).items():
            found = [(p.offsets, _piece(dcp, p, key)) for p in entry.pieces]
            pieces = tiled(key, found, entry.shape, folder, "the trainer's converter")
            tensors[key] = (Planned(key, dtype or entry.dtype, entry.shape), pieces)
        meta = folder if "config.json" in names else base
        if meta is None:
            raise NativeFormatError(f"{folder}: no config.json; set the source's base_model")
        write_hf_folder(out, tensors, meta, progress)
        if base is not None and meta != base:  # a tokenizer the trainer did not save
            have = set(LocalFiles(out).files)
            if not have & set(TOKENIZER_FILES):
                for name in sorted((NEEDED & set(LocalFiles(base).files)) - have):
                    shutil.copyfile(base / name, out / name)
        return None


def read_model(data: bytes, name: str) -> dict[str, Entry]:
    """The model's tensors in a DCP's `.metadata` (its bytes `data`), by Hugging Face name.
    NativeFormatError where they are not a model's state dict under `model.`."""
    meta = _state(read_pickle(name, data))
    listed, paths = meta.get("state_dict_metadata"), meta.get("planner_data")
    if not isinstance(listed, dict) or not isinstance(paths, dict):
        raise NativeFormatError(f"{name}: not a distributed checkpoint's metadata")
    stored = {
        (str(_state(index).get("fqn")), _ints(_state(index).get("offset"))): _state(info)
        for index, info in (meta.get("storage_data") or {}).items()
    }
    model: dict[str, Entry] = {}
    for fqn, listing in listed.items():
        path = paths.get(fqn)
        tensor = _state(listing)
        if not (isinstance(path, tuple) and len(path) == 2 and path[0] == MODEL):
            continue  # not the model's (an optimizer's, a step counter)
        if "chunks" not in tensor:
            continue  # bytes, not a tensor
        pieces = []
        for chunk in tensor["chunks"]:
            offsets, shape = _ints(_state(chunk).get("offsets")), _ints(_state(chunk).get("sizes"))
            info = stored.get((fqn, offsets))
            if info is None:
                raise NativeFormatError(f"{name}: {fqn}'s piece at {list(offsets)} is not stored")
            if info.get("transform_descriptors"):
                raise NativeFormatError(
                    f"{name}: {fqn} is stored through {info['transform_descriptors']} "
                    "(compressed); only plain pieces are read here"
                )
            pieces.append(
                Piece(
                    offsets,
                    shape,
                    str(info["relative_path"]),
                    int(info["offset"]),
                    int(info["length"]),
                )
            )
        model[str(path[1])] = Entry(_ints(tensor.get("size")), _dtype(tensor), tuple(pieces))
    if not model:
        sample = sorted(str(k) for k in listed)[:3]
        raise NativeFormatError(
            f"{name}: no model state dict under `{MODEL}.` (keys such as {sample})"
        )
    return model


def _marker(names: dict[str, int]) -> str | None:
    return next((n for n in sorted(names) if n.rpartition("/")[2] == MARKER), None)


def _ends(model: dict[str, Entry]) -> dict[str, int]:
    """Each data file's least length: where its last piece ends."""
    ends: dict[str, int] = {}
    for entry in model.values():
        for p in entry.pieces:
            ends[p.file] = max(ends.get(p.file, 0), p.start + p.length)
    return ends


def _piece(dcp: Path, p: Piece, key: str) -> LazyTensor:
    piece = read_embedded(dcp / p.file, p.start, p.length)
    if not isinstance(piece, LazyTensor) or piece.shape != p.shape:
        got = piece.shape if isinstance(piece, LazyTensor) else type(piece).__name__
        raise NativeFormatError(f"{dcp / p.file}: {key}'s piece is {got}, its metadata {p.shape}")
    return piece


def _state(obj: Any) -> dict[str, Any]:
    """A record's fields (torchzip keeps torch's distributed classes as inert records)."""
    state = getattr(obj, "state", None)
    return state if isinstance(state, dict) else {}


def _ints(value: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in value) if value is not None else ()


def _dtype(tensor: dict[str, Any]) -> str:
    properties = _state(tensor.get("properties"))  # TensorProperties: a tuple, or its fields
    value = properties.get("value")
    dtype = value[0] if isinstance(value, tuple) and value else properties.get("dtype")
    if dtype is None:
        raise NativeFormatError("a tensor whose metadata records no dtype")
    return str(dtype).removeprefix("torch.")


FORMAT = Dcp()
