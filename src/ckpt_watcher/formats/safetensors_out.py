"""Write a Hugging Face model's weights as safetensors, one tensor at a time.

The header (every tensor's name, dtype, shape and byte range) is known before any tensor is
read, so each file's header is written first and each tensor's bytes follow as they are made,
block by block: memory holds a block (or, where a tensor must be made whole, that tensor), never
the model. Files of at most `MAX_SHARD_BYTES` are named as
transformers names them (`model.safetensors`, or `model-0000k-of-0000n.safetensors` with
`model.safetensors.index.json`), and each is written under a temporary name and renamed, so a
file there is whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size
_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_ITEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1}


@dataclass(frozen=True)
class Planned:
    """One tensor to write: its name, torch dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _ITEM.get(st_dtype(self.dtype), 1)


def st_dtype(dtype: str) -> str:
    """safetensors' name of a torch dtype (`bfloat16` -> `BF16`)."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"no safetensors dtype for torch.{dtype}") from None


def write_model(
    out: Path,
    plan: list[Planned],
    make: Callable[[Planned], Iterable[Any]],
    written: Callable[[int], None] = lambda n: None,
) -> int:
    """Write `plan`'s tensors into `out`, each made by `make` as it is written: CPU tensors of
    the planned dtype whose elements, in order, are the tensor's (the tensor itself, or blocks
    of it); `written` hears the bytes so far. Returns the bytes of weights written."""
    groups = _split(plan)
    total = len(groups)
    names = (
        ["model.safetensors"]
        if total == 1
        else [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]
    )
    done = 0
    weight_map: dict[str, str] = {}
    for name, group in zip(names, groups, strict=True):
        done = _write_file(out / name, group, make, done, written)
        weight_map.update({p.name: name for p in group})
    if total > 1:
        index = {"metadata": {"total_size": done}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return done


def _split(plan: list[Planned]) -> list[list[Planned]]:
    groups: list[list[Planned]] = [[]]
    size = 0
    for p in plan:
        if groups[-1] and size + p.nbytes > MAX_SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.nbytes
    return groups


def _header(group: Iterable[Planned]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for p in group:
        entries[p.name] = {
            "dtype": st_dtype(p.dtype),
            "shape": list(p.shape),
            "data_offsets": [at, at + p.nbytes],
        }
        at += p.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data begins 8-byte aligned, as safetensors pads


def _write_file(
    path: Path,
    group: list[Planned],
    make: Callable[[Planned], Iterable[Any]],
    done: int,
    written: Callable[[int], None],
) -> int:
    """One safetensors file, under a temporary name until whole (no fsync: it is scratch, gone
    with the worker that wrote it)."""
    import torch

    tmp = path.with_name(f".{path.name}.partial")
    header = _header(group)
    with open(tmp, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for p in group:
            wrote = 0
            for part in make(p):
                if str(part.dtype) != f"torch.{p.dtype}":
                    raise ValueError(f"{p.name}: made {part.dtype}, planned torch.{p.dtype}")
                if part.numel():
                    f.write(memoryview(part.contiguous().view(torch.uint8).reshape(-1).numpy()))
                wrote += part.numel() * part.element_size()
                written(done + wrote)
            if wrote != p.nbytes:
                raise ValueError(f"{p.name}: made {wrote} bytes, planned {p.nbytes}")
            done += wrote
    tmp.rename(path)
    return done
