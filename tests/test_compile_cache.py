"""One compile cache folder per model shape (evaluators/compile_cache.py): every checkpoint of a
run shares it wherever it lies; another shape, or other engine arguments, never do."""

from __future__ import annotations

import json
from pathlib import Path

from ckpt_watcher.evaluators.compile_cache import with_cache


def checkpoint(folder: Path, hidden: int = 128) -> str:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps({"model_type": "llama", "hidden_size": hidden, "_name_or_path": str(folder)})
    )
    (folder / "tokenizer.json").write_text("{}")
    return str(folder)


def cache_dir(args: dict) -> str:
    return str(args["compilation_config"]["cache_dir"])


def test_checkpoints_of_one_shape_share_a_folder_under_the_root(tmp_path: Path) -> None:
    root = str(tmp_path / "cache")
    args = {"dtype": "bfloat16", "max_model_len": 4096}
    a = with_cache(args, root, checkpoint(tmp_path / "run" / "step_100"))
    b = with_cache(args, root, checkpoint(tmp_path / "elsewhere" / "checkpoint-200"))
    assert cache_dir(a) == cache_dir(b)
    assert cache_dir(a).startswith(root + "/vllm/")
    assert args == {"dtype": "bfloat16", "max_model_len": 4096}  # the caller's dict is left alone
    wider = with_cache(args, root, checkpoint(tmp_path / "wide", hidden=256))
    assert cache_dir(wider) != cache_dir(a)
    longer = with_cache(args | {"max_model_len": 8192}, root, checkpoint(tmp_path / "c"))
    assert cache_dir(longer) != cache_dir(a)


def test_a_users_own_compile_settings_are_kept(tmp_path: Path) -> None:
    root = str(tmp_path / "cache")
    ckpt = checkpoint(tmp_path / "a")
    mine = {"compilation_config": {"cache_dir": "/mine", "mode": 3}}
    assert with_cache(mine, root, ckpt) == mine
    level = {"compilation_config": 0}
    assert with_cache(level, root, ckpt) == level
    merged = with_cache({"compilation_config": {"mode": 3}}, root, ckpt)
    assert merged["compilation_config"]["mode"] == 3 and "cache_dir" in merged["compilation_config"]
    assert with_cache({}, None, ckpt) == {}
