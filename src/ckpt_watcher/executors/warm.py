"""Warm workers on this host: one long-lived worker per device that keeps its engine between jobs.

A job for a device whose warm worker is idle is handed to it (its folder, one line on the
worker's stdin); with none, one is started; if it is busy (two jobs packed on one device), the
job gets a one-shot worker. The worker reports each job's exit code on a pipe; a worker that
dies mid-job reports that job's exit with its own exit code. The daemon stays the only scheduler
and ledger writer: to it a warm worker's job looks like any other (same folders, same outcome
files, kill = kill the process group). Warm workers live in `<state_dir>/jobs/_warm/<device>`,
so recovery after a crash finds them as strays, and they exit by themselves when the daemon's
end of their stdin closes. With `executor.preload` they are forked from the worker starter
(executors/starter.py), its imports done, with the same pipes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from ckpt_watcher.executors.base import Executor, ExitCallback, WorkerHandle
from ckpt_watcher.executors.local import LocalExecutor
from ckpt_watcher.executors.processes import kill_group, reap_group
from ckpt_watcher.executors.starter import Forked
from ckpt_watcher.jobfolder import (
    KILLED_FILE,
    LOG_FILE,
    PREPARE_DIR,
    PREPARE_PREFIX,
    STATUS_FD_ENV,
    WORKER_MODULE,
    JobFolder,
    parse_status_line,
    warm_home,
)
from ckpt_watcher.proctable import process_start_token

log = structlog.get_logger("ckpt_watcher.executors.warm")

CLOSE_WAIT_SECONDS = 10.0
# How often the report pipe's reader looks whether the worker is still there (see _reports)
EXIT_POLL_SECONDS = 1.0
# A worker this close to its idle release is not handed a job (it may be exiting as the job
# arrives, which would cost the job an attempt): it is let go and a new one starts.
IDLE_MARGIN_SECONDS = 2.0


@dataclass
class _Warm:
    proc: subprocess.Popen[bytes] | Forked
    device: str
    job_id: str | None = None  # the job it runs now
    # the run whose model its engine holds: of its last job, or started ahead of its weights
    run: str | None = None
    idle_since: float = field(default_factory=time.monotonic)


class WarmExecutor(Executor):
    """The Executor for `eval.warm_engine: true` on this host."""

    shares_journals = True
    starts_engines_ahead = True

    def __init__(
        self,
        on_exit: ExitCallback,
        state_dir: Path,
        *,
        idle_seconds: float,
        verify_every: int,
        preload: bool = False,
        python: str = sys.executable,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        """`preload`: fork workers from a worker starter, which `wake` says is ready."""
        self.on_exit = on_exit
        self.state_dir = state_dir
        self.idle_seconds = idle_seconds
        self.verify_every = verify_every
        self.python = python
        # packed jobs: one-shot workers beside the warm one
        self.cold = LocalExecutor(
            on_exit, python, preload_in=state_dir if preload else None, wake=wake
        )
        self._workers: dict[str, _Warm] = {}  # device label -> its warm worker
        self._retired: list[_Warm] = []  # let go, perhaps still releasing their engine
        self._lock = threading.Lock()

    def start(self, job_id: str, folder: JobFolder, env: dict[str, str]) -> WorkerHandle:
        spec = folder.read_spec()
        device = spec.device_label
        with self._lock:
            w = self._workers.get(device)
            if w is not None and w.job_id is not None:
                w = None  # packed: this device's warm worker is busy; a one-shot worker runs it
            else:
                if w is not None and time.monotonic() - w.idle_since > max(
                    0.0, self.idle_seconds - IDLE_MARGIN_SECONDS
                ):
                    self._retire(w)
                    w = None
                if w is None or w.proc.poll() is not None:
                    w = self._spawn(device, env)
                w.job_id, w.run = job_id, spec.run_path or None
        if w is None:
            return self.cold.start(job_id, folder, env)
        _tell(w, f"{folder}\n")  # if it died just now, _watch reports its exit for this job
        return WorkerHandle(job_id, w.proc.pid, process_start_token(w.proc.pid) or "")

    def prepare(self, device_label: str, folder: JobFolder, env: dict[str, str]) -> bool:
        """The device's warm worker (started if there is none) starts an engine for the
        request in `folder`, ahead of its weights; a job handed to it meanwhile waits in its
        stdin until the engine is up."""
        run = folder.read_spec().job_id
        with self._lock:
            w = self._workers.get(device_label)
            if w is not None and (w.job_id is not None or w.proc.poll() is not None):
                return False
            if w is None:
                w = self._spawn(device_label, env)
            w.run, w.idle_since = run, time.monotonic()  # and again once it reports ready
        return _tell(w, f"{PREPARE_PREFIX}{folder.path}\n")

    def idle_engines(self) -> dict[str, str | None]:
        with self._lock:
            return {
                d: w.run
                for d, w in self._workers.items()
                if w.job_id is None and w.proc.poll() is None
            }

    def release(self, device_label: str) -> None:
        """Stop the device's idle warm worker at once (SIGKILL to its group: an engine being
        started does not read its stdin), as a job is stopped to give its GPU back."""
        with self._lock:
            w = self._workers.get(device_label)
            if w is None or w.job_id is not None:
                return
            self._retire(w)
        log.info("engine.given_back", device=device_label, pid=w.proc.pid, run=w.run)
        self._kill_on_purpose(w)

    def _spawn(self, device: str, env: dict[str, str]) -> _Warm:
        home = warm_home(self.state_dir, device)
        home.mkdir(parents=True, exist_ok=True)
        settings = {
            "device": device,
            "idle_seconds": self.idle_seconds,
            "verify_every": self.verify_every,
        }
        starter = self.cold.starter
        forked = (
            starter.serve(home, settings, home / LOG_FILE, dict(os.environ) | env)
            if starter is not None
            else None
        )
        proc: subprocess.Popen[bytes] | Forked
        if forked is not None:
            proc, read_fd = forked, forked.status_fd
        else:
            read_fd, proc = self._popen(home, settings, env)
        w = _Warm(proc, device)
        self._workers[device] = w
        threading.Thread(target=self._watch, args=(w, read_fd), daemon=True).start()
        log.info("engine.worker_started", device=device, pid=proc.pid, forked=forked is not None)
        return w

    def _popen(
        self, home: Path, settings: dict[str, object], env: dict[str, str]
    ) -> tuple[int, subprocess.Popen[bytes]]:
        """A warm worker as a plain process: its status pipe's read end, and the process."""
        read_fd, write_fd = os.pipe()
        try:
            with open(home / LOG_FILE, "ab") as out:
                proc = subprocess.Popen(
                    [self.python, "-m", WORKER_MODULE, "--serve", str(home), json.dumps(settings)],
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=dict(os.environ) | env | {STATUS_FD_ENV: str(write_fd)},
                    start_new_session=True,
                    pass_fds=(write_fd,),
                )
        finally:
            os.close(write_fd)
        return read_fd, proc

    def _watch(self, w: _Warm, read_fd: int) -> None:
        """Report each finished job; when the worker exits, its job in flight too."""
        prepared = str(warm_home(self.state_dir, w.device) / PREPARE_DIR)
        for raw in _reports(read_fd, w.proc):
            rc, where = parse_status_line(raw)
            if where == prepared:  # its early engine is up (0) or failed: idle from now
                with self._lock:
                    w.idle_since = time.monotonic()
                    if rc != 0 and w.job_id is None:
                        w.run = None
                continue
            with self._lock:
                job_id, w.job_id = w.job_id, None
                w.idle_since = time.monotonic()
            if job_id is not None:
                self.on_exit(job_id, rc)
        rc = w.proc.wait()
        reap_group(w.proc.pid)  # its engine processes go with it
        with self._lock:
            job_id, w.job_id = w.job_id, None
            if self._workers.get(w.device) is w:
                del self._workers[w.device]
        log.info("engine.worker_exited", device=w.device, pid=w.proc.pid, rc=rc)
        if job_id is not None:
            self.on_exit(job_id, rc if rc != 0 else -signal.SIGKILL)

    def _retire(self, w: _Warm) -> None:
        """Let an idle worker go (it exits when its stdin closes); the caller holds the lock."""
        if self._workers.get(w.device) is w:
            del self._workers[w.device]
        self._retired = [r for r in self._retired if r.proc.poll() is None] + [w]
        try:
            if w.proc.stdin is not None:
                w.proc.stdin.close()
        except OSError:
            pass

    def adopt(self, job_id: str, handle: WorkerHandle, folder: JobFolder) -> bool:
        """A worker the last daemon started (one-shot or warm: a warm worker whose daemon died
        finishes the job in hand, then exits, its stdin closed) is watched as a one-shot one."""
        return self.cold.adopt(job_id, handle, folder)

    def kill(self, job_id: str) -> None:
        with self._lock:
            w = next((w for w in self._workers.values() if w.job_id == job_id), None)
        if w is None:
            self.cold.kill(job_id)
        else:  # on purpose (timeout, give-back, stop)
            self._kill_on_purpose(w)

    def _kill_on_purpose(self, w: _Warm) -> None:
        """Kill the warm worker's group, saying so first: its next worker must not count it
        failing (serve.Failing)."""
        try:
            (warm_home(self.state_dir, w.device) / KILLED_FILE).write_text(str(w.proc.pid))
        except OSError:
            pass
        kill_group(w.proc.pid)

    def running(self) -> set[str]:
        with self._lock:
            warm = {w.job_id for w in self._workers.values() if w.job_id is not None}
        return warm | self.cold.running()

    def worker_pids(self) -> set[int]:
        """The warm workers, busy or idle: their GPU memory is ours."""
        with self._lock:  # alive only: an exited worker leaves _workers when _watch sees it
            every = [*self._workers.values(), *self._retired]
            return {w.proc.pid for w in every if w.proc.poll() is None}

    def ready_to_start(self) -> bool:
        return self.cold.ready_to_start()

    def starter_state(self) -> dict[str, object] | None:
        return self.cold.starter_state()

    def close(self, timeout: float = CLOSE_WAIT_SECONDS) -> None:
        """Release every warm engine: close their stdin, give them `timeout`, then kill."""
        with self._lock:
            workers = [*self._workers.values(), *self._retired]
        for w in workers:
            try:
                if w.proc.stdin is not None:
                    w.proc.stdin.close()
            except OSError:
                pass
        for w in workers:
            try:
                w.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                w.proc.send_signal(signal.SIGTERM)
                try:
                    w.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
            reap_group(w.proc.pid)
        self.cold.close()


def _tell(w: _Warm, line: str) -> bool:
    """Write one line to the warm worker's stdin; False if it is gone."""
    try:
        assert w.proc.stdin is not None
        w.proc.stdin.write(line.encode())
        w.proc.stdin.flush()
    except OSError:
        return False
    return True


def _reports(fd: int, proc: subprocess.Popen[bytes] | Forked) -> Iterator[bytes]:
    """The status lines the worker writes on `fd`, until it has exited and what it wrote is read.

    The pipe's end is not the worker's end: a process the worker forked holds the write end too
    (vLLM's engine core on CUDA is forked, not spawned), and after a kill -9 of the worker it
    lives on. Seen on an H100: the job waited, its engine holding 25 GB, until the eval's
    time-out. Its exit is reaped here, and the group's rest killed, by the caller."""
    pending = b""
    try:
        while True:
            if not select.select([fd], [], [], EXIT_POLL_SECONDS)[0]:
                if proc.poll() is None:
                    continue
                if not select.select([fd], [], [], 0)[0]:  # nothing written before its exit
                    break
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            yield from (line + b"\n" for line in lines)
    finally:
        os.close(fd)
    if pending.strip():
        yield pending
