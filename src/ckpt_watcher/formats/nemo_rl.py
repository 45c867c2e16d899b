"""NeMo-RL's DTensor policy checkpoints, as it saves them by default
(`checkpointing.model_save_format: safetensors`, `save_consolidated: false`): under
`step_N/policy/`, each rank's slice of every tensor in its own safetensors file,
`weights/model/shard-{R+1:05d}-model-{i:05d}-of-{n:05d}.safetensors` (torch's
HuggingFaceStorageWriter with `save_distributed`), Hugging Face key names, each file's
`__metadata__["DCP_SHARDING_INFO"]` giving every slice's offsets in its tensor; the config in
`weights/model/.hf_metadata/`, the tokenizer in `tokenizer/`, the optimizer's states in
`optimizer/` (never read).

Complete: NeMo-RL writes the step as `tmp_step_N` and renames it `step_N` once whole (only
`step_N` is a checkpoint); every shard file is as long as its header says, and every file of
each rank's series is there. Conversion: each tensor's slices, ordered by their offsets, must
tile it along dim 0 (FSDP's slices), and are copied block by block; the whole tensor's shape is
where the slices end.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt_watcher.checkpoints.files import TOKENIZER_FILES, CheckpointFiles, LocalFiles, read_json
from ckpt_watcher.checkpoints.layouts import NEMO_RL
from ckpt_watcher.checkpoints.safetensors_header import read_header
from ckpt_watcher.errors import HeaderUnreadable, NativeFormatError
from ckpt_watcher.formats import Problem
from ckpt_watcher.formats.hf_folder import Pieces, tiled, write_hf_folder
from ckpt_watcher.formats.safetensors_out import Planned
from ckpt_watcher.formats.torchzip import LazyTensor

_SHARD = re.compile(r"^weights/model/shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors$")
SHARDING_INFO = "DCP_SHARDING_INFO"
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "BOOL": "bool"}  # fmt: skip


class NemoRl:
    name = NEMO_RL.name

    def structure(
        self,
        files: CheckpointFiles,
        tokenizer_required: bool,
        base: Path | None = None,
        command: list[str] | None = None,
    ) -> Problem | str:
        names = files.files
        series: dict[int, tuple[int, set[int]]] = {}
        for name in names:
            if m := _SHARD.match(name):
                total, have = series.setdefault(int(m[1]), (int(m[3]), set()))
                have.add(int(m[2]))
        for rank, (total, have) in sorted(series.items()):
            if len(have) < total:
                return Problem("invalid", f"rank {rank}'s shard files: {len(have)} of {total}")
        for name in sorted(n for n in names if _SHARD.match(n)):
            try:
                header = read_header(files, name)
            except (HeaderUnreadable, OSError) as e:
                return Problem("invalid", f"{name}: {e}")
            if names[name] != header.expected_size:
                return Problem(
                    "invalid",
                    f"{name}: {names[name]} bytes, its header accounts for {header.expected_size}",
                )
        config = read_json(files, f"{NEMO_RL.config}/config.json")
        if isinstance(config, str):
            return Problem("invalid", f"{NEMO_RL.config}/{config}")
        if tokenizer_required and not any(
            f"{NEMO_RL.tokenizer}/{t}" in names for t in TOKENIZER_FILES
        ):
            return Problem("invalid", f"no tokenizer in {NEMO_RL.tokenizer}/")
        return f"NeMo-RL shards: {len(series)} ranks' files whole (step renamed from tmp_)"

    def convert(
        self,
        folder: Path,
        out: Path,
        dtype: str | None,
        progress: Callable[[int, int], None],
        base: Path | None = None,
        command: list[str] | None = None,
    ) -> None:
        slices: dict[str, list[tuple[list[int], LazyTensor]]] = {}
        for name in sorted(n for n in LocalFiles(folder).files if _SHARD.match(n)):
            for key, (offsets, piece) in _slices(folder / name).items():
                slices.setdefault(key, []).append((offsets, piece))
        tensors: dict[str, tuple[Planned, Pieces]] = {}
        for key, found in slices.items():
            shape = tuple(
                max(o[d] + p.shape[d] for o, p in found) for d in range(len(found[0][1].shape))
            )
            pieces = tiled(key, found, shape, folder, "NeMo-RL's converter")
            tensors[key] = (Planned(key, dtype or pieces.parts[0].dtype, shape), pieces)
        write_hf_folder(out, tensors, folder / NEMO_RL.config, progress)
        for name in LocalFiles(folder / NEMO_RL.tokenizer).files:  # the tokenizer's own files
            shutil.copyfile(folder / NEMO_RL.tokenizer / name, out / name)


def _slices(path: Path) -> dict[str, tuple[list[int], LazyTensor]]:
    """Every tensor slice in one shard file: its offsets in its tensor, and where it lies."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header: dict[str, Any] = json.loads(f.read(n))
    info = json.loads((header.pop("__metadata__", None) or {}).get(SHARDING_INFO) or "{}")
    out = {}
    for key, entry in header.items():
        if key not in info:
            raise NativeFormatError(f"{path.name}: {key} has no offsets in {SHARDING_INFO}")
        shape = tuple(entry["shape"])
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise NativeFormatError(f"{path.name}: {key} is {entry['dtype']}, not converted here")
        stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        item = LazyTensor(path, "", dtype, 0, shape, stride, at=8 + n + entry["data_offsets"][0])
        out[key] = (list(info[key]["saved_offsets"]), item)
    return out


FORMAT = NemoRl()
