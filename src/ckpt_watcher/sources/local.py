"""A local directory tree (local disk, EFS, NFS) as a checkpoint source.

Polling with a snapshot is the truth: inotify sees nothing written by other hosts on a network
filesystem. Where inotify works (watchdog), it only wakes the next scan early. Symlinks are
never followed, so a link can never lead a scan (or an eval) out of the watched root.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher.checkpoints.files import LocalFiles
from ckpt_watcher.checkpoints.fingerprint import Mode
from ckpt_watcher.checkpoints.namefix import apply_fix
from ckpt_watcher.checkpoints.naming import (
    being_written,
    has_hf_copy,
    looks_like_checkpoint_name,
    model_folder,
    parse_checkpoint_dir,
)
from ckpt_watcher.pins import PIN_FOLDER
from ckpt_watcher.sources.base import UNRECOGNISED, Found

log = structlog.get_logger("ckpt_watcher.sources.local")

# Files whose presence makes a folder "model-like" even when its name follows no pattern.
_MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_config.json",
)
# inotify events that can complete a checkpoint: a file closed after writing, created, moved or
# deleted. Per-write "modified" events are ignored: they would rescan on every write() call.
_WAKE_EVENTS = frozenset({"closed", "created", "moved", "deleted"})
_PINS = f"/{PIN_FOLDER}"
# `_classify`'s answer for a step folder with no model in it (naming.model_folder): neither a
# checkpoint nor a folder to look into
_NO_MODEL = Found("", None, None, "no model folder")


def printable(path: str | Path) -> str:
    """A path as text that is always valid UTF-8 (undecodable bytes shown as \\xNN)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _steps(folder: Path, sub: str) -> list[Path]:
    """Each folder from `folder` down to `folder/sub`, below `folder`."""
    parts = Path(sub).parts
    return [folder.joinpath(*parts[: i + 1]) for i in range(len(parts))]


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class LocalSource:
    """Scan `root` (to `max_depth`) for checkpoint directories."""

    def __init__(
        self,
        root: Path,
        poll_seconds: float = 30.0,
        max_depth: int = 4,
        inotify: bool = True,
        scandir: Callable[[Path], Iterable[Any]] = os.scandir,
        fingerprint: Mode = "sampled",
        adapter_base: Path | None = None,
        convert: list[str] | None = None,
    ) -> None:
        self.root = root
        self.fingerprint_mode: Mode = fingerprint
        self.adapter_base = adapter_base
        self.convert = convert
        self.recheck_per_scan: int | None = None  # a stat per file: every evaluated one, every scan
        self.name = f"local:{root}"
        self.poll_seconds = poll_seconds
        self.max_depth = max_depth
        self.use_inotify = inotify
        self._scandir = scandir
        self._observer: Any = None
        self._lock = threading.Lock()

    def owns(self, location: str) -> bool:
        root = str(self.root).rstrip("/") + "/"
        return location.startswith(root)

    def scan(self) -> list[Found]:
        if not self.root.is_dir():
            raise FileNotFoundError(f"{self.root} does not exist or is not a directory (yet)")
        found: list[Found] = []
        stack: list[tuple[Path, int]] = [(self.root, 0)]
        while stack:
            folder, depth = stack.pop()
            try:
                entries = list(self._scandir(folder))
            except (FileNotFoundError, NotADirectoryError):
                continue  # deleted between listing its parent and listing it
            except PermissionError:
                found.append(Found(printable(folder), None, None, "permission denied"))
                continue
            for entry in sorted(entries, key=lambda e: e.name):
                child = Path(entry.path)
                if entry.is_symlink():
                    if looks_like_checkpoint_name(entry.name) or self._model_like(child):
                        found.append(Found(printable(child), None, None, "symlink: not followed"))
                    continue
                if not entry.is_dir(follow_symlinks=False) or entry.name == PIN_FOLDER:
                    continue  # files; and the watcher's own pinned copies (pins.py)
                if being_written(entry.name):
                    continue  # a step not named yet: seen once its trainer renames it
                item = self._classify(child)
                if item is _NO_MODEL:
                    continue
                if item is not None:
                    found.append(item)
                elif depth + 1 < self.max_depth:
                    stack.append((child, depth + 1))
        return found

    def _model_like(self, folder: Path) -> bool:
        try:
            return any((folder / f).exists() for f in _MODEL_FILES)
        except OSError:
            return False

    def _classify(self, folder: Path) -> Found | None:
        """A Found for checkpoint-like folders (recognised or not), `_NO_MODEL` to pass it by;
        None to descend into it."""
        name = folder.name
        if looks_like_checkpoint_name(name):
            sub = model_folder(name, lambda sub: os.path.lexists(folder / sub))
            beside = folder.parent.parent
            if sub is None or has_hf_copy(
                name, folder.parent.name, lambda n: (beside / n).is_dir()
            ):
                return _NO_MODEL
            if not _is_utf8(str(folder)):
                return Found(printable(folder), None, None, "path is not valid UTF-8")
            ident = parse_checkpoint_dir(folder, self.root)
            if ident is None:
                return Found(
                    printable(folder),
                    None,
                    None,
                    "its run (parent folder) name has unsafe characters",
                )
            if sub and any(os.path.islink(p) for p in _steps(folder, sub)):
                return Found(printable(folder / sub), None, None, "symlink: not followed")
            return Found(str(folder / sub), folder / sub, ident)
        if self._model_like(folder):
            return Found(printable(folder), None, None, UNRECOGNISED)
        return None

    def view(self, location: str) -> LocalFiles:
        return LocalFiles(Path(location))

    def exists(self, location: str) -> bool:
        return Path(location).is_dir()

    def prepare(self, location: str) -> list[str]:
        return [a.describe() for a in apply_fix(Path(location))]

    def hold(self, location: str) -> None:
        return None  # the daemon pins local checkpoints itself (pins.py)

    def held(self, location: str, write_mark: str | None = None) -> bool:
        return False

    def stage_spec(self, location: str) -> None:
        return None

    def release(self, location: str) -> None:
        pass

    def make_room(self, needed: list[str]) -> None:
        pass

    def watch(self, wake: Callable[[], None]) -> bool:
        """Start an inotify observer on the root; False (polling only) where that fails."""
        if not self.use_inotify:
            return False
        with self._lock:
            if self._observer is not None:
                return True
            if not self.root.is_dir():
                return False
            try:
                from watchdog.events import FileSystemEvent, FileSystemEventHandler
                from watchdog.observers.inotify import InotifyObserver

                class _Wake(FileSystemEventHandler):
                    def on_any_event(self, event: FileSystemEvent) -> None:
                        # the watcher's own pins (links made and released) are no news
                        if event.event_type in _WAKE_EVENTS and _PINS not in str(event.src_path):
                            wake()

                # a folder renamed inside the tree (a pin's staging folder made final) keeps its
                # inotify watch, and watchdog warns that it re-adds it: harmless, and noise in
                # the daemon's log
                warnings.filterwarnings(
                    "ignore", r"Callback with id .* already exists for watch", RuntimeWarning
                )
                observer = InotifyObserver()
                observer.schedule(_Wake(), str(self.root), recursive=True)
                observer.start()
            except Exception as e:  # no inotify (not Linux, limits, odd fs): polling still works
                log.warning("source.inotify_unavailable", source=self.name, error=str(e))
                return False
            self._observer = observer
            return True

    def close(self) -> None:
        with self._lock:
            if self._observer is not None:
                self._observer.stop()
                self._observer.join(timeout=5)
                self._observer = None
