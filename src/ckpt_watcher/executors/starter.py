"""The daemon's side of the worker starter (worker/starter.py): a process that has imported
torch, transformers and lm-eval once and forks each job's worker from itself.

It is started when the daemon first has a job to start, and the daemon waits for it (the
imports a plain worker would do anyway) up to READY_SECONDS; a job started before it is ready
runs as a plain process (`start` answers None). It serves the daemon's environment as it was
when it started: were that to change, workers start as plain processes again. Each forked
worker's exit comes back from the starter; should the starter die, its workers live on (each in
its own session) and `on_lost` hands them to the caller, which watches them as adopted workers.
A starter that cannot fork safely (CUDA initialized by an import) says so once, and workers
start as plain processes from then on. Its log is `<state_dir>/worker-starter.log`.

Warm workers (executors/warm.py) are forked from it too (`serve`): their job pipe and status
pipe are the daemon's, passed to the starter over its socket, so the daemon talks to a forked
warm worker exactly as to one it started; `Forked` stands for its process.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher.executors.processes import kill_group
from ckpt_watcher.jobfolder import WORKER_MODULE, JobFolder, jobs_root
from ckpt_watcher.proctable import process_gone, process_start_token

log = structlog.get_logger("ckpt_watcher.executors.starter")

READY_SECONDS = 180.0  # waited for the starter's imports before jobs start without it
CLOSE_SECONDS = 5.0  # for the starter to end once told (it exits at once)
ANSWER_SECONDS = 60.0  # for a ready starter to say it forked; it takes milliseconds
DIED = -1  # the answer to a request the starter died with: it may have forked the worker
LOG_FILE = "worker-starter.log"  # in the state folder


class Forked:
    """A warm worker the starter forked: what of `subprocess.Popen` the warm executor uses. Its
    exit code comes from the starter; should the starter die first, its end is seen as the
    process gone, its code unknown (-SIGKILL, as for an adopted worker without an exit file)."""

    def __init__(self, stdin_fd: int, status_fd: int) -> None:
        self.pid = 0  # once forked
        self.stdin = os.fdopen(stdin_fd, "wb")  # the job pipe's write end
        self.status_fd = status_fd  # the status pipe's read end, for the executor to read
        self.returncode: int | None = None
        self._token: str | None = None
        self._ended = threading.Event()
        self._orphan = False  # the starter died: no one will report its exit

    def _forked(self, pid: int) -> None:
        self.pid, self._token = pid, process_start_token(pid)

    def _exited(self, rc: int) -> None:
        self.returncode = rc
        self._ended.set()

    def _starter_gone(self) -> None:
        self._orphan = True

    def poll(self) -> int | None:
        if not self._ended.is_set() and self._orphan:
            if process_gone(self.pid, self._token):
                self._exited(-signal.SIGKILL)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"warm worker {self.pid}", timeout or 0.0)
            self._ended.wait(0.2)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


@dataclass
class _Fork:
    """A worker asked of the starter: a job's (`job`) or a warm one (`warm`)."""

    job: tuple[str, JobFolder] | None = None
    warm: Forked | None = None


