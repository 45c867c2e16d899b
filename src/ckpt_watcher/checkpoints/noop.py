"""Checkpoints that change nothing: a LoRA adapter whose every update is zero, and a full
checkpoint whose weights are its base model's.

Trainers have saved both: LoRA configs with `lora_alpha` hard-coded to 0 (every update scaled by
0), adapters saved as initialized (every `lora_B` is zero until a step is taken), and "merged"
folders byte for byte their base. Evaluated, such a step scores as the base model, filed under
a training step: a flat curve that reads as a run that learns nothing, or a good number that is
the base's. The worker checks each step before evaluating it; the step is still evaluated (the
number is real: the base model's), and its ledger lines carry `no_op` with the reason, which
alerts, `watcher results`, W&B, Prometheus and the report leave out of the run's results.

Only what proves a no-op is a no-op: an adapter is one when each of its LoRA modules has a zero
scale, an all-zero A or an all-zero B, and it holds no other weights (`modules_to_save`, DoRA's
magnitudes, trainable tokens change the model on their own); a full checkpoint is one when
every tensor is its base's, byte for byte (names, dtypes, shapes and data). The base of a full
checkpoint is the source's `base_model` (or `adapter_base`); without one nothing is compared.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from ckpt_watcher.checkpoints.files import ADAPTER_CONFIG
from ckpt_watcher.checkpoints.namefix import weight_files
from ckpt_watcher.checkpoints.safetensors_header import read_local_header

_LORA = re.compile(r"^(?P<module>.+)\.lora_(?:A|B|embedding_A|embedding_B)(?:\.[^.]+)*$")
_SIDE = re.compile(r"\.lora_(?:embedding_)?(?P<side>[AB])(?:\.|$)")
_CHUNK = 16 << 20  # bytes compared at a time


def adapter_no_op(folder: Path) -> str | None:
    """Why the LoRA adapter saved in `folder` changes nothing, or None if it may change the
    model (or is not LoRA: other PEFT methods are not judged)."""
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        return None
    modules: dict[str, dict[str, bool]] = {}  # module -> side ("A"/"B") -> all zero
    for name, zero in _adapter_tensors(folder):
        found, side = _LORA.match(name), _SIDE.search(name)
        if found is None or side is None:  # modules_to_save, DoRA's magnitude, tokens...
            return None
        sides = modules.setdefault(found["module"], {})
        sides[side["side"]] = sides.get(side["side"], True) and zero
    if not modules:
        return None
    scaled = {m: s for m, s in modules.items() if _alpha(config, m) != 0}
    if not scaled:
        return "lora_alpha is 0: every LoRA update is scaled by 0, the model is its base"
    for sides in scaled.values():
        if set(sides) != {"A", "B"}:
            return None  # half a module: not ours to judge
        if not sides["A"] and not sides["B"]:
            return None  # B @ A may be non-zero: the adapter changes this module
    if all(sides.get("B", False) for sides in modules.values()):
        return (
            f"every lora_B matrix of its {len(modules)} modules is zero (the adapter as "
            "initialized, never trained): the model is its base"
        )
    return (
        f"each of its {len(modules)} LoRA modules has a zero A, a zero B or a zero scale: "
        "the model is its base"
    )


def _alpha(config: dict[str, Any], module: str) -> float | None:
    """The module's lora_alpha, as peft finds it (`alpha_pattern` first: a key matches the
    module's name at its end, after a dot)."""
    for key, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return _number(value)
    return _number(config.get("lora_alpha"))


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _adapter_tensors(folder: Path) -> Iterator[tuple[str, bool]]:
    """Each of the adapter's tensors by name, and whether it is all zero (one tensor in memory
    at a time)."""
    import torch

    if (folder / "adapter_model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                yield name, not bool(f.get_tensor(name).any())
        return
    loaded = torch.load(
        folder / "adapter_model.bin", map_location="cpu", weights_only=True, mmap=True
    )
    for name, tensor in dict(loaded).items():
        yield str(name), not bool(tensor.any())


class _Stored(NamedTuple):
    """Where one tensor's bytes are, and what they are."""

    path: Path
    kind: tuple[str, tuple[int, ...]]  # dtype, shape
    begin: int  # in the file
    size: int


def same_weights(checkpoint: Path, base: Path) -> bool:
    """Whether every tensor of `checkpoint` is its `base`'s (names, dtypes, shapes, bytes),
    over safetensors files however each is sharded. Compares the smallest tensors first (a
    trained model's norms differ at once) and stops at the first difference."""
    mine, theirs = _tensor_index(checkpoint), _tensor_index(base)
    if mine is None or theirs is None or set(mine) != set(theirs):
        return False
    for name in sorted(mine, key=lambda n: (mine[n].size, n)):
        a, b = mine[name], theirs[name]
        if a.kind != b.kind or a.size != b.size or not _same_bytes(a, b):
            return False
    return True


def _tensor_index(folder: Path) -> dict[str, _Stored] | None:
    """Each tensor of the folder's safetensors files (None if it has none, or two files hold
    one name)."""
    out: dict[str, _Stored] = {}
    files = weight_files(folder)
    if not files:
        return None
    for path in files:
        header = read_local_header(path)
        start = 8 + header.header_len
        for name, entry in header.entries.items():
            if name in out:
                return None
            begin, end = entry["data_offsets"]
            kind = (str(entry.get("dtype")), tuple(entry.get("shape") or ()))
            out[name] = _Stored(path, kind, start + begin, end - begin)
    return out


def _same_bytes(a: _Stored, b: _Stored) -> bool:
    with a.path.open("rb") as fa, b.path.open("rb") as fb:
        fa.seek(a.begin)
        fb.seek(b.begin)
        left = a.size
        while left > 0:
            n = min(left, _CHUNK)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True
