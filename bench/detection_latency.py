"""Detection latency: from the moment a checkpoint becomes complete (its last byte written and
the file closed) to its eval starting (the job's start time in the daemon's state), with inotify,
with polling only, and with inotify beside an S3 source whose endpoint accepts connections and
never answers, measured on a real `watcher run`. Also the daemon's worst heartbeat age seen.

Targets: under 1 s with inotify (a hung source beside it changes nothing); under
poll_seconds + 0.5 s polling only; the heartbeat never older than a few seconds.
Usage: python bench/detection_latency.py [--trials 5] [--poll 2] [--work /tmp/bench-latency]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import threading
import time
from pathlib import Path

from common import WATCHER, config, summary, task_folder, trained_checkpoint

from ckpt_watcher.state import State


def hung_endpoint() -> tuple[str, socket.socket]:
    """A loopback endpoint that accepts connections and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{server.getsockname()[1]}", server


def heartbeat_age(state_dir: Path) -> float | None:
    try:
        st = State(state_dir, readonly=True)
    except Exception:
        return None
    try:
        beat = st.get_meta("heartbeat")
    finally:
        st.close()
    return time.time() - beat if beat else None


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


def measure(
    work: Path, ckpt: Path, inotify: bool, trials: int, poll: float, hung: str | None = None
) -> tuple[list[float], float]:
    """Latencies of `trials` checkpoints, and the worst heartbeat age seen meanwhile."""
    name = "hung-s3" if hung else "inotify" if inotify else "polling"
    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    watch = root / "ckpts"
    watch.mkdir(parents=True)
    tasks_dir, tasks = task_folder(work)
    sources = [{"kind": "local", "path": str(watch), "poll_seconds": poll, "inotify": inotify}]
    if hung:
        sources.append(
            {"kind": "s3", "uri": "s3://bucket/ckpts/", "endpoint_url": hung, "poll_seconds": poll}
        )
    cfg = config(root / "w.yaml", root, watch, tasks_dir, tasks, eval={"limit": 5}, sources=sources)
    weights = (ckpt / "model.safetensors").read_bytes()
    env = dict(
        os.environ, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1"
    )
    daemon = subprocess.Popen([*WATCHER, "--log-level", "WARNING", "run", "-c", str(cfg)], env=env)
    latencies = []
    worst_beat = 0.0
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
                worst_beat = max(worst_beat, heartbeat_age(root / "state") or 0.0)
                if started:
                    break
                time.sleep(0.05)
            if started is None:
                raise SystemExit(f"trial {step}: the eval never started")
            latencies.append(started - completed)
            print(f"{name} trial {step}: {started - completed:.3f}s", flush=True)
            while job_for(root / "state", step)[1] in ("queued", "running"):
                worst_beat = max(worst_beat, heartbeat_age(root / "state") or 0.0)
                time.sleep(0.2)  # let the eval finish so trials do not compete for the CPU
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
    return latencies, worst_beat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--poll", type=float, default=2.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-latency"))
    args = ap.parse_args()
    ckpt = trained_checkpoint(args.work)
    url, server = hung_endpoint()
    try:
        hung, hung_beat = measure(args.work, ckpt, True, args.trials, args.poll, hung=url)
    finally:
        server.close()
    with_inotify, beat = measure(args.work, ckpt, True, args.trials, args.poll)
    polling, polling_beat = measure(args.work, ckpt, False, args.trials, args.poll)
    print(
        f"inotify      latency (s): {summary(with_inotify)}   target < 1.0: max {max(with_inotify):.3f}"
        f"   worst heartbeat age {beat:.1f}s"
    )
    print(
        f"inotify + hung S3 source  latency (s): {summary(hung)}   ratio of medians to inotify "
        f"alone {statistics.median(hung) / statistics.median(with_inotify):.2f}"
        f"   worst heartbeat age {hung_beat:.1f}s"
    )
    print(
        f"polling only latency (s): {summary(polling)}   target < poll_seconds + 0.5 = "
        f"{args.poll + 0.5:.1f}: max {max(polling):.3f}   worst heartbeat age {polling_beat:.1f}s"
    )


if __name__ == "__main__":
    main()
