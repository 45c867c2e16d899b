"""A worker whose engine process dies ends at once, saying why (evaluators/engine_watch.py).

Each case is a real process standing for a worker: it "loads an engine" that starts a process of
its own (as vLLM's engine core on CUDA), then blocks on a queue nobody fills, as vLLM's client
does once its engine process is gone. The engine process is killed -9 for real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt_watcher.jobfolder import EXIT_CRASH

WORKER = """
import multiprocessing, queue, sys, time, weakref
from pathlib import Path
from ckpt_watcher.evaluators import engine_watch

def serve():
    time.sleep(600)

class Engine:  # an engine whose core runs in a process of its own, shut down at exit
    def __init__(self):
        self.core = multiprocessing.get_context("spawn").Process(target=serve, daemon=True)
        self.core.start()
        weakref.finalize(self, self.core.terminate)

if __name__ == "__main__":
    mode, said = sys.argv[1], Path(sys.argv[2])
    engine = engine_watch.watched(Engine)
    print("core", engine.core.pid, flush=True)
    with engine_watch.last_words(lambda why: said.write_text(why)):
        if mode == "stop":  # shut down on purpose: its process ends, the worker goes on
            engine_watch.stop(engine)
            engine.core.terminate()
            engine.core.join()
            time.sleep(1)
            print("served on", flush=True)
        elif mode == "exit":  # a worker done with its job exits; its engine goes with it
            sys.exit(0)
        else:  # in use: waits for outputs that will never come
            queue.Queue().get()
"""


def _worker(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], int, Path]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    said = tmp_path / "said.txt"
    proc = subprocess.Popen(
        [sys.executable, str(script), mode, str(said)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    while not line.startswith("core "):  # the watch's own log line comes before
        line = proc.stdout.readline()
    return proc, int(line.split()[1]), said


def test_an_engine_process_killed_while_in_use_ends_the_worker_with_the_jobs_crash(
    tmp_path: Path,
) -> None:
    proc, core, said = _worker(tmp_path, "in use")
    time.sleep(0.5)
    assert proc.poll() is None  # blocked, as a worker on a dead vLLM engine would stay
    os.kill(core, signal.SIGKILL)
    assert proc.wait(timeout=30) == EXIT_CRASH
    assert said.read_text() == (
        f"vLLM's engine process (pid {core}) was killed by SIGKILL (the host's OOM killer, or a "
        "kill -9?) while its engine was in use"
    )


@pytest.mark.parametrize("mode", ["stop", "exit"])
def test_an_engine_shut_down_on_purpose_or_at_exit_is_not_a_death(
    tmp_path: Path, mode: str
) -> None:
    proc, _, said = _worker(tmp_path, mode)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert not said.exists()
    assert ("served on" in out) == (mode == "stop")
