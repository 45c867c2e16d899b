"""One sampled task spread over two CPU slots, against the same task on one slot.

`watcher once` on one checkpoint with one sampled task (the tiny model, the addition task, K
samples a document, hf backend), first with `devices.cpu_slots: 1`, then with 2: there the second
slot joins the task as a helper and both pull chunks from its journal. Each worker process is
pinned to a core of its own as it starts (the job's own worker to core 0, the helper to core 1;
OMP_NUM_THREADS=1 in both runs), so the two-slot run has twice the compute of the one-slot run.
Figures: the task's wall time (the ledger line's duration: from the task's start to its metrics,
which include scoring every response, done once by the job's own worker), the generation alone
(from the task's start to its last response, by the job's progress file) and the whole `watcher
once`; their ratios (target <= 0.6); the tail (how long the helper sat idle, gone, while the
job's own worker finished the last chunk); metrics equal.

`--as-configured`: no pinning and no thread count set, as a user runs it: each worker takes the
compute threads the watcher gives its slot (cores / slots, devices.py), so one slot's worker
uses every core and the two-slot run's workers half each. Target: 2 slots never slower than 1
(ratio <= 1.0; before the share, a thread per core in each worker made it 2.7x slower).

Usage: python bench/spread.py [--docs 100] [--samples 16] [--as-configured] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from common import WATCHER, config, sampled_task, task_folder, trained_checkpoint

from ckpt_watcher.devices import THREAD_VARS
from ckpt_watcher.executors.processes import find_workers


def _pin_workers(
    state_dir: Path, workers: int, stop: threading.Event, pinned: dict[int, int]
) -> None:
    """Pin each worker of `state_dir` (and every thread it has) to its core as soon as it
    shows: a helper (`-help-` in its folder) to core 1, the job's own worker to core 0. Stops
    looking once `workers` are pinned (its scans of /proc would take CPU from them)."""
    while not stop.is_set() and len(pinned) < workers:
        for pid in find_workers(state_dir):
            if pid in pinned:
                continue
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                core = 1 if any(b"-help-" in a for a in argv) else 0
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.sched_setaffinity(int(tid), {core})
            except OSError:
                continue
            pinned[pid] = core
        time.sleep(0.01)


def _run(
    work: Path, ckpt: Path, tasks_dir: Path, slots: int, docs: int, samples: int, pin: bool = True
) -> dict:
    root = work / f"slots{slots}"
    shutil.rmtree(root, ignore_errors=True)
    watch = root / "ckpts"
    shutil.copytree(ckpt, watch / "r_step300")
    cfg = config(
        root / "w.yaml",
        root,
        watch,
        tasks_dir,
        [],
        devices={"gpus": [], "cpu_slots": slots},
        # fresh worker processes: the pinning tells a helper by its command line (`-help-` in
        # its job folder), which a worker forked from the starter shares with it
        executor={"kind": "local", "preload": False},
        eval={
            "batch_size": 2,
            "limit": docs,
            "tasks": [sampled_task(samples)],
        },
    )
    stop, pinned = threading.Event(), {}
    pinner = threading.Thread(target=_pin_workers, args=(root / "state", slots, stop, pinned))
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1"}
    if pin:
        pinner.start()
    else:  # the watcher's own share of the cores
        env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    began = time.perf_counter()
    try:
        r = subprocess.run(
            [*WATCHER, "--log-json", "once", "-c", str(cfg)],
            capture_output=True,
            text=True,
            env=env,
        )
    finally:
        stop.set()
        if pin:
            pinner.join()
    wall = time.perf_counter() - began
    if r.returncode != 0:
        raise SystemExit(f"watcher once failed ({r.returncode}):\n{r.stderr[-3000:]}")
    (line,) = [
        json.loads(x) for x in (root / "ledgers" / "r" / "ledger.jsonl").read_text().splitlines()
    ]
    (own,) = _progress(root, "attempt-1")
    helped = _progress(root, "attempt-1-help-*")
    return {
        "line": line,
        "wall": wall,
        "generation": own["at"] - own["since"],
        "cores": sorted(set(pinned.values())),
        "tail": own["at"] - helped[0]["at"] if helped else None,
    }


def _progress(root: Path, folder: str) -> list[dict[str, Any]]:
    """The last progress each worker wrote (at its task's end: `at` is its last response)."""
    return [json.loads(p.read_text()) for p in root.glob(f"state/jobs/*/{folder}/progress.json")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-spread"))
    ap.add_argument("--as-configured", action="store_true", help="no pinning, no thread counts")
    args = ap.parse_args()
    pin = not args.as_configured
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 cores")
    args.work.mkdir(parents=True, exist_ok=True)
    ckpt = trained_checkpoint(args.work)
    tasks_dir, _ = task_folder(args.work)
    one = _run(args.work, ckpt, tasks_dir, 1, args.docs, args.samples, pin)
    two = _run(args.work, ckpt, tasks_dir, 2, args.docs, args.samples, pin)
    docs = one["line"]["n_samples"]  # the task has 100 documents: --docs beyond is all of them
    print(
        f"task: addition, {docs} documents x {args.samples} samples, hf, "
        f"{docs * args.samples} responses"
    )
    row: dict[str, Any]
    for name, row in (("1 slot ", one), ("2 slots", two)):
        line = row["line"]
        print(
            f"{name}: task {line['duration_s']:.1f} s (generation {row['generation']:.1f} s), "
            f"watcher once {row['wall']:.1f} s, "
            f"devices {line['devices']}, cores {row['cores']}"
        )
    task_ratio = two["line"]["duration_s"] / one["line"]["duration_s"]
    target = "1.0" if args.as_configured else "0.6"
    print(
        f"wall ratio, 2 slots / 1 slot: task {task_ratio:.3f} (target <= {target}), generation "
        f"{two['generation'] / one['generation']:.3f}, watcher once {two['wall'] / one['wall']:.3f}"
    )
    print(f"tail (the helper gone while the last chunk ran): {two['tail']:.1f} s")
    print(f"metrics equal: {one['line']['metrics'] == two['line']['metrics']}")


if __name__ == "__main__":
    main()
