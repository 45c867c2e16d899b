"""The Executor interface: start a worker process for a job on a device, report its exit, kill it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from ckpt_watcher.jobfolder import JobFolder


@dataclass(frozen=True)
class WorkerHandle:
    job_id: str
    pid: int  # 0 where the worker is not a process of this host (Ray)
    start_token: str  # kernel start time of the pid: tells a reused pid from our worker


ExitCallback = Callable[[str, int], None]  # (job_id, return code); called from another thread


class Executor(ABC):
    """Runs workers; the daemon stays the only scheduler and the only ledger writer.

    Every executor reports each started job's exit exactly once through its `ExitCallback`
    (from a thread of its own), with the worker's exit code (negative: killed by that signal)."""

    # True where workers on different devices share this host's files (a task's journal), so
    # idle devices can join a running job's task (jobs/helpers.py)
    shares_journals: bool = False
    # True where a device's worker can start an engine before its checkpoint's weights exist
    # (`prepare`: warm workers on this host)
    starts_engines_ahead: bool = False

    @abstractmethod
    def start(self, job_id: str, folder: JobFolder, env: dict[str, str]) -> WorkerHandle:
        """Run `python -m ckpt_watcher.worker FOLDER` (or hand the folder to a warm worker) with
        `env` added to this process's environment; the worker logs to the folder's log."""

    @abstractmethod
    def kill(self, job_id: str) -> None:
        """Kill the job's worker and every process it started (no-op if gone)."""

    @abstractmethod
    def running(self) -> set[str]:
        """The jobs whose exit has not been reported yet."""

    def adopt(self, job_id: str, handle: WorkerHandle, folder: JobFolder) -> bool:
        """Take over a job whose worker an earlier daemon started and that is still running:
        report its exit (from the folder's exit file) and kill it on request, as for a worker
        started here. False where this executor cannot (its workers are not processes of this
        host); the job is then killed and run again."""
        return False

    def ready_to_start(self) -> bool:
        """False while the executor gets ready to start workers faster (the worker starter's
        imports, executors/starter.py): the daemon starts no job meanwhile, and the executor
        wakes it once ready. A job started anyway starts as it would without."""
        return True

    def starter_state(self) -> dict[str, object] | None:
        """The worker starter's state for `watcher status` (executors/starter.py), or None
        where there is none (not started yet, `executor.preload: false`, Ray)."""
        return None

    def look_elsewhere(self) -> list[dict[str, object]]:
        """Once a heartbeat, for executors whose workers run on other hosts (Ray's nodes): each
        running job's progress copied into its job folder here (where `watcher status` reads
        it), and the warm engines those hosts keep for this daemon, as status lists this
        host's (status.warm_engines)."""
        return []

    def prepare(self, device_label: str, folder: JobFolder, env: dict[str, str]) -> bool:
        """Have `device_label`'s warm worker start an engine for the request in `folder` before
        its checkpoint's weights exist (worker/early.py); False where this executor keeps no
        engines between jobs, or that device's worker is busy."""
        return False

    def idle_engines(self) -> dict[str, str | None]:
        """The devices whose warm worker waits for a job, each with the run whose model its
        engine holds: its last job's, or the run it was started for ahead of the weights
        (None: not known, or no engine)."""
        return {}

    def release(self, device_label: str) -> None:
        """Stop the device's warm worker that waits for a job (its GPU is given back)."""
        return None

    def worker_pids(self) -> set[int]:
        """Processes of this host that the executor keeps besides its jobs' own workers (warm
        workers waiting for a job): their GPU memory is ours."""
        return set()

    def where(self, job_id: str) -> str | None:
        """The node running a job, for executors that place jobs on other hosts (else None)."""
        return None

    def close(self) -> None:
        """The daemon stops: release what outlives jobs (warm engines). Running jobs are the
        daemon's business (drained or killed before this)."""
        return None
