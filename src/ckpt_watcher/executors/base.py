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


def process_start_token(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may contain spaces: split after it
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def is_our_worker(pid: int, start_token: str | None, job_id: str) -> bool:
    """True only if `pid` is still the worker we started for `job_id` (not a reused pid)."""
    if not start_token or process_start_token(pid) != start_token:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return WORKER_MODULE.encode() in cmdline and any(job_id.encode() in part for part in cmdline)
