"""One compile cache folder per model shape (evaluators/compile_cache.py): every checkpoint of a
run shares it wherever it lies; another shape, or other engine arguments, never do."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckpt_watcher.evaluators.compile_cache import use, with_cache


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


def test_kernels_built_at_a_cold_start_are_kept_under_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch inductor's, Triton's and FlashInfer's caches (FlashInfer builds vLLM's sampling
    kernels with nvcc on a host's first engine; 88 s on an H100) go under the root, so a fresh
    host with the state folder on persistent disk builds nothing again; a user's own win."""
    names = (
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
        "FLASHINFER_WORKSPACE_BASE",
        "VLLM_USE_AOT_COMPILE",
    )
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/mine/triton")
    root = tmp_path / "cache"
    use(str(root))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert os.environ["FLASHINFER_WORKSPACE_BASE"] == str(root / "flashinfer")
    assert os.environ["TRITON_CACHE_DIR"] == "/mine/triton"
