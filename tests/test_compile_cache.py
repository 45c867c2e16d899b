"""One compile cache folder per model shape (evaluators/compile_cache.py): every checkpoint of a
run shares it wherever it lies; another shape, or other engine arguments, never do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    # use() moves inductor's precompiled headers (restored after); its import sets
    # TORCHINDUCTOR_CACHE_DIR when unset, so it comes first
    from torch._inductor import codecache

    for name in ("_HEADER_DIR", "_HEADER_LOCK_DIR"):
        monkeypatch.setattr(codecache, name, getattr(codecache, name))
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/mine/triton")
    root = tmp_path / "cache"
    use(str(root))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert os.environ["FLASHINFER_WORKSPACE_BASE"] == str(root / "flashinfer")
    assert os.environ["TRITON_CACHE_DIR"] == "/mine/triton"
    assert codecache._HEADER_DIR == str(root / "inductor" / "precompiled_headers")
    # torch's own default, which it writes into the environment where none was set (inherited
    # from a launcher that imported torch), is not a user's choice; a user's own folder is
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_someone")
    use(str(root))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine/inductor")
    use(str(root))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/mine/inductor"
    assert codecache._HEADER_DIR == "/mine/inductor/precompiled_headers"


# A worker's start as far as compiling goes: its own temporary folder (scratch.py), the compile
# cache, then a CPU kernel compiled by torch inductor (which precompiles its C++ header first)
COMPILE_IN_A_WORKER = """
import sys, torch
from ckpt_watcher import scratch
from ckpt_watcher.evaluators.compile_cache import use
scratch.enter()
use(sys.argv[1])
power = int(sys.argv[2])
print(float(torch.compile(lambda x: (x ** power).sum())(torch.arange(4.0))))
"""


@pytest.mark.e2e
def test_each_workers_kernels_reuse_one_precompiled_header_under_the_root(
    tmp_path: Path,
) -> None:
    """torch files its precompiled C++ header under the temporary folder it finds at import,
    and each worker has one of its own: every cold start on a CPU built it again (about 5 s
    of g++). Under the root, the first worker builds it and the next ones use it."""
    root = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR", "TRITON"))}
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    # as a launcher that had imported torch leaves it (torch's own default, in its /tmp)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "tmp" / "torchinductor_launcher")

    def worker(power: int) -> float:
        done = subprocess.run(
            [sys.executable, "-c", COMPILE_IN_A_WORKER, str(root), str(power)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return float(done.stdout.split()[-1])

    assert worker(2) == 14.0  # 0 + 1 + 4 + 9
    (header,) = (root / "inductor" / "precompiled_headers").glob("*.gch")
    built = header.stat().st_mtime_ns
    assert not list((tmp_path / "tmp").rglob("*.gch")), "built in a temporary folder"
    assert worker(3) == 36.0  # another kernel, compiled with the same header
    assert [p.stat().st_mtime_ns for p in header.parent.glob("*.gch")] == [built]
