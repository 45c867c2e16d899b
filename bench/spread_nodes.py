"""One sampled task on one Ray node's GPU, against the same task spread over two nodes' GPUs.

A Ray cluster of two raylets on this machine, each pinned to a core of its own (`taskset`: its
agent and the workers it starts inherit the core) and each with a fake NVML file of one GPU
(workers compute on the CPU, OMP_NUM_THREADS=1). `watcher once` with `executor: {kind: ray,
shared_dir}` on one checkpoint with one sampled task (the tiny model, hf backend, K samples a
document), first with the second node's GPU held by "training" (the task runs on the head's
GPU alone), then with both GPUs idle (the second node's GPU joins the task as a helper: chunks
claimed from the journal on the shared folder). Figures: the task's wall time (the ledger
line's duration, scoring included), the whole `watcher once` (the agents' start included),
their ratio, and whether the metrics are equal.

Usage: python bench/spread_nodes.py [--docs 100] [--samples 16] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from common import BIN, WATCHER, config, sampled_task, task_folder, trained_checkpoint

TRAINING = [4242, 30000, 95]


def _nvml(path: Path, index: int, foreign: list[list[int]]) -> None:
    gpu = {"index": index, "uuid": f"GPU-{path.stem}-{index}", "foreign": foreign}
    path.write_text(json.dumps({"gpus": [gpu]}))


def _ray(args: list[str], core: int, nvml: Path) -> str:
    env = dict(os.environ) | {
        "CKPT_WATCHER_FAKE_NVML": str(nvml),
        "OMP_NUM_THREADS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    r = subprocess.run(
        ["taskset", "-c", str(core), str(BIN / "ray"), "start", *args, "--disable-usage-stats"],
        capture_output=True,
        text=True,
        env=env,
    )
    if r.returncode != 0:
        raise SystemExit(f"ray start failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def _run(work: Path, name: str, ckpt: Path, tasks_dir: Path, docs: int, samples: int) -> dict:
    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    watch = root / "ckpts"
    shutil.copytree(ckpt, watch / "r_step300")
    cfg = config(
        root / "w.yaml",
        root,
        watch,
        tasks_dir,
        [],
        devices={"gpus": "all"},
        executor={"kind": "ray", "address": "auto", "shared_dir": str(root / "efs")},
        eval={"batch_size": 2, "limit": docs, "tasks": [sampled_task(samples)]},
    )
    began = time.perf_counter()
    r = subprocess.run(
        [*WATCHER, "--log-json", "once", "-c", str(cfg)],
        capture_output=True,
        text=True,
        env=dict(os.environ) | {"OMP_NUM_THREADS": "1"},
    )
    wall = time.perf_counter() - began
    if r.returncode != 0:
        raise SystemExit(f"watcher once failed ({r.returncode}):\n{r.stderr[-3000:]}")
    (line,) = [
        json.loads(x) for x in (root / "ledgers" / "r" / "ledger.jsonl").read_text().splitlines()
    ]
    return {"line": line, "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-spread-nodes"))
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 cores")
    args.work.mkdir(parents=True, exist_ok=True)
    ckpt = trained_checkpoint(args.work)
    tasks_dir, _ = task_folder(args.work)
    head, second = args.work / "head.json", args.work / "second.json"
    _nvml(head, 0, [])
    _nvml(second, 6, [TRAINING])
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: sockets' paths
    try:
        _ray(["--head", "--port=0", "--num-cpus=1", f"--temp-dir={ray_tmp}"], 0, head)
        _ray(["--address=auto", "--num-cpus=1"], 1, second)
        one = _run(args.work, "one-node", ckpt, tasks_dir, args.docs, args.samples)
        _nvml(second, 6, [])  # training leaves the second node's GPU
        two = _run(args.work, "two-nodes", ckpt, tasks_dir, args.docs, args.samples)
    finally:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    docs = one["line"]["n_samples"]
    print(
        f"task: addition, {docs} documents x {args.samples} samples, hf, "
        f"{docs * args.samples} responses; two raylets, one core each"
    )
    row: dict[str, Any]
    for name, row in (("one node ", one), ("two nodes", two)):
        line = row["line"]
        print(
            f"{name}: task {line['duration_s']:.1f} s, watcher once {row['wall']:.1f} s, "
            f"devices {line['devices']}"
        )
    print(
        f"wall ratio, two nodes / one: task "
        f"{two['line']['duration_s'] / one['line']['duration_s']:.3f}, "
        f"watcher once {two['wall'] / one['wall']:.3f}"
    )
    print(f"metrics equal: {one['line']['metrics'] == two['line']['metrics']}")


if __name__ == "__main__":
    main()
