"""LoRA/PEFT adapters saved alone: what marks one, which base model it belongs to, and an
identity that covers both.

A trainer with PEFT (HF Trainer, TRL, Axolotl, LLaMA-Factory) saves each `checkpoint-N` as
`adapter_config.json` and `adapter_model.safetensors` (`.bin` in older peft): no `config.json`,
no model weights. The watcher evaluates the model it makes: the worker merges the adapter into
its base (`worker/merge.py`) and every backend and harness reads that merged copy, while the
ledger files the result under the adapter's run and step.

The base is the source's `adapter_base` when set; else the adapter's own
`base_model_name_or_path`, when that is a folder here or a model in the local Hugging Face cache
(never downloaded). The checkpoint's fingerprint covers the adapter's files and the base's
(`with_base`), so the same adapter over another base is other content.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import cast

from ckpt_watcher.checkpoints.files import (
    ADAPTER_CONFIG,
    CheckpointFiles,
    LocalFiles,
    eval_mark,
    needed_files,
    read_json,
)
from ckpt_watcher.checkpoints.fingerprint import Mode, fingerprint
from ckpt_watcher.errors import AdapterError, CheckpointChanged

# peft types whose weights merge into the base's (prompt and prefix tuning add virtual tokens:
# the model they make is not a set of weights)
UNMERGEABLE = frozenset({"PROMPT_TUNING", "PREFIX_TUNING", "P_TUNING", "MULTITASK_PROMPT_TUNING"})


def is_adapter(names: dict[str, int] | list[str]) -> bool:
    """An adapter saved alone: its config, and no weights but the adapter's."""
    return ADAPTER_CONFIG in needed_files(dict.fromkeys(names, 0))


def read_config(files: CheckpointFiles) -> dict | str:
    """The adapter's config, or what is wrong with it (it may still be being written)."""
    return read_json(files, ADAPTER_CONFIG)


def unmergeable(config: dict) -> str:
    """Why this adapter cannot be merged into its base ("" when it can)."""
    kind = str(config.get("peft_type", ""))
    if kind.upper() in UNMERGEABLE:
        return (
            f"a {kind} adapter adds virtual tokens instead of changing weights: the watcher "
            "evaluates models it can merge (LoRA and its kin); evaluate it with peft yourself"
        )
    return ""


def resolve_base(files: CheckpointFiles, override: Path | None, where: str) -> Path:
    """The base model's folder: `override` (the source's `adapter_base`), else the adapter's
    `base_model_name_or_path` as a folder here or in the local Hugging Face cache."""
    if override is not None:
        if not (override / "config.json").is_file():
            raise AdapterError(
                f"{where}: adapter_base {override} holds no config.json: point it at the base "
                "model's folder"
            )
        return override
    config = read_config(files)
    name = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not name:
        raise AdapterError(
            f"{where}: a LoRA/PEFT adapter that names no base model: set `adapter_base` on its "
            "source to the base model's folder"
        )
    path = Path(str(name)).expanduser()
    if (path / "config.json").is_file():
        return path
    cached = _hub_cache(str(name), config.get("revision") if isinstance(config, dict) else None)
    if cached is not None:
        return cached
    raise AdapterError(
        f"{where}: a LoRA/PEFT adapter of {name!r}, which is neither a folder here nor in the "
        "local Hugging Face cache: set `adapter_base` on its source to the base model's folder "
        "(the watcher merges the adapter into it to evaluate it)"
    )


def _hub_cache(repo_id: str, revision: str | None) -> Path | None:
    """A model in the local Hugging Face cache (HF_HOME): never downloaded."""
    if repo_id.startswith(("/", ".", "~")) or repo_id.count("/") > 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # not cached, or not a repo id: said by the caller
        return None
    return path if (path / "config.json").is_file() else None


_base_fingerprints: dict[tuple[str, str, str], str] = {}
_lock = threading.Lock()


def with_base(adapter_fingerprint: str, base: Path, mode: Mode) -> str:
    """The fingerprint of the model the adapter makes: its own and its base's, in one value of
    the same form (`<mode>:<32 hex digits>`). The base's is taken once per version of its files."""
    view = LocalFiles(base, follow_links=True)
    key = (str(base), eval_mark(view), mode)
    with _lock:
        base_fp = _base_fingerprints.get(key)
    if base_fp is None:
        base_fp = fingerprint(view, mode)
        with _lock:
            _base_fingerprints[key] = base_fp
    both = hashlib.sha256(f"{adapter_fingerprint}+{base_fp}".encode()).hexdigest()[:32]
    return f"{mode}:{both}"


def check_base(view: CheckpointFiles, base: Path, judged: str, what: str) -> None:
    """Raise CheckpointChanged unless `view` over `base` still gives the fingerprint `judged`
    (`with_base`'s): a base rewritten since sends `what` (the adapter, the checkpoint whose
    config is the base's) to be judged again, as its own files would."""
    mode = cast(Mode, judged.partition(":")[0])
    if with_base(fingerprint(view, mode), base, mode) != judged:
        raise CheckpointChanged(
            f"{what}: its base model {base} is not the one it was judged with (its files "
            "changed since): it is judged again"
        )
