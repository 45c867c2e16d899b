"""vLLM on CPU: an engine core in the worker's own process against vLLM's default (a spawned
engine core process, which imports torch and vLLM again), side by side in one run.

Each measurement is a fresh process, as a worker is: it builds the engine twice (the second
start is what a warm worker's check against a fresh load pays) and generates once with each.
Prints the seconds to import vLLM, each engine start, and the process's whole life, per mode,
alternated spawn / in-process over --rounds rounds; then the medians.
Usage: python bench/vllm_cpu_start.py [--rounds 2] [--work /tmp/bench-vllm-start]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROBE = r"""
import json, os, sys, time
def main():
    began = time.monotonic()
    os.environ.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1")
    from ckpt_watcher.evaluators.harness import clamped_backend
    cls = clamped_backend("vllm")
    imported = time.monotonic()
    starts = []
    for _ in range(2):
        t = time.monotonic()
        lm = cls(pretrained=sys.argv[1], dtype="float32", max_model_len=64,
                 enforce_eager=True, seed=1234, tensor_parallel_size=1)
        starts.append(round(time.monotonic() - t, 2))
        from vllm import SamplingParams
        out = lm.model.generate(["12+34="], SamplingParams(temperature=0, max_tokens=4),
                                use_tqdm=False)
        text = out[0].outputs[0].text
        lm.model.llm_engine.engine_core.shutdown()
        del lm
    print(json.dumps({"import_s": round(imported - began, 2), "starts_s": starts,
                      "text": text}))
if __name__ == "__main__":
    main()
"""


def checkpoint(work: Path) -> Path:
    from ckpt_watcher.demo.tiny import VLLM_HEADS, build_model, build_tokenizer, save_checkpoint

    out = work / "tiny"
    if not (out / "model.safetensors").exists():
        tok = build_tokenizer()
        save_checkpoint(build_model(len(tok), heads=VLLM_HEADS), tok, out, naming_bug=False)
    return out


def measure(ckpt: Path, in_process: bool) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="-1")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    began = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", PROBE, str(ckpt)], env=env, capture_output=True, text=True
    )
    life = round(time.monotonic() - began, 2)
    if r.returncode != 0:
        sys.exit(f"probe failed ({'in-process' if in_process else 'spawned'}):\n{r.stderr[-3000:]}")
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    return figures | {"life_s": life}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-vllm-start"))
    args = ap.parse_args()
    ckpt = checkpoint(args.work)
    runs: dict[str, list[dict]] = {"spawned": [], "in-process": []}
    for i in range(args.rounds):
        for name in ("spawned", "in-process"):
            fig = measure(ckpt, name == "in-process")
            runs[name].append(fig)
            print(f"round {i + 1} {name:10s}: {fig}", flush=True)
    texts = {f["text"] for figs in runs.values() for f in figs}
    for name, figs in runs.items():
        first = statistics.median(f["starts_s"][0] for f in figs)
        second = statistics.median(f["starts_s"][1] for f in figs)
        life = statistics.median(f["life_s"] for f in figs)
        print(f"{name:10s}: engine start {first:.1f} s, second start {second:.1f} s, "
              f"process life {life:.1f} s (medians of {len(figs)})")  # fmt: skip
    print(f"same greedy text in every run: {len(texts) == 1}")


if __name__ == "__main__":
    main()
