"""The worker starter (executor.preload): `watcher once` over N checkpoints of one run with hf on
one CPU slot, workers forked from one starter that imported torch, transformers and lm-eval
once, against every worker a fresh process (`executor.preload: false`), alternated in one run.
Prints wall seconds and the CPU seconds of the whole process tree (the daemon, the starter and
every worker: all are waited for, so `RUSAGE_CHILDREN` counts them), and their ratios.

With `--warm`: warm workers (`eval.warm_engine`) under `watcher run`, released after 2 idle
seconds, each checkpoint appearing once the last one's worker has let its engine go, so each
is evaluated by a newly started warm worker, as when checkpoints come further apart than
`eval.warm_idle_seconds`. Prints the seconds from each checkpoint's appearance to its ledger
line, the first (which waits for the starter's imports) apart from the rest.

Usage: python bench/starter.py [--checkpoints 6] [--rounds 2] [--warm [--backend vllm]]
                               [--work /tmp/bench-starter]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from common import WATCHER, config, distinct_copy, summary, task_folder, timed, trained_checkpoint


def cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _config(root: Path, watch: Path, tasks_dir: Path, preload: bool, **over: Any) -> Path:
    """The addition task's config in `root`, workers forked from a starter or not."""
    executor = {"kind": "local", "preload": preload}
    return config(root / "w.yaml", root, watch, tasks_dir, ["addition"], executor=executor, **over)


def once(root: Path, watch: Path, tasks_dir: Path, preload: bool) -> tuple[float, float]:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cfg = _config(root, watch, tasks_dir, preload)
    cpu = cpu_of_children()
    wall = timed([*WATCHER, "--log-level", "WARNING", "once", "-c", str(cfg)])
    return wall, cpu_of_children() - cpu


def _lines(root: Path) -> int:
    path = root / "ledgers" / "bench" / "ledger.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _released(root: Path) -> bool:
    for path in (root / "state" / "jobs" / "_warm").glob("*/engine.json"):
        try:
            return bool(json.loads(path.read_text())["state"] == "released")
        except (OSError, ValueError):
            return False
    return False


def _until(what: str, done: object, daemon: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what} (daemon exit {daemon.poll()})")
        time.sleep(0.05)


def warm_latencies(
    root: Path, staged: list[Path], tasks_dir: Path, preload: bool, backend: str
) -> list[float]:
    """Seconds from each checkpoint's appearance to its ledger line, each checkpoint evaluated
    by a newly started warm worker of one `watcher run`."""
    shutil.rmtree(root, ignore_errors=True)
    watch = root / "ckpts"
    watch.mkdir(parents=True)
    args = {"dtype": "float32", "max_model_len": 64}
    if backend == "vllm":
        args["enforce_eager"] = True
    cfg = _config(
        root,
        watch,
        tasks_dir,
        preload,
        sources=[{"kind": "local", "path": str(watch), "poll_seconds": 0.2}],
        stable_seconds=0,
        settle_seconds=0,
        eval={"backend": backend, "model_args": args, "warm_engine": True, "warm_idle_seconds": 2},
    )
    latencies = []
    with open(root / "daemon.log", "wb") as log:
        daemon = subprocess.Popen(
            [*WATCHER, "--log-level", "WARNING", "run", "-c", str(cfg)], stdout=log, stderr=log
        )
        try:
            for i, ckpt in enumerate(staged):
                copy = root / "staging" / ckpt.name
                shutil.copytree(ckpt, copy)
                began = time.monotonic()
                copy.rename(watch / ckpt.name)  # appears at once, as a trainer's atomic save
                _until(f"line {i + 1}", lambda n=i + 1: _lines(root) >= n, daemon)
                latencies.append(time.monotonic() - began)
                _until("the warm engine's release", lambda: _released(root), daemon)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(120)
    return latencies


def warm_main(args: argparse.Namespace, ckpt: Path, tasks_dir: Path) -> None:
    shutil.rmtree(args.work / "staged", ignore_errors=True)
    staged = [
        distinct_copy(ckpt, args.work / "staged" / f"bench_step{step}")
        for step in range(1, args.checkpoints + 1)
    ]
    first: dict[bool, list[float]] = {True: [], False: []}
    later: dict[bool, list[float]] = {True: [], False: []}
    for r in range(1, args.rounds + 1):
        for preload in (True, False):
            root = args.work / f"warm-{preload}"
            got = warm_latencies(root, staged, tasks_dir, preload, args.backend)
            first[preload].append(got[0])
            later[preload].extend(got[1:])
            shown = " ".join(f"{x:.1f}" for x in got)
            print(f"round {r}: preload {preload}: seconds to each line: {shown}", flush=True)
    for preload, label in ((True, "forked from a starter"), (False, "fresh processes")):
        print(
            f"{args.backend}, warm workers {label}: first checkpoint (s) {summary(first[preload])}"
        )
        print(
            f"{args.backend}, warm workers {label}: later ones (s)       {summary(later[preload])}"
        )
    ratio = [a / b for a, b in zip(later[True], later[False], strict=True)]
    print(f"ratio forked/fresh, a later checkpoint's seconds to its line: {summary(ratio)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoints", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-starter"))
    ap.add_argument("--warm", action="store_true", help="warm workers, one per checkpoint")
    ap.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="with --warm")
    args = ap.parse_args()
    ckpt = trained_checkpoint(args.work)
    tasks_dir, _ = task_folder(args.work)
    if args.warm:
        warm_main(args, ckpt, tasks_dir)
        return
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
