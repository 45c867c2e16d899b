"""A lane: one thread that runs an owner's blocking calls in order, so the daemon's loop never
waits on I/O. The loop submits a call, gets a Future, and looks at it on a later pass; the lane
wakes the loop when a call ends.

Why a thread and not a process: the calls are I/O-bound (S3 requests, listings of a network
filesystem), share a boto3 client and return Python objects, and a thread costs nothing to
start. A thread cannot be killed, so every call run on a lane must be bounded by itself
(socket timeouts, a retry budget); the loop never waits for it either way, and shows a call that
runs too long (`busy_for`). Lane threads are daemon threads: a hung call never delays exit.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class Lane:
    def __init__(self, name: str, wake: Callable[[], None] | None = None) -> None:
        self.name = name
        self._wake = wake
        self._calls: queue.Queue[tuple[Future[Any], Callable[[], Any]] | None] = queue.Queue()
        self._started_at: float | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn` to run on the lane's thread; its result (or exception) lands in the Future."""
        future: Future[T] = Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._calls.put((future, fn))
        return future

    def busy_for(self, now: float | None = None) -> float:
        """Seconds the current call has been running (0 when idle)."""
        started = self._started_at
        if started is None:
            return 0.0
        return (time.monotonic() if now is None else now) - started

    def _run(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            self._started_at = time.monotonic()
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to whoever looks at the Future
                future.set_exception(e)
            finally:
                self._started_at = None
            if self._wake is not None:
                self._wake()

    def close(self) -> None:
        """Let the thread end after its current call (never waits for it)."""
        self._calls.put(None)
