"""Overhead: the watcher's eval of one checkpoint (`watcher once`: daemon + worker + ledger) vs a
direct `lm_eval` CLI run of the same tasks, same backend (hf), alternated A B A B in one run.

Target: ratio (watcher / lm_eval) at most 1.05.
Usage: python bench/overhead.py [--rounds 5] [--work /tmp/bench-overhead]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
from pathlib import Path

from common import BIN, WATCHER, config, summary, task_folder, timed, trained_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-overhead"))
    args = ap.parse_args()
    work = args.work
    ckpt = trained_checkpoint(work)
    tasks_dir, tasks = task_folder(work, copies=2)
    direct = [
        str(BIN / "lm_eval"),
        "--model",
        "hf",
        "--model_args",
        f"pretrained={ckpt},dtype=float32,max_length=64",
        "--tasks",
        ",".join(tasks),
        "--num_fewshot",
        "0",
        "--include_path",
        str(tasks_dir),
        "--seed",
        "42",
        "--batch_size",
        "1",
        "--device",
        "cpu",
        "--gen_kwargs",
        "temperature=0",
    ]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    ours, theirs, ratios = [], [], []
    for i in range(args.rounds + 1):  # round 0 warms the page cache, not counted
        root = work / f"round{i}"
        shutil.rmtree(root, ignore_errors=True)
        watch = root / "ckpts"
        watch.mkdir(parents=True)
        shutil.copytree(ckpt, watch / "bench_step300")
        cfg = config(root / "w.yaml", root, watch, tasks_dir, tasks, eval={"batch_size": 1})
        a = timed([*WATCHER, "--log-level", "WARNING", "once", "-c", str(cfg)])
        b = timed(direct, env=env)
        if i == 0:
            continue
        ours.append(a)
        theirs.append(b)
        ratios.append(a / b)
        print(f"round {i}: watcher once {a:.2f}s  lm_eval {b:.2f}s  ratio {a / b:.3f}", flush=True)
    print(f"watcher once (s): {summary(ours)}")
    print(f"lm_eval CLI  (s): {summary(theirs)}")
    print(f"ratio watcher/lm_eval: {summary(ratios)}")
    print(f"target <= 1.05: median ratio {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
