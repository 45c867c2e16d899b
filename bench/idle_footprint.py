"""Idle daemon footprint: `watcher run` over 3 local sources holding 20 already-evaluated
checkpoints each (poll every 5 s, inotify on), nothing to do, for N minutes. Reports RSS and the
CPU share of one core, read from /proc (whole daemon process; no workers start).

Targets: < 100 MB RSS, < 1% of a core.
Usage: python bench/idle_footprint.py [--minutes 10] [--work /tmp/bench-idle]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from common import WATCHER, fake_checkpoint, task_folder

from ckpt_watcher.config import load_config
from ckpt_watcher.ledger import append

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-idle"))
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    sources = [args.work / f"src{i}" for i in range(3)]
    cfg_path = args.work / "w.yaml"
    args.work.mkdir(parents=True)
    cfg_path.write_text(
        json.dumps(
            {
                "state_dir": str(args.work / "state"),
                "ledger_dir": str(args.work / "ledgers"),
                "sources": [{"kind": "local", "path": str(s), "poll_seconds": 5} for s in sources],
                "devices": {"gpus": [], "cpu_slots": 1},
                "eval": {
                    "backend": "hf",
                    "tasks": [{"task": "addition", "num_fewshot": 0}],
                    "include_path": str(task_folder(args.work)[0]),
                },
            }
        )
    )
    cfg = load_config(cfg_path)
    for i, src in enumerate(sources):
        for step in range(1, 21):
            fake_checkpoint(src / f"r{i}_step{step}")
            append(
                cfg.ledger_dir,
                {
                    "run": f"r{i}",
                    "step": step,
                    "label": f"r{i}_step{step}",
                    "task": "addition",
                    "num_fewshot": 0,
                    "status": "ok",
                    "metrics": {},
                    "settings_hash": cfg.eval.settings_hash(),
                },
            )
    proc = subprocess.Popen(
        [*WATCHER, "--log-json", "run", "-c", str(cfg_path)],
        stdout=subprocess.DEVNULL,
        stderr=open(args.work / "daemon.log", "wb"),
    )
    try:
        time.sleep(15)  # start-up and the first scans are not idling
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        peak = rss_mb(proc.pid)
        while time.monotonic() - t0 < args.minutes * 60:
            time.sleep(5)
            peak = max(peak, rss_mb(proc.pid))
        cpu1, t1 = cpu_seconds(proc.pid), time.monotonic()
        jobs = list((args.work / "state" / "jobs").glob("*"))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    share = (cpu1 - cpu0) / (t1 - t0) * 100
    print(f"idle for {(t1 - t0) / 60:.1f} min over 3 sources x 20 evaluated checkpoints, poll 5 s")
    print(f"RSS: peak {peak:.1f} MB (target < 100 MB)")
    print(f"CPU: {cpu1 - cpu0:.2f} s in {t1 - t0:.0f} s = {share:.3f}% of one core (target < 1%)")
    print(f"evals started while idle: {len(jobs)} (expected 0)")


if __name__ == "__main__":
    main()
