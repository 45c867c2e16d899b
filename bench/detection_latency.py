"""Detection latency: from the moment a checkpoint becomes complete (its last byte written and
the file closed, or its last object uploaded) to its eval starting (the job's start time in the
daemon's state), measured on a real `watcher run`: with inotify, with polling only, with inotify
beside an S3 source whose endpoint accepts connections and never answers, and from an S3 prefix
(a real S3 API, moto's server); the local inotify and S3 modes both with the settle window
(`settle_seconds`, default 0.5) and without it (0: judged ready at the first look, as before
the window existed). Also the daemon's worst heartbeat age seen.

Targets: under 1 s with inotify, settle window included (a hung source beside it changes
nothing); under poll_seconds + 0.5 s polling only; S3 under poll_seconds + settle + a listing;
the heartbeat never older than a few seconds.
Usage: python bench/detection_latency.py [--trials 5] [--poll 2] [--work /tmp/bench-latency]
"""

from __future__ import annotations

import argparse
import json
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

from ckpt_watcher.s3client import make_client
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
    work: Path,
    ckpt: Path,
    inotify: bool,
    trials: int,
    poll: float,
    hung: str | None = None,
    settle: float = 0.5,
    s3: str | None = None,
) -> tuple[list[float], float]:
    """Latencies of `trials` checkpoints, and the worst heartbeat age seen meanwhile. `s3`: an
    endpoint whose bucket `bench` is the only source (else a local folder)."""
    name = "hung-s3" if hung else "s3" if s3 else "inotify" if inotify else "polling"
    name += f"-settle{settle:g}"
    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    watch = root / "ckpts"
    watch.mkdir(parents=True)
    tasks_dir, tasks = task_folder(work)
    sources: list[dict] = [
        {"kind": "local", "path": str(watch), "poll_seconds": poll, "inotify": inotify}
    ]
    if hung:
        sources.append(
            {"kind": "s3", "uri": "s3://bucket/ckpts/", "endpoint_url": hung, "poll_seconds": poll}
        )
    client = None
    if s3:
        client = make_client(s3)
        client.create_bucket(Bucket="bench")
        prefix = f"{name}/"
        uri = f"s3://bench/{prefix}"
        cache = str(root / "cache")
        sources = [
            {"kind": "s3", "uri": uri, "endpoint_url": s3, "poll_seconds": poll, "cache_dir": cache}
        ]
    cfg = config(
        root / "w.yaml",
        root,
        watch,
        tasks_dir,
        tasks,
        eval={"limit": 5},
        sources=sources,
        settle_seconds=settle,
    )
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
            conf = json.loads((target / "config.json").read_text())  # content of its own
            (target / "config.json").write_text(json.dumps(conf | {"_name_or_path": str(target)}))
            if client is not None:  # every object but the weights, then (later) the weights
                for f in sorted(target.iterdir()):
                    client.upload_file(str(f), "bench", f"{prefix}lat_step{step}/{f.name}")
                time.sleep(rng.uniform(0.5, poll + 0.5))  # a random phase against the poll
                key = f"{prefix}lat_step{step}/model.safetensors"
                client.upload_file(str(ckpt / "model.safetensors"), "bench", key)
                completed = time.time()
            else:
                with open(target / "model.safetensors", "wb") as f:
                    f.write(weights[: len(weights) // 2])
                time.sleep(rng.uniform(0.5, poll + 0.5))  # a random phase against the poll
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
    no_settle, no_settle_beat = measure(args.work, ckpt, True, args.trials, args.poll, settle=0)
    polling, polling_beat = measure(args.work, ckpt, False, args.trials, args.poll)
    from moto.server import ThreadedMotoServer

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(var, "x")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

    moto = ThreadedMotoServer(port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    try:
        s3, s3_beat = measure(
            args.work, ckpt, False, args.trials, args.poll, s3=f"http://{host}:{port}"
        )
        s3_raw, _ = measure(
            args.work, ckpt, False, args.trials, args.poll, s3=f"http://{host}:{port}", settle=0
        )
    finally:
        moto.stop()
    print(
        f"inotify      latency (s): {summary(with_inotify)}   target < 1.0: max {max(with_inotify):.3f}"
        f"   worst heartbeat age {beat:.1f}s"
    )
    print(
        f"inotify, no settle window (settle_seconds 0) latency (s): {summary(no_settle)}   "
        f"the window's cost: median +{statistics.median(with_inotify) - statistics.median(no_settle):.3f}s"
        f"   worst heartbeat age {no_settle_beat:.1f}s"
    )
    print(
        f"S3 (poll {args.poll:g}s) latency (s): {summary(s3)}   without the window: {summary(s3_raw)}"
        f"   median +{statistics.median(s3) - statistics.median(s3_raw):.3f}s"
        f"   worst heartbeat age {s3_beat:.1f}s"
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
