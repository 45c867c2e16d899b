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
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from ckpt_watcher.checkpoints.files import ADAPTER_CONFIG
from ckpt_watcher.checkpoints.layouts import HF_META
from ckpt_watcher.checkpoints.namefix import weight_files
from ckpt_watcher.checkpoints.safetensors_header import (
    MAX_HEADER_BYTES,
    SafetensorsHeader,
    parse_header,
)

_LORA = re.compile(r"^(?P<module>.+)\.lora_(?:A|B|embedding_A|embedding_B)(?:\.[^.]+)*$")
_SIDE = re.compile(r"\.lora_(?:embedding_)?(?P<side>[AB])(?:\.|$)")
_CHUNK = 16 << 20  # bytes compared at a time
# what an eval reads besides the weights: the same as the base's, or the step is not its base
# (a copy with another rope_theta, an adapter saved with a chat template of its own)
_CONFIGS = ("config.json", "generation_config.json")
_TOKENIZER = tuple(sorted(HF_META - set(_CONFIGS)))  # and the chat template, the preprocessor
_VERSION_KEYS = ("transformers_version", "_name_or_path")  # who saved it, not what it is


def adapter_no_op(folder: Path, base: Path | None = None) -> str | None:
    """Why the LoRA adapter saved in `folder` changes nothing, or None if it may change the
    model (or is not LoRA: other PEFT methods are not judged). `base`: the model it is merged
    into, whose tokenizer files any the adapter saved must equal (None: it must save none)."""
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA" or config.get("layer_replication"):
        return None  # layer_replication adds layers, whatever the LoRA weights are
    if not _same_files(folder, base, _TOKENIZER, only_present=True):
        return None  # a tokenizer or chat template of its own: what is evaluated differs
    modules: dict[str, dict[str, bool]] = {}  # module -> "A" / "B" / "bias" -> all zero
    for name, zero, finite in _adapter_tensors(folder):
        found, side = _LORA.match(name), _SIDE.search(name)
        if found is None or side is None:  # modules_to_save, DoRA's magnitude, tokens...
            return None
        if not finite:  # NaN or Inf: 0 times it is NaN, a diverged run, never its base
            return None
        part = "bias" if side["side"] == "B" and name.endswith(".bias") else side["side"]
        sides = modules.setdefault(found["module"], {})
        sides[part] = sides.get(part, True) and zero
    if not modules:
        return None
    scaled = {m: s for m, s in modules.items() if _alpha(config, m) != 0}
    if not scaled:
        return "lora_alpha is 0: every LoRA update is scaled by 0, the model is its base"
    for sides in scaled.values():
        if not {"A", "B"} <= set(sides):
            return None  # half a module: not ours to judge
        if not sides.get("bias", True):
            return None  # lora_B's bias is added whatever A is
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
    """The module's lora_alpha, as peft finds it: `alpha_pattern` first, whose keys match the
    module's name inside the model (`model.layers.0.self_attn.q_proj`, without the
    `base_model.model.` a save puts before it) at its end, after a dot."""
    name = module.removeprefix("base_model.model.")
    pattern = config.get("alpha_pattern") or {}
    for key, value in pattern.items() if isinstance(pattern, dict) else ():
        if re.match(rf"(.*\.)?({key})$", name):
            return _number(value)
    return _number(config.get("lora_alpha"))


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _adapter_tensors(folder: Path) -> Iterator[tuple[str, bool, bool]]:
    """Each of the adapter's tensors by name, whether it is all zero, and whether every value
    is finite (one tensor in memory at a time)."""
    import torch

    def judged(name: str, t: Any) -> tuple[str, bool, bool]:
        return str(name), not bool(t.any()), bool(torch.isfinite(t).all())

    if (folder / "adapter_model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                yield judged(name, f.get_tensor(name))
        return
    loaded = torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
    for name, tensor in dict(loaded).items():
        yield judged(name, tensor)


def tokenizer_is_bases(folder: Path, base: Path) -> bool:
    """Whether the tokenizer files and chat template the adapter in `folder` saved (if any)
    are its base's: the model it makes then reads prompts as the base does."""
    return _same_files(folder, base, _TOKENIZER, only_present=True)


def _same_files(
    folder: Path, base: Path | None, names: tuple[str, ...], only_present: bool
) -> bool:
    """Whether each of `names` is the same in `folder` as in `base` (JSON files as values,
    without the keys that say who saved them; others byte for byte). `only_present`: only
    those `folder` has (an adapter saves none of them unless it changes them)."""
    for name in names:
        mine = folder / name
        if only_present and not mine.exists():
            continue
        theirs = base / name if base is not None else None
        if theirs is None or mine.exists() != theirs.exists():
            return False
        if not mine.exists():
            continue
        if name.endswith(".json"):
            a, b = json.loads(mine.read_text()), json.loads(theirs.read_text())
            if isinstance(a, dict) and isinstance(b, dict):
                a, b = ({k: v for k, v in d.items() if k not in _VERSION_KEYS} for d in (a, b))
            if a != b:
                return False
        elif mine.read_bytes() != theirs.read_bytes():
            return False
    return True


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
    if not _same_files(checkpoint, base, _CONFIGS + _TOKENIZER, only_present=False):
        return False
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
        header = _header(path)
        start = 8 + header.header_len
        for name, entry in header.entries.items():
            if name in out:
                return None
            begin, end = entry["data_offsets"]
            kind = (str(entry.get("dtype")), tuple(entry.get("shape") or ()))
            out[name] = _Stored(path, kind, start + begin, end - begin)
    return out


def _header(path: Path) -> SafetensorsHeader:
    """A safetensors file's header, read through a link (the Hugging Face cache links each
    snapshot's files into its blobs)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: a header of {length} bytes")
        return parse_header(f.read(length), length)


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
