"""A copy that a checkpoint's jobs share (its conversion: worker/convert.py), made once per key
and removed when the last job using it ends.

`<root>/<key>/` is whole once it is there (it is made in `<key>.partial-<pid>/` and renamed);
`<key>.lock` is held exclusively while one job looks for the copy, makes it or removes it;
`<key>.use` is held shared by every job using it. A job that ends takes `.lock`, then tries
`.use` exclusively without waiting: it gets it only when no other job uses the copy, and
removes it. The kernel drops a killed worker's locks: its half-made copy is removed by the
next job that makes one, a whole copy nobody uses by the daemon's next start (`sweep_unused`).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from ckpt_watcher.proctable import process_alive

_PARTIAL = re.compile(r"^(?P<key>.+)\.partial-(?P<pid>\d+)$")


@contextmanager
def _locked(path: Path, how: int) -> Iterator[IO[str]]:
    with open(path, "a") as f:
        fcntl.flock(f, how)
        yield f


class Shared:
    """One job's use of the copy `<root>/<key>/`: `get(make)` returns it (made by `make(into)`
    if no job made it whole yet), `release()` ends the use (the last user removes it)."""

    def __init__(self, root: Path, key: str) -> None:
        self.root, self.key = root, key
        self.path = root / key
        self._use: IO[str] | None = None

    def get(self, make: Callable[[Path], None]) -> tuple[Path, bool]:
        """The copy, and whether this job made it."""
        self.root.mkdir(parents=True, exist_ok=True)
        with _locked(self.root / f"{self.key}.lock", fcntl.LOCK_EX):
            self._use = open(self.root / f"{self.key}.use", "a")  # noqa: SIM115 (held to release)
            fcntl.flock(self._use, fcntl.LOCK_SH)
            if self.path.is_dir():
                return self.path, False
            _remove_partials(self.root, self.key)
            partial = self.root / f"{self.key}.partial-{os.getpid()}"
            partial.mkdir()
            try:
                make(partial)
                partial.rename(self.path)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                self._drop_use()  # `.lock` is held here: nothing else to remove
                raise
            return self.path, True

    def _drop_use(self) -> None:
        if self._use is not None:
            fcntl.flock(self._use, fcntl.LOCK_UN)
            self._use.close()
            self._use = None

    def release(self) -> None:
        """This job is done with the copy: removed unless another job still uses it."""
        if self._use is None:
            return
        with _locked(self.root / f"{self.key}.lock", fcntl.LOCK_EX):
            self._drop_use()
            _remove_unused(self.root, self.key)


def _remove_unused(root: Path, key: str) -> bool:
    """With `<key>.lock` held: remove the copy if no job holds `<key>.use`."""
    with open(root / f"{key}.use", "a") as use:
        try:
            fcntl.flock(use, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(root / key, ignore_errors=True)
    return True


def _remove_partials(root: Path, key: str) -> None:
    for entry in root.glob(f"{key}.partial-*"):
        m = _PARTIAL.match(entry.name)
        if m and not process_alive(int(m["pid"])):
            shutil.rmtree(entry, ignore_errors=True)


def sweep_unused(root: Path) -> None:
    """The daemon's start: remove the copies no job uses, and those half-made by dead workers."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        path = root / name
        if _PARTIAL.match(name):
            _remove_partials(root, _PARTIAL.match(name)["key"])  # type: ignore[index]
        elif path.is_dir():
            try:
                with _locked(root / f"{name}.lock", fcntl.LOCK_EX | fcntl.LOCK_NB):
                    _remove_unused(root, name)
            except BlockingIOError:
                continue  # a job is looking at it now
