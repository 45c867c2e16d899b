"""verl's FSDP checkpoints (and those of rllm and SkyRL, which keep its layout): each rank's
piece of the model as `model_world_size_{W}_rank_{R}.pt`, a `torch.save` of the FSDP sharded
state dict (DTensors placed `[Shard(0)]`, or `[Replicate(), Shard(0)]` under HSDP; Hugging
Face key names; fp32 unless the trainer says otherwise), beside `optim_*` and `extra_state_*`
(never read), `fsdp_config.json` (`world_size`) and `huggingface/` (config and tokenizer).

Complete when every rank's model file is there and whole (a zip's end record is the last thing
`torch.save` writes) and the config and tokenizer are there: the driver's
`latest_checkpointed_iteration.txt` is not needed (an async save writes none). A rank missing
for good, world sizes that disagree or pieces that do not make the shape the DTensor records
are `invalid`, never a partial model. A LoRA run (`lora_train_meta.json`) is evaluated from the
adapter verl saves after the shards (`actor/lora_adapter`, naming.py), not from them.

Conversion concatenates each tensor's pieces in rank order along its Shard dim (torch.chunk's
layout: later ranks may hold fewer rows, or none), one tensor at a time. Under HSDP the ranks
of the first replica hold the model; how many that is is found from the pieces' sizes, not
from the pickled device mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from ckpt_watcher.checkpoints.files import TOKENIZER_FILES, CheckpointFiles, read_json
from ckpt_watcher.checkpoints.layouts import VERL_FSDP
from ckpt_watcher.errors import NativeFormatError
from ckpt_watcher.formats import Problem
from ckpt_watcher.formats.hf_folder import Pieces, write_hf_folder
from ckpt_watcher.formats.safetensors_out import Planned
from ckpt_watcher.formats.torchzip import EOCD_SIZE, LazyTensor, Sharded, read_index, zip_whole

CONFIG = "fsdp_config.json"
HF = VERL_FSDP.config
LORA_META = "lora_train_meta.json"


class VerlFsdp:
    name = VERL_FSDP.name

    def structure(
        self,
        files: CheckpointFiles,
        tokenizer_required: bool,
        base: Path | None = None,
        command: list[str] | None = None,
    ) -> Problem | str:
        names = files.files
        if LORA_META in names:
            return Problem(
                "incomplete",
                "a LoRA run: its adapter is what is evaluated, once verl saves actor/lora_adapter",
            )
        ranks = _ranks(names)
        sizes = {w for w, _ in ranks}
        if len(sizes) > 1:
            return Problem("invalid", f"rank files of world sizes {sorted(sizes)} together")
        (world,) = sizes
        config = read_json(files, CONFIG) if CONFIG in names else None
        if isinstance(config, dict) and config.get("world_size") not in (None, world):
            return Problem(
                "invalid", f"{CONFIG} says world_size {config['world_size']}, the files {world}"
            )
        have = {r for _, r in ranks}
        if missing := sorted(set(range(world)) - have):
            return Problem(
                "incomplete",
                f"{len(have)} of {world} ranks' model files (rank {missing[0]} not yet)",
                quiet_verdict="invalid",
            )
        for w, r in sorted(ranks):
            name = f"model_world_size_{w}_rank_{r}.pt"
            size = names[name]
            if size < EOCD_SIZE or not zip_whole(files.read(name, size - EOCD_SIZE, EOCD_SIZE)):
                return Problem(
                    "incomplete",
                    f"{name}: being written (no end record yet)",
                    quiet_verdict="invalid",
                )
        hf_config = read_json(files, f"{HF}/config.json")
        if isinstance(hf_config, str):
            return Problem("incomplete", f"{HF}/{hf_config}")
        if tokenizer_required and not any(f"{HF}/{t}" in names for t in TOKENIZER_FILES):
            return Problem("incomplete", f"no tokenizer in {HF}/ yet")
        return f"verl FSDP shards: {world} of {world} ranks whole"

    def convert(
        self,
        folder: Path,
        out: Path,
        dtype: str | None,
        progress: Callable[[int, int], None],
        base: Path | None = None,
        command: list[str] | None = None,
    ) -> None:
        names = [p.name for p in folder.iterdir()]
        ranks = sorted(_ranks(names), key=lambda wr: wr[1])
        world = ranks[0][0] if ranks else 0
        if not ranks or [r for _, r in ranks] != list(range(world)):
            raise NativeFormatError(f"{folder}: not every rank's model file is there")
        states = [read_index(folder / f"model_world_size_{world}_rank_{r}.pt") for _, r in ranks]
        write_hf_folder(out, _plan(states, dtype, folder), folder / HF, progress)


def _ranks(names: Collection[str]) -> set[tuple[int, int]]:
    return {(int(m[1]), int(m[2])) for n in names if (m := VERL_FSDP.weights.match(n))}


def _plan(
    states: list[dict[str, Any]], dtype: str | None, folder: Path
) -> dict[str, tuple[Planned, Pieces]]:
    """What to write (name, dtype, shape), and the pieces each tensor is made of."""
    keys = [k for k, v in states[0].items() if isinstance(v, LazyTensor | Sharded)]
    for r, state in enumerate(states[1:], start=1):
        theirs = [k for k, v in state.items() if isinstance(v, LazyTensor | Sharded)]
        if set(theirs) != set(keys):
            odd = sorted(set(theirs) ^ set(keys))[0]
            raise NativeFormatError(f"{folder}: ranks 0 and {r} hold other tensors ({odd})")
    group = _shard_group(states, keys, folder)
    out: dict[str, tuple[Planned, Pieces]] = {}
    for key in keys:
        first = states[0][key]
        if isinstance(first, Sharded):
            parts = [s[key].local for s in states[:group]]
            pieces = Pieces(parts, _shard_dim(key, first, folder))
        else:
            pieces = Pieces([first])
        out[key] = (Planned(key, dtype or pieces.parts[0].dtype, tuple(first.shape)), pieces)
    return out


def _shard_dim(key: str, value: Sharded, folder: Path) -> int:
    kinds = [p.kind for p in value.placements]
    shards = [p for p in value.placements if p.kind == "Shard"]
    if (
        len(shards) != 1
        or any(k not in ("Shard", "Replicate") for k in kinds)
        or (kinds[-1] != "Shard")
    ):
        raise NativeFormatError(
            f"{folder}: {key} is placed {kinds}: only FSDP ([Shard]) and HSDP ([Replicate, "
            "Shard]) pieces are reassembled here; set the source's convert command to the "
            "trainer's own merger (python -m verl.model_merger merge --backend fsdp ...)"
        )
    dim = shards[0].dim
    if dim is None:
        raise NativeFormatError(f"{folder}: {key}'s Shard placement has no dim")
    return dim


def _shard_group(states: list[dict[str, Any]], keys: list[str], folder: Path) -> int:
    """How many ranks (the first ones) hold one whole copy: the world under FSDP, one replica's
    ranks under HSDP. The pieces say it: the smallest group whose pieces make every tensor's
    shape, repeated by every later group."""
    world = len(states)
    sharded = [k for k in keys if isinstance(states[0][k], Sharded)]
    dims = {k: _shard_dim(k, states[0][k], folder) for k in sharded}
    for k in sharded:
        for r, s in enumerate(states):
            if not isinstance(s[k], Sharded) or s[k].placements != states[0][k].placements:
                raise NativeFormatError(f"{folder}: {k} is placed otherwise on rank {r}")
            if s[k].shape != states[0][k].shape:
                raise NativeFormatError(
                    f"{folder}: ranks disagree on {k}'s shape ({states[0][k].shape} and "
                    f"{s[k].shape} on rank {r})"
                )
    hsdp = any(len(states[0][k].placements) > 1 for k in sharded)
    groups = [g for g in range(1, world + 1) if world % g == 0] if hsdp else [world]
    for group in groups:
        if all(_makes(states, k, dims[k], group) for k in sharded):
            return group
    bad = next(k for k in sharded if not _makes(states, k, dims[k], world))
    raise NativeFormatError(
        f"{folder}: {bad}'s pieces {[tuple(s[bad].local.shape) for s in states]} do not make "
        f"the shape {states[0][bad].shape} its DTensor records (along dim {dims[bad]})"
    )


def _makes(states: list[dict[str, Any]], key: str, dim: int, group: int) -> bool:
    whole = states[0][key].shape
    pieces = [s[key].local.shape for s in states]
    if any(pieces[r] != pieces[r % group] for r in range(len(states))):
        return False
    if any(
        len(p) != len(whole) or any(p[i] != whole[i] for i in range(len(whole)) if i != dim)
        for p in pieces[:group]
    ):
        return False
    return sum(p[dim] for p in pieces[:group]) == whole[dim]


FORMAT = VerlFsdp()
