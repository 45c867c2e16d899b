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


class Coalescing:
    """Work by key (a run path) on a lane of its own: a key asked for while its work is queued
    or running is done once more afterwards, never twice at once and never more often than it
    can keep up. `work(key)` returns False when it failed; failed keys wait for `retry_failed`.
    """

    def __init__(
        self, name: str, work: Callable[[str], bool], wake: Callable[[], None] | None = None
    ) -> None:
        self.work = work
        self.lane = Lane(name, wake)
        self._lock = threading.Lock()
        self._dirty: set[str] = set()
        self._failed: set[str] = set()
        self._draining = False

    def request(self, key: str) -> None:
        """Do `key`'s work soon, on the lane (returns at once)."""
        with self._lock:
            self._dirty.add(key)
            if self._draining:
                return  # the drain in flight picks it up
            self._draining = True
        self.lane.submit(self._drain)

    def retry_failed(self) -> None:
        with self._lock:
            keys, self._failed = self._failed, set()
        for key in keys:
            self.request(key)

    def has_failed(self) -> bool:
        with self._lock:
            return bool(self._failed)

    def pending(self) -> set[str]:
        """Keys whose latest work is not done (queued, running, or failed)."""
        with self._lock:
            return self._dirty | self._failed

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for work queued or running; True if none failed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._draining:
                    return not (self._dirty or self._failed)
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self.lane.close()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._dirty:
                    self._draining = False
                    return
                key = self._dirty.pop()
            if not self.work(key):
                with self._lock:
                    self._failed.add(key)
