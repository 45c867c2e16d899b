"""An in-memory executor whose "workers" take a known time per task and write the same outcome
files a real worker writes. For scheduling tests and benchmarks, where what matters is when jobs
start and end, not what a model scores.

Time is a parameter. On `SimClock` (tests) nothing sleeps: time moves only when the daemon's loop
waits, straight to its next deadline or the next task a worker finishes, so a test of hours of
evaluations runs in milliseconds and always the same way. On `RealTimers` (bench/scheduling.py)
tasks take real seconds, so the daemon's own overhead between jobs shows.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ckpt_watcher.executors.base import Executor, ExitCallback, WorkerHandle
from ckpt_watcher.jobfolder import EXIT_CRASH, Crash, JobFolder, TaskOutcome
from ckpt_watcher.timestamps import stamp

_pids = itertools.count(10_000_000)  # never a real pid


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Timers(Protocol):
    """A time source that can also run a call later."""

    def __call__(self) -> float: ...

    def call_at(self, when: float, fn: Callable[[], None]) -> Cancellable: ...


class RealTimers:
    """Wall-clock time; calls run on timer threads."""

    def __call__(self) -> float:
        return time.time()

    def call_at(self, when: float, fn: Callable[[], None]) -> Cancellable:
        timer = threading.Timer(max(0.0, when - time.time()), fn)
        timer.daemon = True
        timer.start()
        return timer


class _Scheduled:
    def __init__(self, when: float, seq: int, fn: Callable[[], None]) -> None:
        self.when, self.seq, self.fn = when, seq, fn
        self.cancelled = False

    def __lt__(self, other: _Scheduled) -> bool:
        return (self.when, self.seq) < (other.when, other.seq)

    def cancel(self) -> None:
        self.cancelled = True


class SimClock:
    """Simulated time for the daemon (`Daemon(clock=sim, wait=sim.wait)`) and this executor.

    `wait` is the daemon's sleep: the next call due within its timeout runs at once (time jumps
    to it); with none, time jumps by the whole timeout. Threads of the daemon that really work
    (source scans) still wake it early, as the real wait would; while `busy()` says one is out,
    time stands still until it answers (set it to `daemon.discovery.scanning`): a scan reads
    the clock as it judges each checkpoint, and a jump mid-scan on a loaded machine once made
    step 200 ready one scan before step 300."""

    # real seconds a wait gives the daemon's own threads (scans) before time jumps
    REAL_GRACE_SECONDS = 0.005
    # real seconds a wait lasts at most while `busy()` (the scan wakes the daemon when done)
    BUSY_WAIT_SECONDS = 1.0

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start
        self._queue: list[_Scheduled] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self.busy: Callable[[], bool] = lambda: False

    def __call__(self) -> float:
        return self.now

    def call_at(self, when: float, fn: Callable[[], None]) -> Cancellable:
        item = _Scheduled(when, next(self._seq), fn)
        with self._lock:
            heapq.heappush(self._queue, item)
        return item

    def _next_due(self, deadline: float) -> _Scheduled | None:
        with self._lock:
            while self._queue and self._queue[0].cancelled:
                heapq.heappop(self._queue)
            if self._queue and self._queue[0].when <= deadline:
                return heapq.heappop(self._queue)
        return None

    def wait(self, event: threading.Event, timeout: float) -> bool:
        if event.is_set():
            return True
        if self.busy():
            return event.wait(self.BUSY_WAIT_SECONDS)
        due = self._next_due(self.now + timeout)
        if due is not None:
            self.now = max(self.now, due.when)
            due.fn()
            return event.is_set()
        if event.wait(self.REAL_GRACE_SECONDS):
            return True
        self.now += timeout
        return False


class SimulatedExecutor(Executor):
    def __init__(
        self,
        on_exit: ExitCallback,
        duration: Callable[[str, int | None], float],
        timers: Timers | None = None,
        loads_checkpoint: bool = False,
    ) -> None:
        """`loads_checkpoint`: a job whose checkpoint folder is gone when it starts fails at
        once, as a real worker that cannot load it does (a trainer deleted it)."""
        self.on_exit = on_exit
        self.duration = duration
        self.loads_checkpoint = loads_checkpoint
        self.timers: Timers = timers or RealTimers()
        self._pending: dict[str, list[Cancellable]] = {}
        self._lock = threading.Lock()

    def start(self, job_id: str, folder: JobFolder, env: dict[str, str]) -> WorkerHandle:
        spec = folder.read_spec()
        at = self.timers()
        calls: list[Cancellable] = []
        if self.loads_checkpoint and not Path(spec.request.checkpoint).is_dir():
            folder.write_crash(Crash(f"{spec.request.checkpoint}: no such checkpoint", True))
            calls.append(self.timers.call_at(at, lambda: self._exit(job_id, EXIT_CRASH)))
            with self._lock:
                self._pending[job_id] = calls
            return WorkerHandle(job_id, next(_pids), "simulated")
        last = len(spec.request.tasks) - 1
        for i, t in enumerate(spec.request.tasks):
            began, at = at, at + self.duration(t.task, t.num_fewshot)
            outcome = TaskOutcome(
                t.task,
                t.num_fewshot,
                "ok",
                name=t.name,
                metrics={"acc,none": 1.0},
                n_samples=1,
                started_at=stamp(began),
                finished_at=stamp(at),
                lm_eval_version="simulated",
            )
            calls.append(
                self.timers.call_at(at, self._finisher(job_id, folder, i, outcome, i == last))
            )
        if not calls:
            calls.append(self.timers.call_at(at, lambda: self._exit(job_id, 0)))
        with self._lock:
            self._pending[job_id] = calls
        return WorkerHandle(job_id, next(_pids), "simulated")

    def _finisher(
        self, job_id: str, folder: JobFolder, index: int, outcome: TaskOutcome, last: bool
    ) -> Callable[[], None]:
        def finish() -> None:
            folder.write_outcome(index, outcome)
            if last:
                self._exit(job_id, 0)

        return finish

    def _exit(self, job_id: str, rc: int) -> None:
        with self._lock:
            if self._pending.pop(job_id, None) is None:
                return  # killed: its exit was reported then
        self.on_exit(job_id, rc)

    def kill(self, job_id: str) -> None:
        with self._lock:
            calls = self._pending.get(job_id)
        if calls is None:
            return
        for call in calls:
            call.cancel()
        self._exit(job_id, -9)

    def running(self) -> set[str]:
        with self._lock:
            return set(self._pending)
