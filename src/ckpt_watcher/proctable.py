"""Whether a process of this host is alive, and since when (/proc): a pid with its start time
names one process for good, where a pid alone may be reused. Both sides of the job folder use it
(the daemon for its workers, workers for each other's chunk claims). And a process's name (what
`top` and `ps -o comm` show), which tells a worker from the worker starter it was forked from:
both have the starter's command line."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

PR_SET_NAME = 15


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


def libc_prctl() -> Any | None:
    """libc's prctl (Linux), or None where there is none."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def set_name(name: str) -> None:
    """Name this process (Linux keeps 15 bytes); elsewhere nothing changes."""
    prctl = libc_prctl()
    if prctl is not None:
        prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def process_name(pid: int) -> str | None:
    """/proc/PID/comm, or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def process_start_token(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None."""
    fields = proc_stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def process_gone(pid: int, start_token: str | None) -> bool:
    """True once the process `pid` that started at `start_token` has ended: exited (a zombie
    counts), or its pid now another process's."""
    return process_start_token(pid) != start_token or not process_alive(pid)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (/proc/PID/stat field 4)."""
    found = []
    for entry in Path("/proc").iterdir():
        fields = proc_stat(int(entry.name)) if entry.name.isdigit() else None
        if fields is not None and len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry.name))
    return found
