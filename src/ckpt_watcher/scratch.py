"""Each worker's own temporary folder, removed with it.

vLLM keeps its engine's ZMQ sockets and its rendezvous files in the temporary folder
(`tempfile.gettempdir()`), and leaves them there when its engine is killed: a host whose evals
are timed out, given back to training or preempted gathered thousands of them in /tmp. So a
worker makes `<tmp>/ckpt-watcher-worker-<pid>` its TMPDIR before anything else runs (what it
starts, engine processes and model servers, inherits it), and whoever sees the worker's process
group end removes the folder: the daemon when it reaps the group, the worker itself on a clean
exit, and a daemon's start for workers that ended while no daemon watched (`sweep`), with the
converted copies no job uses any more (shared_copies.py). On a Ray
node the agent's folder (its jobs' folders, its warm workers' homes), named after the agent's
process, goes the same way: the next agent on that node sweeps those of agents that died.

The compile caches are not in it: they are kept under the state folder (compile_cache.py).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from ckpt_watcher.proctable import process_alive
from ckpt_watcher.shared_copies import sweep_unused

PREFIX = "ckpt-watcher-worker-"
TASK_PREFIX = "ckpt-watcher-task-"  # a Ray node agent's folder: `agent_prefix`
MAX_SOCKET_PATH = 107  # a Unix socket's path, in bytes (sun_path less its NUL)
SOCKET_NAME_CHARS = 36  # vLLM names its sockets by a uuid4
_NAME = re.compile(rf"^(?:{re.escape(PREFIX)}(\d+)|{re.escape(TASK_PREFIX)}(\d+)-.+)$")


def folder(pid: int) -> Path:
    """The temporary folder of the worker `pid` (workers inherit the daemon's TMPDIR)."""
    return Path(tempfile.gettempdir()) / f"{PREFIX}{pid}"


def agent_prefix() -> str:
    """The name a Ray node agent's folder begins with: its process (an actor, which a node kills
    -9 when it dies, runs out of memory or is preempted, leaving the folder behind)."""
    return f"{TASK_PREFIX}{os.getpid()}-agent-"


def enter() -> Path | None:
    """In a worker, first thing: make its own folder this process's and its children's TMPDIR.
    Where it cannot be made, or its sockets' paths would be too long for a Unix socket, the
    inherited one is kept (nothing else changes)."""
    path = folder(os.getpid())
    if len(os.fsencode(path)) + 1 + SOCKET_NAME_CHARS > MAX_SOCKET_PATH:
        return None
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return None
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    return path


CONVERTED = (
    "ckpt-watcher-converted"  # conversions shared by a checkpoint's jobs (worker/convert.py)
)


def shared_root() -> Path:
    """Beside the workers' own folders (in the daemon's TMPDIR, on local disk): what a
    checkpoint's jobs on several devices share (converted copies)."""
    here = Path(tempfile.gettempdir())
    return (here.parent if here.name.startswith(PREFIX) else here) / CONVERTED


def leave(path: Path | None) -> None:
    """In a worker, last thing: its folder goes (`enter`'s; what killed engine processes of its
    left there too). After a kill, the daemon's `remove` does it."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def remove(pid: int) -> None:
    """The worker `pid` and its process group are gone: its folder goes too."""
    shutil.rmtree(folder(pid), ignore_errors=True)


def sweep() -> list[int]:
    """Remove the folders of workers, and the job folders of Ray tasks, whose process is no
    longer alive (they ended while no daemon watched them, or were killed); returns those pids.
    A live process's folder stays, whichever daemon or user it belongs to."""
    removed: list[int] = []
    root = Path(tempfile.gettempdir())
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if m and not process_alive(pid := int(m.group(1) or m.group(2))):
            shutil.rmtree(root / name, ignore_errors=True)
            if not (root / name).exists():  # another user's stays theirs
                removed.append(pid)
    sweep_unused(root / CONVERTED)
    return removed
