"""What an engine needs of a checkpoint before its weights: the model's config, tokenizer and
generation files, once they are all there and whole. A trainer writes them first (Hugging Face
`save_pretrained` beside its shards, verl's `huggingface/` folder before its ranks' files), so
a run's model is known while its step is still being written (jobs/early.py). A LoRA step
saved alone names its base in its adapter config."""

from __future__ import annotations

import json
from pathlib import Path

from ckpt_watcher.checkpoints.layouts import HF_META

CONFIG = "config.json"
ADAPTER = "adapter_config.json"  # a LoRA step saved alone: its base is the model
TOKENIZERS = ("tokenizer.json", "tokenizer_config.json")
# where a step's config sits, below the step's folder: its top, verl's (actor/)huggingface/
PLACES = ("", "huggingface", "actor/huggingface")


def find(step: Path, tokenizer_required: bool = True) -> list[Path] | None:
    """The meta files of the step's model (config, tokenizer, generation config...) in the first
    place that has a whole set, else None. JSON files must parse: one being written is half
    written for a moment."""
    for place in PLACES:
        files = _whole(step / place if place else step, tokenizer_required)
        if files is not None:
            return files
    return None


def _whole(folder: Path, tokenizer_required: bool) -> list[Path] | None:
    try:
        names = sorted(n for n in HF_META | {"spiece.model"} if (folder / n).is_file())
    except OSError:
        return None
    if CONFIG not in names or (tokenizer_required and not set(TOKENIZERS) & set(names)):
        return None
    for name in names:
        if name.endswith(".json"):
            try:
                json.loads((folder / name).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
    return [folder / n for n in names]


def adapter(step: Path) -> Path | None:
    """The step's `adapter_config.json` when it is whole (a LoRA adapter saved alone, whose base
    an engine can load before the adapter is complete), else None."""
    path = step / ADAPTER
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return path
