"""Every process the worker forks dies with it: vLLM's engine process on CUDA is forked (not
spawned) from the worker and, the worker killed -9 (the OOM killer, an operator), lived on with
its GPU memory (seen on an H100: 25 GB, five minutes on). The daemon kills what is left of a
dead worker's process group when it sees the death, but a Ray node, or a host whose daemon died
too, has nobody to do that at once: here the kernel does it.

`arm()` makes each child forked from this process (os.fork, multiprocessing's fork) ask for
SIGKILL at its parent's death (PR_SET_PDEATHSIG), and so on down: the hook is inherited. The
signal follows the thread that forked; the worker forks its engines from its main thread, which
lives as long as it does. Processes started with subprocess (harnesses, model servers) are not
forked this way; the reaper covers them (harnesses/reaper.py).

`die_with_parent()` is the same for one process: the worker starter (starter.py) dies with its
daemon, while the workers it forks (the signal is not inherited) outlive it.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from ckpt_watcher.proctable import libc_prctl

PR_SET_PDEATHSIG = 1
_parent = 0  # the forking process, for the child to check it is still there
_prctl: Any = None  # libc's prctl, looked up before any fork (no dlopen in a forked child)


def _before() -> None:
    global _parent
    _parent = os.getpid()


def _tie(prctl: Any, parent: int) -> None:
    """SIGKILL this process at its parent's death; at once if `parent` is gone already (it
    died before the signal was armed)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def _in_child() -> None:
    _tie(_prctl, _parent)


def die_with_parent(parent: int) -> None:
    """This process is SIGKILLed when `parent` (its parent, which started it) dies; at once if
    it is gone already. Only this process: what it forks later is not tied to it."""
    prctl = libc_prctl()
    if prctl is not None:
        _tie(prctl, parent)


def arm() -> None:
    """Children forked from here on die with their parent (Linux; elsewhere nothing changes)."""
    global _prctl
    _prctl = libc_prctl()
    if _prctl is not None:
        os.register_at_fork(before=_before, after_in_child=_in_child)
