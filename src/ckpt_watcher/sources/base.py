"""The Source interface: list a tree into a snapshot of checkpoint candidates; diff snapshots."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ckpt_watcher.checkpoints.files import CheckpointFiles
from ckpt_watcher.checkpoints.fingerprint import Mode
from ckpt_watcher.checkpoints.naming import CheckpointId
from ckpt_watcher.jobfolder import Stage

UNRECOGNISED = "name follows no pattern ({run}_step{N}, {run}_final, checkpoint-{N}, global_step_{N}, step_{N})"


@dataclass(frozen=True)
class Found:
    """One directory a scan found: a checkpoint (ident set) or an unrecognised one (note says why)."""

    location: str
    path: Path | None
    ident: CheckpointId | None
    note: str = ""


class Source(Protocol):
    """A place checkpoints appear. `scan` is the truth; `watch` may only wake a scan early.

    Every method may block on I/O (a network filesystem, S3): the daemon calls them only from
    the source's own thread, never from its loop, and hands each source only its own locations.
    """

    name: str
    poll_seconds: float
    fingerprint_mode: Mode  # how checkpoints' content fingerprints are taken
    recheck_per_scan: int | None  # evaluated checkpoints re-examined per scan (None: all)
    adapter_base: Path | None  # the base model its LoRA/PEFT adapters merge into (adapter.py)
    convert: list[str] | None  # its trainer's converter (formats/command.py)

    def owns(self, location: str) -> bool:
        """True if `location` is one of this source's (under its root or prefix)."""
        ...

    def scan(self) -> list[Found]:
        """List every checkpoint candidate now (raises OSError subclasses on failure)."""
        ...

    def view(self, location: str) -> CheckpointFiles:
        """A read-only view of one checkpoint's files, for the completeness rules."""
        ...

    def exists(self, location: str) -> bool:
        """Is the checkpoint still there?"""
        ...

    def prepare(self, location: str) -> list[str]:
        """Make a ready checkpoint loadable before it is queued (the naming fix, where the
        files are ours to link); returns what was done. Raises NamingFixError."""
        ...

    def stage_spec(self, location: str) -> Stage | None:
        """What a worker needs to stage a remote checkpoint locally (None: already local)."""
        ...

    def hold(self, location: str) -> None:
        """`location` is due: hold what its eval reads, so that a later delete at the source
        costs nothing (S3: stage it now; a local folder is pinned by the daemon, pins.py)."""
        ...

    def held(self, location: str, write_mark: str | None = None) -> bool:
        """Is a complete copy of what the eval reads held (`hold` finished)? With
        `write_mark`: a copy of exactly the files judged with that mark."""
        ...

    def release(self, location: str) -> None:
        """A job on `location` ended: drop what was staged for it (unless kept)."""
        ...

    def make_room(self, needed: list[str]) -> None:
        """Before new jobs start: keep local caches within bounds, sparing `needed` locations."""
        ...

    def watch(self, wake: Callable[[], None]) -> bool:
        """Start change notifications calling `wake`; False if unavailable (polling only)."""
        ...

    def close(self) -> None: ...


def diff(old: Mapping[str, Found], new: Mapping[str, Found]) -> tuple[list[Found], list[Found]]:
    """(added, removed) between two snapshots keyed by location."""
    added = [f for loc, f in new.items() if loc not in old]
    removed = [f for loc, f in old.items() if loc not in new]
    return added, removed
