"""NeMo-RL's DTensor policy checkpoints, as it saves them by default
(`checkpointing.model_save_format: safetensors`, `save_consolidated: false`): under
`step_N/policy/`, each rank's slice of every tensor in its own safetensors file,
`weights/model/shard-{R+1:05d}-model-{i:05d}-of-{n:05d}.safetensors` (torch's
HuggingFaceStorageWriter with `save_distributed`), Hugging Face key names, each file's
`__metadata__["DCP_SHARDING_INFO"]` giving every slice's offsets in its tensor; the config in
`weights/model/.hf_metadata/`, the tokenizer in `tokenizer/`, the optimizer's states in
`optimizer/` (never read).

Complete: NeMo-RL writes the step as `tmp_step_N` and renames it `step_N` once whole (only
`step_N` is a checkpoint), but a copy (an S3 upload) brings its files one by one. So: every
rank's series of files is there (`-of-N` counts one rank's files, not the ranks: ranks are
numbered from 1 with no gap), every shard file is as long as its header says, each tensor's
slices tile it along dim 0 from row 0 with no gap (FSDP's slices), and the embeddings have the
config's `vocab_size` rows (a last rank still to come leaves every tensor short at its end,
with no gap to see). Anything short is incomplete while files may still come, invalid once they
have stopped. Conversion copies the slices block by block, and every tensor's shape is held to
the model the config describes (hf_folder.check_shapes).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

from ckpt_watcher.checkpoints.files import TOKENIZER_FILES, CheckpointFiles, LocalFiles, read_json
from ckpt_watcher.checkpoints.layouts import NEMO_RL
from ckpt_watcher.checkpoints.safetensors_header import read_header, read_local_header
from ckpt_watcher.errors import HeaderUnreadable, NativeFormatError
from ckpt_watcher.formats import Problem
from ckpt_watcher.formats.hf_folder import Pieces, tiled, tiling, write_hf_folder
from ckpt_watcher.formats.safetensors_out import Planned
from ckpt_watcher.formats.torchzip import LazyTensor

# the input embeddings' (and an untied head's) names: rows = the config's vocab_size
_EMBEDDINGS = ("embed_tokens.weight", "lm_head.weight", "wte.weight", "embed_in.weight",
               "embed_out.weight", "word_embeddings.weight", "tok_embeddings.weight",
               "output.weight")  # fmt: skip
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
        # a rank's files come in its own series (-of-N counts its files, not the ranks); a rank
        # with none yet leaves a gap in the ranks' numbers, or rows missing at the tensors' end
        ranks = sorted(series)
        if missing := sorted(set(range(1, (ranks[-1] if ranks else 0) + 1)) - set(ranks)):
            return _not_yet(f"rank {missing[0]}'s shard files not there (ranks {ranks} are)")
        for rank, (total, have) in sorted(series.items()):
            if not have <= set(range(1, total + 1)):
                return Problem("invalid", f"rank {rank}'s shard files number past {total}")
            if len(have) < total:
                return _not_yet(f"rank {rank}'s shard files: {len(have)} of {total}")
        slices: dict[str, list[tuple[list[int], list[int]]]] = {}
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
            try:
                for key, (offsets, shape) in _offsets(header.entries, header.metadata).items():
                    slices.setdefault(key, []).append((offsets, shape))
            except NativeFormatError as e:
                return Problem("invalid", f"{name}: {e}")
        config = read_json(files, f"{NEMO_RL.config}/config.json")
        if isinstance(config, str):
            return Problem("invalid", f"{NEMO_RL.config}/{config}")
        if problem := _short(slices, config):
            return problem
        if tokenizer_required and not any(
            f"{NEMO_RL.tokenizer}/{t}" in names for t in TOKENIZER_FILES
        ):
            return Problem("invalid", f"no tokenizer in {NEMO_RL.tokenizer}/")
        return f"NeMo-RL shards: {len(series)} ranks' files whole, every tensor's rows there"

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
            rows = sum(p.shape[0] for _, p in found)
            shape = (rows, *found[0][1].shape[1:])
            pieces = tiled(key, found, shape, folder, "NeMo-RL's converter")
            tensors[key] = (Planned(key, dtype or pieces.parts[0].dtype, shape), pieces)
        # the rows the slices make are the tensor's only if no rank's slice is missing at the
        # end: write_hf_folder holds every shape to the model the config describes
        write_hf_folder(out, tensors, folder / NEMO_RL.config, progress)
        for name in LocalFiles(folder / NEMO_RL.tokenizer).files:  # the tokenizer's own files
            shutil.copyfile(folder / NEMO_RL.tokenizer / name, out / name)


def _not_yet(reason: str) -> Problem:
    """Files of the step still to come (an upload in progress); the save is broken if they
    never do."""
    return Problem("incomplete", reason, quiet_verdict="invalid")


def _offsets(
    entries: dict[str, Any], metadata: dict[str, Any]
) -> dict[str, tuple[list[int], list[int]]]:
    """Each tensor slice of one shard file: its offsets in its tensor and its shape."""
    raw = metadata.get(SHARDING_INFO)
    try:
        info = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        info = None
    if not isinstance(info, dict):
        raise NativeFormatError(f"no readable {SHARDING_INFO} in its metadata")
    out = {}
    for key, entry in entries.items():
        mine = info.get(key)
        saved = mine.get("saved_offsets") if isinstance(mine, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (_ints(saved) and _ints(shape) and len(saved) == len(shape)):
            raise NativeFormatError(f"{key} has no offsets in {SHARDING_INFO}")
        out[key] = (saved, shape)
    return out


def _ints(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)


def _short(
    slices: dict[str, list[tuple[list[int], list[int]]]], config: dict[str, Any]
) -> Problem | None:
    """What is wrong with the slices: a gap between two of a tensor's slices, or an embedding
    with fewer rows than the config's `vocab_size` (every FSDP rank holds a slice of it, so a
    rank still to come leaves it short): files to come; slices that overlap or do not fit:
    invalid. With no embedding to hold to a vocabulary size, nothing could tell a rank still
    to come: refused (the source's convert command, NeMo-RL's converter, reads it)."""
    vocab = vocab_size(config)
    checked = False
    for key, found in sorted(slices.items()):
        _, problem, gap = tiling(found)
        if problem:
            return (
                _not_yet(f"{key}'s slices: {problem}")
                if gap
                else Problem("invalid", f"{key}'s slices: {problem}")
            )
        if vocab is not None and key.endswith(_EMBEDDINGS):
            rows = sum(shape[0] for _, shape in found)
            if rows != vocab:
                return _not_yet(f"{key}: {rows} of the config's {vocab} rows (vocab_size)")
            checked = True
    if not checked:
        return Problem(
            "invalid",
            "no embedding of the config's vocab_size among its tensors, so a rank's slices "
            "still to come could not be told: set the source's convert command to NeMo-RL's "
            "converter (examples/converters/convert_dcp_to_hf.py)",
        )
    return None


def vocab_size(config: dict[str, Any]) -> int | None:
    """The config's vocabulary size: its own, or its language model's (multimodal configs)."""
    for where in (config, *(v for v in config.values() if isinstance(v, dict))):
        value = where.get("vocab_size")
        if type(value) is int and value > 0:
            return value
    return None


def _slices(path: Path) -> dict[str, tuple[list[int], LazyTensor]]:
    """Every tensor slice in one shard file: its offsets in its tensor, and where it lies."""
    header = read_local_header(path)
    out = {}
    for key, (offsets, shape) in _offsets(header.entries, header.metadata).items():
        entry = header.entries[key]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise NativeFormatError(f"{path.name}: {key} is {entry['dtype']}, not converted here")
        begin, end = entry["data_offsets"]
        stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        at = 8 + header.header_len + begin
        out[key] = (offsets, LazyTensor(path, "", dtype, 0, tuple(shape), stride, at, end - begin))
    return out


FORMAT = NemoRl()
