"""Pins: a due checkpoint's files held until its results are in, so a trainer's keep-last-k
cannot delete what an eval is about to read (or is reading).

When a local checkpoint gets a job, the files an eval reads are hard-linked into
`<its parent>/.ckpt-watcher-pins/<its name>/` (for verl's layout, beside `global_step_N`): the
same filesystem (a hard link is another name for the same data, no byte copied; a symlink would
hold nothing), in a folder scans never enter.
The pinned files must be exactly those the checkpoint was judged ready and fingerprinted with
(the same write mark); a writer that changed them since is caught here, before any eval reads
the pin (`CheckpointChanged`: the checkpoint is judged again).
The job's worker reads the pinned copy, so a trainer that deletes the checkpoint meanwhile
changes nothing: its data lives on until the pin is released, which happens once the
checkpoint has no job queued or running (its results are in the ledger, or it ended otherwise).
Pins are recorded in the state, so a daemon that restarts keeps those of jobs it still has and
releases the others. `policy.pin_max_gb` bounds the disk pins hold: the bytes of files that
only pins still name (the trainer deleted its own names; a file the trainer still keeps costs
nothing more for being pinned), each file counted once however many names it has. Beyond it,
the oldest pins of checkpoints whose job has not started are released, and those checkpoints
skipped (`skipped` ledger lines, reason `pin budget`: jobs/dispatch.py). A filesystem that
refuses hard links is said once, and its checkpoints are not pinned.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import structlog

from ckpt_watcher.checkpoints.files import LocalFiles, check_unchanged, needed_files
from ckpt_watcher.checkpoints.naming import checkpoint_folder
from ckpt_watcher.errors import CheckpointChanged
from ckpt_watcher.state import State

log = structlog.get_logger("ckpt_watcher.pins")

PIN_FOLDER = ".ckpt-watcher-pins"
# what a filesystem that cannot hold a pin answers os.link with
_REFUSALS = (
    errno.EXDEV,
    errno.EPERM,
    errno.ENOTSUP,
    errno.EOPNOTSUPP,
    errno.EMLINK,
    errno.EACCES,
    errno.EROFS,  # a read-only mount of the trainer's folder
    errno.ENOSYS,  # a filesystem (FUSE) that implements no link()
)


@dataclass(frozen=True)
class Pin:
    location: str  # the checkpoint as the source names it
    path: str  # its pinned copy
    bytes: int  # of the files pinned (what it would hold alone once the trainer deleted them)
    at: float
    fingerprint: str | None = None  # the content pinned (a rewrite in place is pinned again)


def pin_path(location: str) -> Path:
    """Beside the folder the checkpoint is named by: for verl's layout that is `global_step_N`,
    not the model folder inside the `actor/` that verl's keep-last-k deletes."""
    folder = Path(checkpoint_folder(location))
    return folder.parent / PIN_FOLDER / folder.name


