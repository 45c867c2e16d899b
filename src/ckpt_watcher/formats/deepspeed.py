"""DeepSpeed's engine states (`engine.save_checkpoint`: OpenRLHF's default
`<ckpt.path>/_actor/global_step{N}/`, any DeepSpeed trainer's tag folder). They carry no config
and no tokenizer: those come from the source's base model (`base_model`), the model the run
trained from.

- ZeRO-1/2: `mp_rank_00_model_states.pt["module"]` is the whole model, in the dtype it trains
  in (bf16 under OpenRLHF), with the model's own key names; the optimizer states beside it are
  never read.
- ZeRO-3: the weights are the flat fp32 partitions in each rank's
  `(bf16_)zero_pp_rank_{R}_mp_rank_00_optim_states.pt` (`fp32_flat_groups`), in the order and
  shapes `param_shapes` gives in the model states beside them; each parameter is the
  concatenation of every rank's `ceil(numel / W)` elements at its offset, cut to its size
  (DeepSpeed's own `zero_to_fp32.py` reassembles them so). Buffers, frozen parameters and
  shared (tied) parameters as that script takes them.

Complete when the model states (ZeRO-3: every rank's, and its optimizer states) are there and
whole; DeepSpeed's `latest`, in the folder above, is not needed. Model-parallel states
(`mp_rank_01...`: Megatron-DeepSpeed) are refused: their reassembly needs the architecture.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from ckpt_watcher.checkpoints.files import CheckpointFiles
from ckpt_watcher.checkpoints.layouts import DEEPSPEED
from ckpt_watcher.errors import NativeFormatError
from ckpt_watcher.formats import Problem
from ckpt_watcher.formats.hf_folder import Pieces, write_hf_folder
from ckpt_watcher.formats.safetensors_out import Planned
from ckpt_watcher.formats.torchzip import (
    EOCD_SIZE,
    LazyTensor,
    read_index,
    read_index_at,
    zip_whole,
)

FULL = "mp_rank_00_model_states.pt"
MAX_WORLD = 1 << 16  # ranks of one data-parallel save
_MP = re.compile(r"^(?:.*_)?mp_rank_(\d{2})_(?:model|optim)_states\.pt$")
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
NO_BASE = (
    "DeepSpeed engine states carry no config or tokenizer: set the source's base_model to the "
    "model the run trained from (or have the trainer save Hugging Face copies: OpenRLHF's "
    "--ckpt.save_hf)"
)


class DeepSpeed:
    name = DEEPSPEED.name

    def structure(
        self,
        files: CheckpointFiles,
        tokenizer_required: bool,
        base: Path | None = None,
        command: list[str] | None = None,
    ) -> Problem | str:
        names = files.files
        if model_parallel(names):
            if command:  # the trainer's converter reads them (formats/command.py)
                return "DeepSpeed model-parallel states, converted by the source's command"
            return Problem("invalid", MODEL_PARALLEL)
        if base is None:
            return Problem("incomplete", NO_BASE)
        if not (base / "config.json").is_file():
            return Problem("incomplete", f"base_model {base} has no config.json")
        if FULL in names:
            return _whole(files, [FULL]) or "DeepSpeed model states whole (ZeRO-1/2)"
        ranks = sorted(int(m[1]) for n in names if (m := _ZERO3_MODEL.match(n)))
        if 0 not in ranks:
            return Problem("incomplete", "rank 0's model states not yet", quiet_verdict="invalid")
        first = _model_states(0)
        problem = _whole(files, [first])
        if problem is not None:
            return problem
        # its directory and pickle only (a few ranged reads), never its tensors: with frozen
        # parameters (LoRA under ZeRO-3) the file is the base model's size
        try:
            world = _world(
                read_index_at(first, names[first], lambda at, n: files.read(first, at, n))
            )
        except NativeFormatError as e:
            return Problem("invalid", str(e))
        if world > len(ranks):  # (before listing them: a crafted world size is any number)
            return Problem(
                "incomplete",
                f"{len(ranks)} of {world} ranks' states",
                quiet_verdict="invalid",
            )
        wanted = [_model_states(r) for r in range(world)]
        wanted += [_optim_states(r, names) for r in range(world)]
        if missing := [n for n in wanted if n not in names]:
            have = len([r for r in ranks if r < world])
            return Problem(
                "incomplete",
                f"{have} of {world} ranks' states ({missing[0]} not yet)",
                quiet_verdict="invalid",
            )
        return _whole(files, wanted) or f"DeepSpeed ZeRO-3 states: {world} of {world} ranks whole"

    def convert(
        self,
        folder: Path,
        out: Path,
        dtype: str | None,
        progress: Callable[[int, int], None],
        base: Path | None = None,
        command: list[str] | None = None,
    ) -> None:
        if model_parallel([p.name for p in folder.iterdir()]):
            if not command:
                raise NativeFormatError(f"{folder}: {MODEL_PARALLEL}")
            from ckpt_watcher.formats.command import FORMAT as by_command

            return by_command.convert(folder, out, dtype, progress, base, command)
        if base is None:
            raise NativeFormatError(f"{folder}: {NO_BASE}")
        if (folder / FULL).is_file():
            module = read_index(folder / FULL).get("module")
            if not isinstance(module, dict):
                raise NativeFormatError(f"{folder / FULL}: no module state dict in it")
            tensors = {
                k: (Planned(k, dtype or v.dtype, v.shape), Pieces([v]))
                for k, v in module.items()
                if isinstance(v, LazyTensor)
            }
        else:
            tensors = _zero3(folder, dtype)
        write_hf_folder(out, tensors, base, progress)


MODEL_PARALLEL = (
    "DeepSpeed states of several model-parallel ranks (Megatron-DeepSpeed): reassembling them "
    "needs the model's architecture; set the source's convert command to the trainer's own "
    "converter"
)


def model_parallel(names: Collection[str]) -> bool:
    """States of several model-parallel ranks (`mp_rank_01...`, ZeRO-3's
    `zero_pp_rank_R_mp_rank_01...` too): only the trainer's converter reassembles them."""
    return any((m := _MP.match(n)) is not None and m[1] != "00" for n in names)


