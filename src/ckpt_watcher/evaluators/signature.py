"""A model's *signature*: equal for two checkpoints whose weights can be swapped into one
engine (or one model server), and the key of its compiled kernels (compile_cache.py).

It is the checkpoint's `config.json` apart from fields that do not change the graph, its
tokenizer and generation files, the backend and the engine's arguments. A leaf: the keeper, the
compile cache and the model server all read it, and it reads nothing of theirs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ckpt_watcher.errors import SwapError

# config.json fields a trainer rewrites without changing the model's graph
GRAPH_NEUTRAL_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})
# files beside the weights that decide the tokens and generation (never optimizer/trainer state)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def model_signature(checkpoint: Path, backend: str, args: dict[str, Any]) -> str:
    """Equal for two checkpoints whose weights can be swapped into one engine."""
    try:
        config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SwapError(f"{checkpoint}/config.json unreadable: {e}") from e
    graph = {k: v for k, v in config.items() if k not in GRAPH_NEUTRAL_CONFIG_KEYS}
    files = {}
    for name in TOKENIZER_FILES:
        path = checkpoint / name
        if path.is_file():
            files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    blob = json.dumps(
        {"backend": backend, "args": args, "config": graph, "files": files},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