class Pins:
    """The daemon's pins (state meta `pins`: location -> Pin)."""

    def __init__(self, state: State, max_bytes: int | None, enabled: bool = True) -> None:
        self.state = state
        self.max_bytes = max_bytes
        self.enabled = enabled
        self.refused: dict[int, str] = {}  # st_dev -> why that filesystem takes no pins

    def all(self) -> dict[str, Pin]:
        return {k: Pin(**v) for k, v in (self.state.get_meta("pins") or {}).items()}

    def _save(self, pins: dict[str, Pin]) -> None:
        self.state.set_meta(pins={k: vars(p) for k, p in pins.items()})

    def path(self, location: str) -> str | None:
        """The pinned copy an eval of `location` reads (None: not pinned)."""
        pin = self.all().get(location)
        return pin.path if pin is not None and Path(pin.path).is_dir() else None

    def held_bytes(self) -> int:
        """The disk only pins hold (see `held_alone`)."""
        return sum(held_alone(self.all()).values())

    def pin(
        self, location: str, fingerprint: str | None, now: float, write_mark: str | None = None
    ) -> Pin | None:
        """Hard-link what an eval of the (local, complete) checkpoint reads into its pin
        folder; None where it cannot be pinned (said once per filesystem). With `write_mark`
        (the mark it was judged with), raises CheckpointChanged, holding nothing, when the
        pinned files are not those."""
        if not self.enabled or location.startswith("s3://"):
            return None
        pins = self.all()
        if location in pins:
            if pins[location].fingerprint == fingerprint:
                return pins[location]
            self.release(location, "the checkpoint was rewritten")
            pins = self.all()
        folder = Path(location)
        try:
            dev = folder.stat().st_dev
            if dev in self.refused:
                return None
            files = LocalFiles(folder).files  # a native format's config folder too
        except OSError as e:
            log.warning("pin.unavailable", location=location, error=str(e))
            return None
        names = needed_files(files)
        dest = pin_path(location)
        pin = Pin(location, str(dest), sum(files[n] for n in names), now, fingerprint)
        pins[location] = pin
        self._save(pins)  # first: a crash while linking leaves a pin that a sweep releases
        partial = _partial(dest)
        try:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            for name in names:
                (partial / name).parent.mkdir(parents=True, exist_ok=True)
                os.link(folder / name, partial / name)
            check_unchanged(LocalFiles(partial), write_mark, location)
            shutil.rmtree(dest, ignore_errors=True)  # one an earlier daemon left half-released
            partial.rename(dest)
        except CheckpointChanged:
            self.release(location, "the checkpoint changed after it was judged ready")
            raise
        except OSError as e:
            self.release(location, "could not be pinned")
            if e.errno in _REFUSALS:
                self.refused[dev] = e.strerror or str(e)
                log.warning(
                    "pin.refused",
                    location=location,
                    error=self.refused[dev],
                    hint="this filesystem takes no hard links here: its checkpoints are not "
                    "pinned, and one a trainer deletes before its evaluation is missed",
                )
            else:
                log.warning("pin.failed", location=location, error=str(e))
            return None
        log.info("pin.held", location=location, path=str(dest), bytes=pin.bytes)
        return pin

    def keep_within_budget(self, started: set[str]) -> list[str]:
        """Release the oldest pins of checkpoints not in `started` until the pins hold at most
        `max_bytes`; returns their locations."""
        if self.max_bytes is None:
            return []
        pins = self.all()
        alone = held_alone(pins)
        total = sum(alone.values())
        released = []
        for pin in sorted(pins.values(), key=lambda p: p.at):
            if total <= self.max_bytes:
                break
            if pin.location in started or not alone[pin.location]:
                continue  # started, or costing nothing: releasing it frees no byte
            total -= alone[pin.location]
            self.release(pin.location, "policy.pin_max_gb reached")
            released.append(pin.location)
        return released

    def release(self, location: str, why: str) -> None:
        pins = self.all()
        pin = pins.pop(location, None)
        if pin is None:
            return
        shutil.rmtree(pin.path, ignore_errors=True)
        shutil.rmtree(_partial(Path(pin.path)), ignore_errors=True)
        try:
            Path(pin.path).parent.rmdir()  # the pin folder, once empty
        except OSError:
            pass
        self._save(pins)
        log.info("pin.released", location=location, why=why)

    def sweep(self, active: set[str]) -> None:
        """Release every pin whose checkpoint has no job queued or running (its results are
        in, or it ended otherwise; at start: pins an earlier daemon left)."""
        for location in list(self.all()):
            if location not in active:
                self.release(location, "no job left")


def held_alone(pins: dict[str, Pin]) -> dict[str, int]:
    """Per pin, the bytes of files only pins name any more (every link of the file is in a pin
    folder: the trainer deleted its own), each file counted once, for the oldest pin naming it."""
    seen: dict[tuple[int, int], list[int]] = {}  # (dev, inode) -> [links in pins, nlink, size]
    first: dict[tuple[int, int], str] = {}
    for pin in sorted(pins.values(), key=lambda p: p.at):
        try:
            entries = list(os.scandir(pin.path))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            seen.setdefault(key, [0, st.st_nlink, st.st_size])[0] += 1
            first.setdefault(key, pin.location)
    out = dict.fromkeys(pins, 0)
    for key, (links, nlink, size) in seen.items():
        if links >= nlink:
            out[first[key]] += size
    return out


def _partial(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.partial")
