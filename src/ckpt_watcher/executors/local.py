"""Run each job as a subprocess on this host, in its own session (process group).

No shell is involved: the argument vector is passed as a list, so checkpoint paths with spaces,
quotes, `;` or `$()` are just bytes. Killing a job kills its whole process group (vLLM's engine
processes included). A worker lives on when its daemon dies (its own session), and the next
daemon adopts it: it is not that daemon's child, so its end is read from the job folder's exit
file, or seen as the process gone.

Given a state folder, workers are forked from a starter that imported torch, transformers and
lm-eval once (executors/starter.py): the same process from the job's point of view, without
the imports' 10 to 30 s each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ckpt_watcher.executors.base import Executor, ExitCallback, WorkerHandle
from ckpt_watcher.executors.processes import kill_group, reap_group, reap_remnants
from ckpt_watcher.executors.starter import WorkerStarter
from ckpt_watcher.jobfolder import WORKER_MODULE, JobFolder
from ckpt_watcher.proctable import process_gone, process_start_token

ADOPTED_POLL_SECONDS = 0.5  # how often an adopted worker's exit file and process are looked at
ADOPTED_EXIT_GRACE_SECONDS = 15.0  # after its exit file, for the process to end by itself


class LocalExecutor(Executor):
    shares_journals = True

    def __init__(
        self,
        on_exit: ExitCallback,
        python: str = sys.executable,
        *,
        preload_in: Path | None = None,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        """`preload_in`: the state folder, to fork workers from a starter (None: plain
        processes only); `wake` is called once the starter is ready."""
        self.on_exit = on_exit
        self.python = python
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._adopted: dict[str, int] = {}  # job id -> pid of a worker an earlier daemon started
        self._lock = threading.Lock()
        self.starter = (
            WorkerStarter(preload_in, python, self._forked_exit, self._starter_lost, wake)
            if preload_in is not None
            else None
        )

    def start(self, job_id: str, folder: JobFolder, env: dict[str, str]) -> WorkerHandle:
        full_env = dict(os.environ) | env
        if self.starter is not None:
            pid = self.starter.start(job_id, folder, full_env)
            if pid is not None:
                return WorkerHandle(job_id, pid, process_start_token(pid) or "")
        with open(folder.log, "ab") as out:
            proc = subprocess.Popen(
                [self.python, "-m", WORKER_MODULE, str(folder)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
                close_fds=True,
            )
        with self._lock:
            self._procs[job_id] = proc
        threading.Thread(target=self._wait, args=(job_id, proc), daemon=True).start()
        return WorkerHandle(job_id, proc.pid, process_start_token(proc.pid) or "")

    def _wait(self, job_id: str, proc: subprocess.Popen[bytes]) -> None:
        rc = proc.wait()
        reap_group(proc.pid)  # the rest of its group (vLLM engine processes) goes with it
        with self._lock:
            self._procs.pop(job_id, None)
        self.on_exit(job_id, rc)

    def ready_to_start(self) -> bool:
        return self.starter is None or self.starter.ready_to_start()

    def starter_state(self) -> dict[str, object] | None:
        return self.starter.describe() if self.starter is not None else None

    def _forked_exit(self, job_id: str, pid: int, rc: int) -> None:
        reap_group(pid)
        self.on_exit(job_id, rc)

    def _starter_lost(self, workers: dict[int, tuple[str, JobFolder]]) -> None:
        """The starter died: its workers live on, and are watched as adopted ones."""
        for pid, (job_id, folder) in workers.items():
            self.adopt(job_id, WorkerHandle(job_id, pid, process_start_token(pid) or ""), folder)

    def adopt(self, job_id: str, handle: WorkerHandle, folder: JobFolder) -> bool:
        with self._lock:
            self._adopted[job_id] = handle.pid
        threading.Thread(target=self._watch_adopted, args=(handle, folder), daemon=True).start()
        return True

    def _watch_adopted(self, handle: WorkerHandle, folder: JobFolder) -> None:
        def gone() -> bool:
            return process_gone(handle.pid, handle.start_token)

        def wait_gone(every: float) -> bool:
            deadline = time.monotonic() + ADOPTED_EXIT_GRACE_SECONDS
            while not gone() and time.monotonic() < deadline:
                time.sleep(every)
            return gone()

        rc = folder.exit_code()
        while rc is None and not gone():
            time.sleep(ADOPTED_POLL_SECONDS)
            rc = folder.exit_code()
        if rc is None:
            rc = folder.exit_code()  # written just before it exited
        # finishing its exit (a warm worker: its release), else killed
        if not wait_gone(ADOPTED_POLL_SECONDS):
            kill_group(handle.pid)
            wait_gone(ADOPTED_POLL_SECONDS / 10)
        reap_remnants(handle.pid)  # its engine, and its temporary folder
        with self._lock:
            self._adopted.pop(handle.job_id, None)
        # no exit file: it died before it could write one (killed)
        self.on_exit(handle.job_id, rc if rc is not None else -signal.SIGKILL)

    def kill(self, job_id: str) -> None:
        with self._lock:
            proc = self._procs.get(job_id)
            adopted = self._adopted.get(job_id)
        forked = self._forked().get(job_id)
        if proc is not None:
            kill_group(proc.pid)
        elif forked is not None:
            kill_group(forked)
        elif adopted is not None:
            kill_group(adopted)

    def running(self) -> set[str]:
        with self._lock:
            return set(self._procs) | set(self._adopted) | set(self._forked())

    def _forked(self) -> dict[str, int]:
        return self.starter.workers() if self.starter is not None else {}

    def close(self) -> None:
        if self.starter is not None:
            self.starter.close()
