"""The worker starter (executor.preload): `watcher once` over N checkpoints of one run with hf on
one CPU slot, workers forked from one starter that imported torch, transformers and lm-eval
once, against every worker a fresh process (`executor.preload: false`), alternated in one run.
Prints wall seconds and the CPU seconds of the whole process tree (the daemon, the starter and
every worker: all are waited for, so `RUSAGE_CHILDREN` counts them), and their ratios.

Usage: python bench/starter.py [--checkpoints 6] [--rounds 2] [--work /tmp/bench-starter]
"""

from __future__ import annotations

import argparse
import resource
import shutil
from pathlib import Path

from common import WATCHER, config, distinct_copy, summary, task_folder, timed, trained_checkpoint


def cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def once(root: Path, watch: Path, tasks_dir: Path, preload: bool) -> tuple[float, float]:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cfg = config(
        root / "w.yaml",
        root,
        watch,
        tasks_dir,
        ["addition"],
        executor={"kind": "local", "preload": preload},
    )
    cpu = cpu_of_children()
    wall = timed([*WATCHER, "--log-level", "WARNING", "once", "-c", str(cfg)])
    return wall, cpu_of_children() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoints", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-starter"))
    args = ap.parse_args()
    ckpt = trained_checkpoint(args.work)
    tasks_dir, _ = task_folder(args.work)
    watch = args.work / "ckpts"
    shutil.rmtree(watch, ignore_errors=True)
    for step in range(1, args.checkpoints + 1):
        distinct_copy(ckpt, watch / f"bench_step{step}")
    figures: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
    walls, cpus = [], []
    for r in range(1, args.rounds + 1):
        for preload in (True, False):
            wall, cpu = once(args.work / f"preload-{preload}", watch, tasks_dir, preload)
            figures[preload][0].append(wall)
            figures[preload][1].append(cpu)
            print(f"round {r}: preload {preload}: {wall:.1f} s wall, {cpu:.1f} CPU-s", flush=True)
        walls.append(figures[True][0][-1] / figures[False][0][-1])
        cpus.append(figures[True][1][-1] / figures[False][1][-1])
    n = args.checkpoints
    for preload, label in ((True, "forked from a starter"), (False, "fresh processes")):
        print(f"{n} checkpoints, {label}: wall (s) {summary(figures[preload][0])}")
        print(f"{n} checkpoints, {label}: CPU (s)  {summary(figures[preload][1])}")
    print(f"ratio forked/fresh, wall: {summary(walls)}")
    print(f"ratio forked/fresh, CPU:  {summary(cpus)}")


if __name__ == "__main__":
    main()
