"""Detection latency: from the moment a checkpoint becomes complete (its last byte written and
the file closed) to its eval starting (the job's start time in the daemon's state), with inotify
and with polling only, measured on a real `watcher run`.

Targets: under 1 s with inotify; under poll_seconds + 0.5 s polling only.
Usage: python bench/detection_latency.py [--trials 5] [--poll 2] [--work /tmp/bench-latency]
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

from common import WATCHER, config, summary, task_folder, trained_checkpoint

from ckpt_watcher.state import State


def job_for(state_dir: Path, step: int) -> tuple[float | None, str | None]:
    try:
        st = State(state_dir, readonly=True)
    except Exception:
        return None, None
    try:
        for job in st.jobs():
            if job.step == step:
                return job.started_at, job.state
    finally:
        st.close()
    return None, None


def measure(work: Path, ckpt: Path, inotify: bool, trials: int, poll: float) -> list[float]:
    root = work / ("inotify" if inotify else "polling")
    shutil.rmtree(root, ignore_errors=True)
    watch = root / "ckpts"
    watch.mkdir(parents=True)
    tasks_dir, tasks = task_folder(work)
    cfg = config(root / "w.yaml", root, watch, tasks_dir, tasks, eval={"limit": 5})
    text = cfg.read_text().replace(
        "poll_seconds: 5", f"poll_seconds: {poll}\n  inotify: {str(inotify).lower()}"
    )
    cfg.write_text(text)
    weights = (ckpt / "model.safetensors").read_bytes()
    daemon = subprocess.Popen([*WATCHER, "--log-level", "WARNING", "run", "-c", str(cfg)])
    latencies = []
    rng = random.Random(0)
    try:
        time.sleep(3)
        for step in range(1, trials + 1):
            target = watch / f"lat_step{step}"
            shutil.copytree(ckpt, target, ignore=shutil.ignore_patterns("model.safetensors"))
            with open(target / "model.safetensors", "wb") as f:
                f.write(weights[: len(weights) // 2])
            time.sleep(rng.uniform(0.5, poll + 0.5))  # a random phase against the poll tick
            with open(target / "model.safetensors", "ab") as f:
                f.write(weights[len(weights) // 2 :])
            completed = time.time()
            started = None
            deadline = time.time() + poll + 30
            while time.time() < deadline:
                started, _ = job_for(root / "state", step)
                if started:
                    break
                time.sleep(0.05)
            if started is None:
                raise SystemExit(f"trial {step}: the eval never started")
            latencies.append(started - completed)
            print(
                f"{'inotify' if inotify else 'polling'} trial {step}: {started - completed:.3f}s",
                flush=True,
            )
            while job_for(root / "state", step)[1] in ("queued", "running"):
                time.sleep(0.2)  # let the eval finish so trials do not compete for the CPU
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
    return latencies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--poll", type=float, default=2.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-latency"))
    args = ap.parse_args()
    ckpt = trained_checkpoint(args.work)
    with_inotify = measure(args.work, ckpt, True, args.trials, args.poll)
    polling = measure(args.work, ckpt, False, args.trials, args.poll)
    print(
        f"inotify      latency (s): {summary(with_inotify)}   target < 1.0: max {max(with_inotify):.3f}"
    )
    print(
        f"polling only latency (s): {summary(polling)}   target < poll_seconds + 0.5 = "
        f"{args.poll + 0.5:.1f}: max {max(polling):.3f}"
    )


if __name__ == "__main__":
    main()
