"""A worker whose vLLM engine process dies ends at once, its job's crash written.

On CUDA, vLLM runs its engine core in a process of its own. When that process dies without a
word (SIGKILL: the host's OOM killer, a segfault, a driver fault), vLLM's synchronous client
waits for its outputs forever: its monitor thread sees the death and shuts the client down, but
nothing wakes `SyncMPClient.get_output`, blocked on a queue nobody fills again (seen with vLLM
0.32 on the CPU with the engine core in its own process, as on CUDA: `bench/gpu_smoke.sh resume`).
The worker would sit holding the device until `eval.timeout_seconds` (6 h by default).

So every engine a worker loads (`harness.load_model`) is watched: the processes the load
started are waited on, and if one ends while its engine is still ours (not shut down on
purpose, not collected), the job in hand gets its crash (`Crash`, heals: a retry resumes from
the journal) and the worker exits with `EXIT_CRASH`. An engine in the worker's own process
(vLLM on the CPU, hf) starts no process and is not watched.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar, cast

import structlog

from ckpt_watcher.jobfolder import EXIT_CRASH

log = structlog.get_logger("ckpt_watcher.evaluators.engine_watch")

T = TypeVar("T")

# what the job in hand says when its engine dies (worker/job.py: its crash and exit code)
_last_words: list[Callable[[str], None]] = []
_exiting = threading.Event()
_at_exit_registered: list[bool] = []


class EngineWatch:
    """The processes one engine's load started, waited on by a daemon thread."""

    def __init__(self, owner: Any, processes: list[BaseProcess]) -> None:
        self._owner = weakref.ref(owner)
        self._processes = processes
        self._stopped = threading.Event()
        self.pids = [p.pid for p in processes]
        threading.Thread(target=self._wait, daemon=True, name="ckpt-watcher-engine-watch").start()

    def stop(self) -> None:
        """The engine is being shut down on purpose: its processes may end now."""
        self._stopped.set()

    def _wait(self) -> None:
        ended = multiprocessing.connection.wait([p.sentinel for p in self._processes])
        if self._stopped.is_set() or _exiting.is_set() or self._owner() is None:
            return
        dead = next(p for p in self._processes if p.sentinel in ended)
        dead.join(timeout=1)
        # vLLM's own monitor may reap it first: its exit code then shows once that thread
        # has recorded it (our waitpid found nothing)
        deadline = time.monotonic() + 5
        while dead.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        why = f"vLLM's engine process (pid {dead.pid}) {_how(dead.exitcode)} while its engine was in use"
        log.error("engine.process_died", pid=dead.pid, exitcode=dead.exitcode, error=why)
        for say in list(_last_words):
            try:
                say(why)
            except Exception:  # the exit below must happen whatever
                log.exception("engine.last_words_failed")
        os._exit(EXIT_CRASH)


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else exitcode
        hint = " (the host's OOM killer, or a kill -9?)" if exitcode == -signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return "ended" if exitcode is None else f"exited with code {exitcode}"


def watched(load: Callable[[], T]) -> T:
    """`load()`'s engine, with the processes it started watched (none: nothing to watch)."""
    before = {p.pid for p in multiprocessing.active_children()}
    engine = load()
    started = [p for p in multiprocessing.active_children() if p.pid not in before]
    if started:
        if not _at_exit_registered:  # after multiprocessing's own exit handler, so before it
            atexit.register(_exiting.set)  # (atexit runs last in, first out): an exit shuts
            _at_exit_registered.append(True)  # engines down (finalizers), not a death
        watch = EngineWatch(engine, started)
        cast(Any, engine).engine_watch = watch
        log.info("engine.watched", pids=watch.pids)
    return engine


def stop(engine: Any) -> None:
    """`engine` is about to be shut down on purpose."""
    watch = getattr(engine, "engine_watch", None)
    if watch is not None:
        watch.stop()


@contextmanager
def last_words(say: Callable[[str], None]) -> Iterator[None]:
    """While in this block, an engine's death is told to `say` before the worker exits."""
    _last_words.append(say)
    try:
        yield
    finally:
        _last_words.remove(say)
