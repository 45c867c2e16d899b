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
import re
import threading
from pathlib import Path
from typing import Any, cast

from ckpt_watcher.checkpoints.files import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
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


def adapter_so_far(names: dict[str, int] | list[str]) -> bool:
    """A step being written that is an adapter so far: its config, and no model weights (its
    own may be still to come)."""
    model = [n for n in names if n.endswith(".safetensors") or n.startswith("pytorch_model")]
    return ADAPTER_CONFIG in names and set(model) <= set(ADAPTER_WEIGHTS)


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


# the ranks vLLM's LoRA kernels are built for (its `max_lora_rank` choices, 0.26 to 0.32)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def unservable(config: dict) -> str:
    """Why vLLM should not serve this adapter on its base as it is ("" when it can): the
    worker merges such an adapter instead (worker/merge.py). What vLLM refuses or applies
    otherwise than peft is left to the merge: other PEFT methods, DoRA, whole modules or token
    rows trained beside the LoRA (`modules_to_save`, `trainable_token_indices`), biases, added
    layers, per-module ranks or scales, LoRA on the embeddings or the head, a rank above
    vLLM's kernels'."""
    kind = str(config.get("peft_type", "")).upper()
    if kind != "LORA":
        return f"a {kind or 'PEFT'} adapter, not LoRA"
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= VLLM_LORA_RANKS[-1]:
        return f"its rank {rank!r} is not one vLLM serves (1 to {VLLM_LORA_RANKS[-1]})"
    for key, what in (
        ("use_dora", "DoRA"),
        ("modules_to_save", "whole modules trained beside the LoRA (modules_to_save)"),
        ("trainable_token_indices", "trained token rows (trainable_token_indices)"),
        ("lora_bias", "a bias on lora_B"),
        ("layer_replication", "replicated layers"),
        ("rank_pattern", "per-module ranks (rank_pattern)"),
        ("alpha_pattern", "per-module scales (alpha_pattern)"),
        ("layers_to_transform", "LoRA on some layers only (layers_to_transform)"),
        ("exclude_modules", "excluded modules (exclude_modules)"),
    ):
        if config.get(key):
            return f"it has {what}"
    for key, what in (
        ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)"),
        ("use_qalora", "QALoRA"),
        ("use_bdlora", "block-diagonal LoRA"),
    ):
        if config.get(key):
            return f"it is {what}"
    init = config.get("init_lora_weights", True)
    if init not in (True, False, "gaussian", None):  # PiSSA, OLoRA, LoftQ, CorDA, EVA...
        return f"its init_lora_weights is {init!r} (vLLM refuses or applies it otherwise)"
    if config.get("bias", "none") not in ("none", None):
        return f"it trains biases (bias: {config.get('bias')})"
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    if any("embed" in str(n) or "lm_head" in str(n) for n in names):
        return "it adapts the embeddings or the head"
    return ""


_PEFT_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<side>[AB])\.weight$")


def unfit(folder: Path, base: Path, config: dict) -> str:
    """Why the adapter's tensors do not fit `base` as vLLM would serve them ("" when they do):
    vLLM takes tensors under names it does not know, or of other shapes, without a word, and
    would then serve the base (or a cut adapter) as the adapter. Every tensor must be peft's
    `base_model.model.<module>.lora_A|B.weight` of a module the base has a weight for, A
    [r, in] and B [out, r] for that weight's [out, in]. Read from the headers alone; an
    adapter saved otherwise than as safetensors is left to the merge, which says what is wrong."""
    from ckpt_watcher.checkpoints.namefix import weight_files
    from ckpt_watcher.checkpoints.safetensors_header import read_local_header

    saved = folder / "adapter_model.safetensors"
    if not saved.is_file():
        return "its weights are not in adapter_model.safetensors"
    shapes: dict[str, list[int]] = {}
    files = weight_files(base)
    if not files:
        return f"its base {base} has no safetensors weights"
    for f in files:
        shapes |= {n: e.get("shape") for n, e in read_local_header(f).entries.items()}
    rank = config.get("r")
    sides: dict[str, set[str]] = {}
    for name, entry in read_local_header(saved).entries.items():
        found = _PEFT_NAME.match(name)
        if found is None:
            return f"its tensor {name!r} is not named as peft names a LoRA weight"
        weight = shapes.get(f"{found['module']}.weight")
        if not isinstance(weight, list) or len(weight) != 2:
            return f"its tensor {name!r} adapts no weight of the base"
        out, inner = weight
        want = [rank, inner] if found["side"] == "A" else [out, rank]
        if entry.get("shape") != want:
            return f"its tensor {name!r} is {entry.get('shape')}, not {want} as the base's {weight}"
        sides.setdefault(found["module"], set()).add(found["side"])
    half = sorted(m for m, s in sides.items() if s != {"A", "B"})
    if half:
        return f"its module {half[0]} has only lora_{''.join(sides[half[0]])}"
    # peft loads the tensors of the modules its config targets, no others: vLLM would apply
    # whatever tensors there are, and leave a targeted module without them unchanged
    linear = {n.removesuffix(".weight") for n, s in shapes.items() if n.endswith(".weight")}
    linear = {m for m in linear if isinstance(shapes[f"{m}.weight"], list)}
    linear = {m for m in linear if len(shapes[f"{m}.weight"]) == 2}
    targeted = {m for m in linear if _targets(config.get("target_modules"), m)}
    if set(sides) != targeted:
        gap = sorted(targeted - set(sides)) or sorted(set(sides) - targeted)
        return (
            f"its tensors cover {len(set(sides) & targeted)} of the {len(targeted)} modules its "
            f"config targets in the base ({gap[0]} is {'missing' if gap[0] in targeted else 'extra'})"
        )
    return ""


def _targets(targets: Any, module: str) -> bool:
    """Whether peft's `target_modules` select `module` (a name in the model): a name list
    matches a module's name or its end after a dot, a string is a full regular expression,
    `all-linear` every linear layer but the embeddings and the head."""
    if targets == "all-linear":
        return "embed" not in module and "lm_head" not in module
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in targets or [] if isinstance(t, str))


def served_rank(config: dict) -> int:
    """vLLM's `max_lora_rank` for this (servable) adapter: the smallest it has at least `r`."""
    return next(r for r in VLLM_LORA_RANKS if r >= int(config["r"]))


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
