"""The Executor interface and helpers to recognise our own worker processes after a restart."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

WORKER_MODULE = "ckpt_watcher.worker"
# What a worker writes when something stopped it as a whole (staging, loading the model):
# {"error": ..., "heals": bool}, read by the daemon when it settles the job.
CRASH_FILE = "crash.json"


@dataclass(frozen=True)
class WorkerHandle:
    job_id: str
    pid: int
    start_token: str  # kernel start time of the pid: tells a reused pid from our worker


ExitCallback = Callable[[str, int], None]  # (job_id, return code); called from another thread


class Executor(Protocol):
    def start(
        self, job_id: str, job_dir: Path, env: dict[str, str], log_path: Path
    ) -> WorkerHandle:
        """Start `python -m ckpt_watcher.worker job_dir`; report its exit through the callback."""
        ...

    def kill(self, job_id: str) -> None:
        """Kill the job's worker and every process it started (no-op if gone)."""
        ...

    def running(self) -> set[str]: ...

    # Executors that keep workers between jobs (warm.py) also have `worker_pids() -> set[int]`
    # (those workers, busy or idle: their GPU memory is ours) and `close()` (release them when
    # the daemon stops); the daemon looks them up with getattr.


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (so [0] is field 3, the state), or None
    when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may contain spaces: split after it
    return stat.rsplit(")", 1)[-1].split()


def process_alive(pid: int) -> bool:
    """True if `pid` is a process that has not exited (a zombie has)."""
    fields = proc_stat(pid) if pid > 0 else None
    return fields is not None and bool(fields) and fields[0] != "Z"


def process_start_token(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None."""
    fields = proc_stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def process_groups(leaders: set[int]) -> set[int]:
    """Every process in the process groups that `leaders` lead (a worker and the engine
    processes it started, which hold the GPU memory): all of them are ours."""
    if not leaders:
        return set()
    found = set(leaders)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = proc_stat(int(entry.name))
            if fields is not None and len(fields) > 2 and int(fields[2]) in leaders:  # field 5
                found.add(int(entry.name))
    return found


def is_our_worker(pid: int, start_token: str | None, job_id: str) -> bool:
    """True only if `pid` is still the worker we started for `job_id` (not a reused pid)."""
    if not start_token or process_start_token(pid) != start_token:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return WORKER_MODULE.encode() in cmdline and any(job_id.encode() in part for part in cmdline)
