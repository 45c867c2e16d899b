"""This host's process table (/proc), as the daemon needs it: is a worker still ours, which
processes belong to our workers' groups, which workers an earlier daemon left behind, how to
kill a worker with everything it started, and how to clear up after it. (Whether a pid is
alive, and since when: `proctable`.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import structlog

from ckpt_watcher import scratch
from ckpt_watcher.jobfolder import STARTER_NAME, WORKER_MODULE, jobs_root
from ckpt_watcher.proctable import proc_stat, process_alive, process_name, process_start_token

log = structlog.get_logger("ckpt_watcher.executors.processes")


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _cmdline(pid: int) -> list[bytes] | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None


def process_groups(leaders: set[int]) -> set[int]:
    """Every process in the process groups that `leaders` lead (a worker and the engine
    processes it started, which hold the GPU memory): all of them are ours."""
    if not leaders:
        return set()
    found = set(leaders)
    for pid in _pids():
        fields = proc_stat(pid)
        if fields is not None and len(fields) > 2 and int(fields[2]) in leaders:  # field 5
            found.add(pid)
    return found


def is_our_worker(pid: int, start_token: str | None) -> bool:
    """True only if `pid` is still the worker process we started (its start time tells it from
    a process that got the same pid later): a one-shot worker or a warm one."""
    if not pid or not start_token or process_start_token(pid) != start_token:
        return False
    argv = _cmdline(pid)
    return argv is not None and WORKER_MODULE.encode() in argv


def is_starter(pid: int) -> bool:
    """True if `pid` is a worker starter (whose command line its forked workers share)."""
    return process_name(pid) == STARTER_NAME


def find_workers(state_dir: Path) -> list[int]:
    """PIDs of worker processes started for this state_dir (by any daemon instance), and of
    the worker starters that forked them (`is_starter` tells)."""
    prefix = str(jobs_root(state_dir)).encode()
    found = []
    for pid in _pids():
        argv = _cmdline(pid)
        if argv and WORKER_MODULE.encode() in argv and any(a.startswith(prefix) for a in argv):
            found.append(pid)
    return found


def kill_group(pid: int) -> None:
    """SIGKILL a worker's process group (it leads its own session)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError as e:
        log.error("executor.kill_refused", pid=pid, error=str(e))


def reap_group(pid: int) -> None:
    """A worker exited: kill what is left of its process group (its engine processes) and
    remove its temporary folder (scratch.py), which holds what those left behind."""
    kill_group(pid)
    scratch.remove(pid)


def reap_remnants(pid: int) -> None:
    """`reap_group` for a worker that is gone, seen later (adopted, or at a start): vLLM's engine
    process, forked from the worker on CUDA, outlives a kill -9 of it, holding its GPU memory. A
    pid alive again is another process's and is left alone; while the dead worker's group has
    members, Linux gives its pid to no new process."""
    if pid > 0 and not process_alive(pid):
        reap_group(pid)