def _model_states(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def _optim_states(rank: int, names: Collection[str]) -> str:
    plain = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    return plain if plain in names else f"bf16_{plain}"


def _whole(files: CheckpointFiles, names: list[str]) -> Problem | None:
    for name in names:
        size = files.files[name]
        if size < EOCD_SIZE or not zip_whole(files.read(name, size - EOCD_SIZE, EOCD_SIZE)):
            return Problem(
                "incomplete", f"{name}: being written (no end record yet)", quiet_verdict="invalid"
            )
    return None


def _world(states: dict[str, Any]) -> int:
    world = states.get("dp_world_size")
    if type(world) is not int or not 1 <= world <= MAX_WORLD:
        raise NativeFormatError(f"DeepSpeed model states with a dp_world_size of {world!r:.40}")
    return world


def _zero3(folder: Path, dtype: str | None) -> dict[str, tuple[Planned, Pieces]]:
    """ZeRO-3's tensors as `zero_to_fp32.py` makes them, as pieces of the saved partitions."""
    first = read_index(folder / _model_states(0))
    world = _world(first)
    names = [p.name for p in folder.iterdir()]
    models = [first] + [read_index(folder / _model_states(r)) for r in range(1, world)]
    flats: list[list[LazyTensor]] = []
    for r in range(world):
        osd = read_index(folder / _optim_states(r, names)).get("optimizer_state_dict")
        groups = osd.get("fp32_flat_groups") if isinstance(osd, dict) else None
        if not isinstance(groups, list) or not all(isinstance(g, LazyTensor) for g in groups):
            raise NativeFormatError(f"{folder}: rank {r}'s optimizer states hold no flat groups")
        flats.append(groups)
    out: dict[str, tuple[Planned, Pieces]] = {}
    module = first.get("module") or {}
    for name in first.get("buffer_names") or []:
        buf = module.get(name)
        if isinstance(buf, LazyTensor):
            out[name] = (Planned(name, dtype or buf.dtype, buf.shape), Pieces([buf]))
    for name, shape in (first.get("frozen_param_shapes") or {}).items():
        frags = [m["frozen_param_fragments"][name] for m in models]
        out[name] = (
            Planned(name, dtype or frags[0].dtype, tuple(shape)),
            Pieces(frags, numel=math.prod(shape)),
        )
    offset = 0
    for group in first.get("param_shapes") or []:
        for name, shape in group.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            runs = [_run(flat, offset, part, folder, name) for flat in flats]
            out[name] = (Planned(name, dtype or "float32", tuple(shape)), Pieces(runs, numel=numel))
            offset += part
    available = sum(g.numel for g in flats[0])
    if offset != available:
        raise NativeFormatError(
            f"{folder}: the parameters take {offset} elements of each rank's {available}: the "
            "model states and optimizer states are not of one save"
        )
    for alias, source in (first.get("shared_params") or {}).items():
        if source in out:
            planned, pieces = out[source]
            out[alias] = (Planned(alias, planned.dtype, planned.shape), pieces)
    return out


def _run(flat: list[LazyTensor], offset: int, n: int, folder: Path, name: str) -> LazyTensor:
    """Elements `offset`..`offset+n` of a rank's flat groups taken as one (they lie in one
    group: DeepSpeed never splits a parameter across groups)."""
    at = 0
    for group in flat:
        if offset < at + group.numel:
            if offset + n > at + group.numel:
                raise NativeFormatError(f"{folder}: {name}'s partition spans two flat groups")
            start = group.offset + offset - at
            return LazyTensor(group.path, group.member, group.dtype, start, (n,), (1,))
        at += group.numel
    raise NativeFormatError(f"{folder}: {name} lies past the end of the flat groups")


FORMAT = DeepSpeed()
