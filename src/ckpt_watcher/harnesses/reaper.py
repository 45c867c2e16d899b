"""`python -m ckpt_watcher.harnesses.reaper ARGV...`: run ARGV so that nothing it starts
outlives the worker.

A harness or a model server starts processes of its own (vLLM's engine core and workers,
vf-eval's rollouts): the parent-death signal of the process the worker started reaches only that
one, and a worker killed -9 would leave the rest holding the GPU. The reaper leads a process
group of its own, runs ARGV in it, and on SIGTERM, SIGINT or the worker's death (its
parent-death signal) passes SIGTERM on, waits `GRACE_SECONDS`, and kills the whole group; when
ARGV ends, whatever it left in the group goes too. Standard library only: it runs with any
interpreter.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading

GRACE_SECONDS = 20.0
PR_SET_PDEATHSIG = 1


def _group() -> list[int]:
    """The other processes of this group (from /proc)."""
    me, group = os.getpid(), os.getpgrp()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:  # after the name: state, ppid, pgrp
            out.append(int(entry))
    return out


def _kill_group(sig: int) -> None:
    for pid in _group():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def main(argv: list[str]) -> int:
    parent = os.getppid()
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the worker died before the signal was armed
        return 1
    child = subprocess.Popen(argv)
    ending = threading.Event()

    def end(signum: int, frame: object) -> None:
        if ending.is_set():
            return
        ending.set()
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)

        def hard() -> None:
            try:
                child.wait(timeout=GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                pass
            _kill_group(signal.SIGKILL)

        threading.Thread(target=hard, daemon=True).start()

    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGINT, end)
    rc = child.wait()
    _kill_group(signal.SIGKILL)  # what it left behind
    return rc if rc >= 0 else 128 - rc


def reaped(argv: list[str]) -> list[str]:
    """`argv` under the reaper: it and all it starts end with the worker (`reaper.py`)."""
    return [sys.executable, "-m", "ckpt_watcher.harnesses.reaper", *argv]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
