"""What a worker killed -9 forked does not outlive it. On CUDA vLLM's engine process is forked
from the worker and lived on after a kill -9 of it, holding its GPU memory; to the next daemon
it is a process not ours on that GPU (the GPU looks busy for good). The worker's forked children
now die with it (worker/lifeline.py), and a start ends what is left in the process groups of
workers killed with their daemon: the worker of a job left running, and a warm worker whose
engine.json says it held an engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ckpt_watcher.jobfolder import ENGINE_FILE, warm_home
from ckpt_watcher.jobs.recovery import recover
from ckpt_watcher.proctable import process_start_token
from ckpt_watcher.state import Job

from .helpers import alive, gone, simulated_daemon

# a worker's stand-in: leads its session, forks a child that keeps running, says its pid
FORKS = """
import os, sys, time
child = os.fork()
if child == 0:
    time.sleep(300)
    os._exit(0)
print(child, flush=True)
time.sleep(300)
"""


def _killed_leader() -> tuple[int, str, int]:
    """(the leader's pid and start token, its child's pid), the leader killed -9."""
    leader = subprocess.Popen(
        [sys.executable, "-c", FORKS], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    assert leader.stdout is not None
    child = int(leader.stdout.readline())
    token = process_start_token(leader.pid) or ""
    leader.kill()
    leader.wait()
    assert alive(child)
    return leader.pid, token, child


def test_a_start_ends_what_killed_workers_left_in_their_process_groups(tmp_path: Path) -> None:
    daemon = simulated_daemon(tmp_path)
    cfg = daemon.cfg
    pids = []
    try:
        worker, token, engine = _killed_leader()  # a job's worker, killed with its daemon
        idle, _, idle_engine = _killed_leader()  # an idle warm worker, killed the same way
        released, _, other = _killed_leader()  # one that said it released its engine
        pids = [engine, idle_engine, other]
        tasks = [{"task": "t1", "num_fewshot": None}]
        job = Job("j", "/c/j", "r", 1, "j", tasks, daemon.book.settings_hash, 0, 1)
        daemon.state.add_job(job)
        daemon.state.update_job(
            "j", state="running", attempt=1, started_at=1000.0, pid=worker, pid_start=token
        )
        for device, pid, state in (("cuda:0", idle, "idle"), ("cuda:1", released, "released")):
            home = warm_home(cfg.state_dir, device)
            home.mkdir(parents=True)
            (home / ENGINE_FILE).write_text(json.dumps({"pid": pid, "state": state}))
        recover(daemon.book, daemon.executor, daemon.filing, 2000.0)
        assert gone(engine) and gone(idle_engine)
        # a released engine's worker exited by itself: its pid may be another's by now
        assert alive(other)
        requeued = daemon.state.job("j")
        assert requeued is not None and requeued.state == "queued"
    finally:
        daemon.state.close()
        for pid in pids:
            subprocess.run(["kill", "-9", str(pid)], capture_output=True)


# the worker's start, then a child forked as vLLM forks its engine on CUDA
LIFELINE = """
import multiprocessing as mp, time
from ckpt_watcher.worker import lifeline

def hold():
    time.sleep(300)

if __name__ == "__main__":
    lifeline.arm()
    engine = mp.get_context("fork").Process(target=hold)
    engine.start()
    print(engine.pid, flush=True)
    time.sleep(300)
"""


def test_what_a_worker_forks_dies_with_it() -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c", LIFELINE], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    assert worker.stdout is not None
    engine = int(worker.stdout.readline())
    try:
        assert alive(engine)
        worker.kill()
        worker.wait()
        assert gone(engine, seconds=5)
    finally:
        subprocess.run(["kill", "-9", str(engine)], capture_output=True)
