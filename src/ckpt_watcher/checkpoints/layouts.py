"""Which trainer's own format a checkpoint folder is, by its file names alone: the files that
make it a checkpoint (fingerprinted, staged from S3, pinned), and the folders beside them that
are part of it. No I/O, no torch: the listing layer (files.py) asks this before anything else
reads a file; reading and converting are formats/.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

# What an eval reads of a Hugging Face folder besides its weights (files.py's NEEDED), as a
# native format's config folder holds them
_HF_META = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        "preprocessor_config.json",
    }
)


@dataclass(frozen=True)
class Layout:
    """A native format's files: `weights` matches a file of the model's shards, `also` names the
    other top-level files a conversion reads, `meta` the folder holding config and tokenizer."""

    name: str
    weights: re.Pattern[str]
    also: frozenset[str]
    meta: str

    def matches(self, names: Collection[str]) -> bool:
        return any(self.weights.match(n) for n in names)

    def needed(self, names: Collection[str]) -> list[str]:
        prefix = f"{self.meta}/"
        return sorted(
            n
            for n in names
            if self.weights.match(n)
            or n in self.also
            or (n.startswith(prefix) and n[len(prefix) :] in _HF_META)
        )


# verl's FSDP checkpoints (rllm's and SkyRL's too): formats/verl_fsdp.py
VERL_FSDP = Layout(
    "verl-fsdp",
    re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$"),
    frozenset({"fsdp_config.json"}),
    "huggingface",
)
LAYOUTS = (VERL_FSDP,)


def native_layout(names: Collection[str]) -> Layout | None:
    """The native format whose files these top-level names are, if any."""
    return next((lay for lay in LAYOUTS if lay.matches(names)), None)
