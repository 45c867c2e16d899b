"""Scheduling quality on a synthetic workload: the real daemon loop, 8 fake GPUs, evaluators of
known durations (a simulated executor), checkpoints x 5 tasks, all ready at once.

Reports makespan / lower bound (lower bound = max(total work / devices, longest task)) and the
gap between one job's end and the next job's start on the same device.
Targets: makespan / lower bound <= 1.10; gap p95 < 0.5 s.
Usage: python bench/scheduling.py [--scale 0.1]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from datetime import datetime
from pathlib import Path

from common import fake_checkpoint

from ckpt_watcher.config import parse_config
from ckpt_watcher.daemon import Daemon
from ckpt_watcher.devices import FakeGpu, FakeInventory
from ckpt_watcher.executors.simulated import SimulatedExecutor
from ckpt_watcher.ledger import ledger_path, read_lines

TASKS = {"gsm8k": 8.0, "mbpp": 5.0, "humaneval": 3.0, "ifeval": 2.0, "arc": 1.0}  # relative


def ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def scenario(work: Path, checkpoints: int, gpus: int, scale: float) -> dict[str, float]:
    shutil.rmtree(work, ignore_errors=True)
    for s in range(1, checkpoints + 1):
        fake_checkpoint(work / "ckpts" / f"r_step{s}")
    cfg = parse_config(
        {
            "state_dir": str(work / "state"),
            "ledger_dir": str(work / "ledgers"),
            "sources": [{"kind": "local", "path": str(work / "ckpts"), "inotify": False}],
            "eval": {"tasks": [{"task": t, "num_fewshot": 0} for t in TASKS]},
        }
    )
    inv = FakeInventory([FakeGpu(i, f"GPU-{i}") for i in range(gpus)])
    daemon = Daemon(
        cfg,
        once=True,
        inventory=inv,
        executor_factory=lambda cb: SimulatedExecutor(cb, lambda t, k: TASKS[t] * scale),
    )
    daemon.run()
    lines = read_lines(ledger_path(cfg.ledger_dir, "r")).lines
    assert len(lines) == checkpoints * len(TASKS) and all(ln["status"] == "ok" for ln in lines)
    makespan = max(ts(ln["finished_at"]) for ln in lines) - min(
        ts(ln["started_at"]) for ln in lines
    )
    total = checkpoints * sum(TASKS.values()) * scale
    bound = max(total / gpus, max(TASKS.values()) * scale)
    jobs: dict[str, list[dict]] = {}
    for ln in lines:
        jobs.setdefault(ln["job_id"], []).append(ln)
    per_device: dict[str, list[tuple[float, float]]] = {}
    for parts in jobs.values():
        start = min(ts(p["started_at"]) for p in parts)
        end = max(ts(p["finished_at"]) for p in parts)
        per_device.setdefault(parts[0]["device"], []).append((start, end))
    gaps = []
    for spans in per_device.values():
        spans.sort()
        gaps += [b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False)]
    gaps.sort()
    p95 = gaps[int(0.95 * (len(gaps) - 1))] if gaps else 0.0
    return {
        "makespan": makespan,
        "bound": bound,
        "ratio": makespan / bound,
        "gap_p95": p95,
        "gap_median": statistics.median(gaps) if gaps else 0.0,
        "jobs": len(jobs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--scale", type=float, default=0.1, help="seconds per unit of task duration")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for checkpoints, gpus in ((40, 8), (3, 8)):
            r = scenario(Path(tmp) / f"c{checkpoints}", checkpoints, gpus, args.scale)
            print(
                f"{checkpoints} checkpoints x {len(TASKS)} tasks on {gpus} GPUs: {r['jobs']} jobs, "
                f"makespan {r['makespan']:.2f}s, lower bound {r['bound']:.2f}s, ratio {r['ratio']:.3f} "
                f"(target <= 1.10); gap median {r['gap_median'] * 1000:.1f} ms, "
                f"p95 {r['gap_p95'] * 1000:.1f} ms (target < 500 ms)"
            )


if __name__ == "__main__":
    main()
