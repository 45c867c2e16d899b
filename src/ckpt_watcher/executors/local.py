"""Run each job as a subprocess on this host, in its own session (process group).

No shell is involved: the argument vector is passed as a list, so checkpoint paths with spaces,
quotes, `;` or `$()` are just bytes. Killing a job kills its whole process group (vLLM's engine
processes included).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from ckpt_watcher.executors.base import Executor, ExitCallback, WorkerHandle
from ckpt_watcher.executors.processes import kill_group, process_start_token
from ckpt_watcher.jobfolder import WORKER_MODULE, JobFolder


class LocalExecutor(Executor):
    def __init__(self, on_exit: ExitCallback, python: str = sys.executable) -> None:
        self.on_exit = on_exit
        self.python = python
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    def start(self, job_id: str, folder: JobFolder, env: dict[str, str]) -> WorkerHandle:
        full_env = dict(os.environ) | env
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
        # reap the rest of the group (vLLM engine processes) so nothing outlives its job
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        with self._lock:
            self._procs.pop(job_id, None)
        self.on_exit(job_id, rc)

    def kill(self, job_id: str) -> None:
        with self._lock:
            proc = self._procs.get(job_id)
        if proc is not None:
            kill_group(proc.pid)

    def running(self) -> set[str]:
        with self._lock:
            return set(self._procs)