class WorkerStarter:
    def __init__(
        self,
        state_dir: Path,
        python: str,
        on_exit: Callable[[str, int, int], None],
        on_lost: Callable[[dict[int, tuple[str, JobFolder]]], None],
        on_ready: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_exit(job_id, pid, rc)` for each forked worker's end; `on_lost({pid: (job_id,
        folder)})` for the workers still running when the starter died; `on_ready()` once it
        is ready, or will never be."""
        self.state_dir = state_dir
        self.python = python
        self.on_exit = on_exit
        self.on_lost = on_lost
        self.on_ready = on_ready
        self._launched_at = 0.0
        self._started_at: float | None = None  # wall clock, for status
        self._why = ""  # why it is off
        self._proc: subprocess.Popen[bytes] | None = None
        self._requests: socket.socket | None = None  # a SOCK_SEQPACKET to the starter's fd 0
        self._env: dict[str, str] = {}
        self._ready = False
        self._off = False  # cannot fork safely, or died: plain processes from now on
        self._asking: deque[_Fork] = deque()  # forks asked for, in order
        self._answers: queue.Queue[int | None] = queue.Queue()
        self._workers: dict[int, _Fork] = {}  # pid -> what it was forked for, until it exits
        self._lock = threading.Lock()  # one request and its answer at a time
        self._state = threading.Lock()

    def ready_to_start(self) -> bool:
        """Launch the starter if need be; True once it is ready, or will not be (off, or not
        ready after READY_SECONDS)."""
        with self._lock:
            if self._off or self._ready:
                return True
            if self._proc is None:
                self._launch(dict(os.environ))
            return self._off or time.monotonic() - self._launched_at > READY_SECONDS

    def start(self, job_id: str, folder: JobFolder, env: dict[str, str]) -> int | None:
        """Fork `job_id`'s worker with `env` (the whole environment) and return its pid, or
        None where it must start as a plain process (the starter is starting, off, or serves
        another environment, or could not fork). Raises OSError where the starter took the
        job but did not say it forked it: dead, or killed after ANSWER_SECONDS (a worker it
        forks late would be nobody's); the daemon puts the job back in the queue."""
        request = {"job": str(folder), "log": str(folder.log), "env": env}
        return self._fork(request, [], _Fork(job=(job_id, folder)))

    def serve(
        self, home: Path, settings: dict[str, Any], log_file: Path, env: dict[str, str]
    ) -> Forked | None:
        """Fork a warm worker (`python -m ckpt_watcher.worker --serve HOME SETTINGS`) with
        `env`, its stdin and status pipes the caller's through the returned `Forked`; None and
        OSError as for `start`."""
        jobs_r, jobs_w = os.pipe()
        status_r, status_w = os.pipe()
        warm = Forked(jobs_w, status_r)
        request = {"serve": str(home), "settings": settings, "log": str(log_file), "env": env}
        pid = None
        try:
            pid = self._fork(request, [jobs_r, status_w], _Fork(warm=warm))
        finally:
            os.close(jobs_r)  # the worker's ends: the starter had them passed, and closed them
            os.close(status_w)
            if pid is None:  # not forked, or it raised: ours go too
                warm.stdin.close()
                os.close(status_r)
        return warm if pid is not None else None

    def _fork(self, request: dict[str, Any], fds: list[int], fork: _Fork) -> int | None:
        with self._lock:
            if self._off:
                return None
            base = dict(os.environ)
            if self._proc is None:
                self._launch(base)
                return None
            if not self._ready or self._env != base:
                return None
            with self._state:
                self._asking.append(fork)
            try:
                assert self._requests is not None
                socket.send_fds(self._requests, [json.dumps(request).encode()], fds)
                pid = self._answers.get(timeout=ANSWER_SECONDS)
            except (OSError, queue.Empty) as e:
                self._stop(f"it did not answer: {e or 'timed out'}")
                raise OSError("the worker starter did not answer; it was stopped") from e
            if pid == DIED:  # a worker it forked for the job may run: this attempt is over
                raise OSError("the worker starter died while starting the worker")
            return pid

    def _launch(self, env: dict[str, str]) -> None:
        argv = ["--starter", str(jobs_root(self.state_dir)), str(os.getpid())]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            with theirs, open(self.state_dir / LOG_FILE, "ab") as err:
                self._proc = subprocess.Popen(
                    [self.python, "-m", WORKER_MODULE, *argv],
                    stdin=theirs.fileno(),
                    stdout=subprocess.PIPE,
                    stderr=err,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                )
            self._requests = ours
        except OSError as e:
            ours.close()
            self._off, self._why = True, f"could not start: {e}"
            log.error("starter.not_started", error=str(e), workers="plain processes")
            return
        self._env = env
        self._launched_at = time.monotonic()
        self._started_at = time.time()
        threading.Thread(target=self._read, args=(self._proc,), daemon=True).start()
        log.info("starter.started", pid=self._proc.pid)

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if "ready" in message:
                self._on_ready(message)
            elif "started" in message or "failed" in message:
                pid = message.get("started")
                with self._state:  # known before its exit can be read (one stream, in order)
                    fork = self._asking.popleft()
                    if pid is not None:
                        self._workers[pid] = fork
                        if fork.warm is not None:
                            fork.warm._forked(pid)
                self._answers.put(pid)
            elif "exited" in message:
                pid, rc = int(message["exited"]), int(message["rc"])
                with self._state:
                    ended = self._workers.pop(pid, None)
                if ended is not None and ended.job is not None:
                    self.on_exit(ended.job[0], pid, rc)
                elif ended is not None and ended.warm is not None:
                    ended.warm._exited(rc)
        proc.wait()
        with self._state:
            left, self._workers = self._workers, {}
            unanswered = len(self._asking)
            self._asking.clear()
        lost = {pid: fork.job for pid, fork in left.items() if fork.job is not None}
        for fork in left.values():
            if fork.warm is not None:  # read by the warm executor as it was: ends seen as gone
                fork.warm._starter_gone()
        for _ in range(unanswered):
            self._answers.put(DIED)
        if not self._off:
            self._off, self._why = True, f"it ended (exit code {proc.returncode})"
            log.warning("starter.ended", rc=proc.returncode, workers_left=len(lost))
            self.on_ready()  # will never be: jobs start without it
        if lost:
            self.on_lost(lost)

    def _on_ready(self, message: dict[str, object]) -> None:
        if message["ready"]:
            self._ready = True
            log.info("starter.ready", preloaded=message.get("preloaded"))
        else:
            self._off, self._why = True, f"unsafe to fork: {message.get('why')}"
            log.warning("starter.unsafe", why=message.get("why"), workers="plain processes")
        self.on_ready()

    def _stop(self, why: str) -> None:
        self._off, self._why = True, f"stopped: {why}"
        log.error("starter.stopped", why=why)
        if self._proc is not None:
            kill_group(self._proc.pid)

    def close(self) -> None:
        """The daemon stops: the starter ends (its running workers do not), and is gone when
        this returns."""
        with self._lock:
            self._off = True
            if self._proc is None:
                return
            try:
                if self._requests is not None:
                    self._requests.close()
                self._proc.wait(CLOSE_SECONDS)
            except (OSError, subprocess.TimeoutExpired):
                kill_group(self._proc.pid)

    def describe(self) -> dict[str, object] | None:
        """What `watcher status` says of it: None before it is started; else its pid, `state`
        (starting, ready or off), `since` (when it started, epoch seconds) and, when off,
        `why`."""
        if self._proc is None and not self._off:
            return None
        state = "off" if self._off else "ready" if self._ready else "starting"
        return {
            "pid": self._proc.pid if self._proc is not None else None,
            "state": state,
            "since": self._started_at,
            "why": self._why if self._off else None,
        }

    def workers(self) -> dict[str, int]:
        """The running workers it forked: job id -> pid."""
        with self._state:
            return {f.job[0]: pid for pid, f in self._workers.items() if f.job is not None}
