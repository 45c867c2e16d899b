"""The journal: each finished unit of a task's work (one response of a generation task, one
request of a likelihood task), appended durably as it finishes, so that an evaluation cut short
at any point (a worker crash, a time-out, a daemon killed, a machine preempted) resumes where it
stopped instead of starting over.

One journal per result identity (the checkpoint's content fingerprint and the task entry's
settings hash, which covers the backend, model arguments, clamp, seed, generation settings,
samples and chat template), in a folder of its own under `<state_dir>/journals/`. The daemon
names the folder in the job's spec (`TaskRun.journal`) and removes it once the task's `ok` line
is in the ledger; a worker reads it before it asks its engine for anything and appends to it
as results come back.

Each writer (one worker attempt) appends to a file of its own, so two workers never write one
file; a reader merges them all. Every file starts with a header that names the identity; a file
whose header does not match is never replayed (a checkpoint rewritten with other weights has
another fingerprint, so another folder, and starts fresh). Each record is one line,
`{"k": KEY, "v": VALUE}`, where KEY is a digest of what was asked (the task, the document, the
sample's index, the request's own arguments: prompt and generation settings). A torn last line
(a kill in the middle of a write) is skipped, never fatal.

Several workers may evaluate one task together (one task spread over idle devices): they pull
its chunks from one queue, `claims/` in the journal's folder (`ChunkQueue`). A worker claims a
chunk by creating its claim file (O_EXCL: one winner), journals the chunk's units, then marks it
done. A claim whose holder died (its pid gone, or another start time) is taken over, so a killed
worker gives its chunk back; a done mark names the device that computed it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from time import time_ns
from typing import Any

import structlog

from ckpt_watcher.durable import fsync_dir
from ckpt_watcher.proctable import process_alive, process_start_token

log = structlog.get_logger("ckpt_watcher.journal")

JOURNAL_FORMAT = 1
_SUFFIX = ".jsonl"
CLAIMS_FOLDER = "claims"


def journals_root(state_dir: Path) -> Path:
    return state_dir / "journals"


def identity(fingerprint: str, settings_hash: str, task: str, num_fewshot: int | None) -> dict:
    """What a journal's records are valid for."""
    return {
        "fingerprint": fingerprint,
        "settings": settings_hash,
        "task": task,
        "num_fewshot": num_fewshot,
    }


def folder_for(state_dir: Path, ident: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    return journals_root(state_dir) / digest


def unit_key(task: str | None, doc_id: Any, sample: Any, arguments: Any) -> str:
    """A unit of work, by what was asked of the engine."""
    blob = json.dumps([task, doc_id, sample, arguments], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class JournalRef:
    """Where a task's journal is and what it is valid for (in the job's spec)."""

    folder: str
    identity: dict[str, Any] = field(default_factory=dict)


@dataclass
class Replay:
    """What a journal holds: each unit's value by key, and what was passed over."""

    values: dict[str, Any] = field(default_factory=dict)
    torn: int = 0  # lines that were cut short or unreadable
    foreign: list[str] = field(default_factory=list)  # files of another identity


def read(ref: JournalRef) -> Replay:
    """Every record of every file in the journal whose header matches the identity."""
    out = Replay()
    folder = Path(ref.folder)
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob(f"*{_SUFFIX}")):
        try:
            raw = path.read_bytes()
        except OSError as e:
            log.warning("journal.unreadable", path=str(path), error=str(e))
            continue
        lines = raw.split(b"\n")
        try:
            header = json.loads(lines[0])
        except ValueError:
            out.torn += 1  # killed before its header was whole: nothing after it
            continue
        if header.get("identity") != ref.identity:
            out.foreign.append(path.name)
            continue
        for line in lines[1:]:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                out.values[str(record["k"])] = record["v"]
            except (ValueError, KeyError, TypeError):
                out.torn += 1
    if out.torn or out.foreign:
        log.warning("journal.passed_over", folder=ref.folder, torn=out.torn, foreign=out.foreign)
    return out


class Writer:
    """Appends records to one writer's file of a journal: each `append` is written, flushed and
    fsynced before it returns (at most the call in progress is lost to a kill). An append with
    `sync=False` is flushed only (a killed process loses nothing of it; a machine that goes down
    loses what came after the last `sync`)."""

    def __init__(self, ref: JournalRef, name: str) -> None:
        folder = Path(ref.folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{name}{_SUFFIX}"
        size = self.path.stat().st_size if self.path.exists() else 0
        self._file = open(self.path, "ab")  # noqa: SIM115 - kept open for the task's appends
        if size == 0:
            header = {"journal": JOURNAL_FORMAT, "identity": ref.identity}
            self._write([json.dumps(header, sort_keys=True)])
            fsync_dir(folder)
        elif not _ends_with_newline(self.path):
            self._file.write(b"\n")  # a torn line stays on its own line, skipped on read

    def append(self, records: Iterable[tuple[str, Any]], sync: bool = True) -> int:
        lines = [json.dumps({"k": k, "v": v}, ensure_ascii=False) for k, v in records]
        if lines:
            self._write(lines, sync)
        return len(lines)

    def sync(self) -> None:
        os.fsync(self._file.fileno())

    def _write(self, lines: list[str], sync: bool = True) -> None:
        self._file.write(("\n".join(lines) + "\n").encode("utf-8"))
        self._file.flush()
        if sync:
            self.sync()

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class Holder:
    """A worker process that claims chunks: it is alive while its pid has its start time."""

    host: str
    pid: int
    start: str
    device: str

    @classmethod
    def me(cls, device: str) -> Holder:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, process_start_token(pid) or "", device)

    def alive(self) -> bool:
        """Seen from this host: a holder on another host is taken for gone (spreading is only
        over one host's devices, whose workers share the journal's folder)."""
        return (
            self.host == socket.gethostname()
            and process_alive(self.pid)
            and process_start_token(self.pid) == self.start
        )


class ChunkQueue:
    """A task's chunks, for the workers that evaluate it together (see the module's doc).

    `claim` is true for one live worker at a time (two that take over one dead holder's chunk
    at the same moment may both compute it: the same values, journaled twice); `done` is
    written after the chunk's records are in the journal (a worker killed in between loses that
    one chunk, which is computed again)."""

    def __init__(self, ref: JournalRef, me: Holder) -> None:
        self.folder = Path(ref.folder) / CLAIMS_FOLDER
        self.me = me

    def _claim_path(self, chunk: str) -> Path:
        return self.folder / f"{chunk}.claim"

    def _done_path(self, chunk: str) -> Path:
        return self.folder / f"{chunk}.done"

    def claim(self, chunk: str) -> bool:
        """Take `chunk` for this worker: True if it is ours now (free, or its holder died)."""
        if self.is_done(chunk):
            return False
        try:
            self.folder.mkdir(exist_ok=True)
        except FileNotFoundError:  # the journal is gone: its result is in the ledger
            return False
        path = self._claim_path(chunk)
        mine = self.folder / f".{chunk}.{self.me.pid}.{time_ns()}"
        try:
            mine.write_text(json.dumps(dataclasses.asdict(self.me)), encoding="utf-8")
        except FileNotFoundError:  # removed just now
            return False
        try:
            for _ in range(2):  # a dead holder's claim is moved aside once, then tried again
                try:  # a hard link appears whole or not at all, and never over another claim
                    os.link(mine, path)
                except FileExistsError:
                    holder = self.holder(chunk)
                    if holder == self.me:  # a task this worker runs again (a warm engine's retry)
                        return True
                    if holder is not None and holder.alive():
                        return False
                    try:  # one of several takers moves it aside; the others find it gone
                        os.rename(path, path.with_suffix(f".stale-{self.me.pid}-{time_ns()}"))
                    except FileNotFoundError:
                        pass
                    continue
                if self.is_done(chunk):  # done (mark, then claim removed) since the first look
                    path.unlink(missing_ok=True)
                    return False
                return True
            return False
        finally:
            mine.unlink(missing_ok=True)

    def holder(self, chunk: str) -> Holder | None:
        """Who holds `chunk`'s claim (None: nobody, or an unreadable claim, taken for dead)."""
        try:
            return Holder(**json.loads(self._claim_path(chunk).read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None

    def done(self, chunk: str, units: int) -> None:
        """The chunk's records are in the journal."""
        mark = self.folder / f".{chunk}.done.{self.me.pid}.{time_ns()}"
        try:
            mark.write_text(
                json.dumps(
                    {"device": self.me.device, "units": units, "by": dataclasses.asdict(self.me)}
                ),
                "utf-8",
            )
            os.replace(mark, self._done_path(chunk))
            self._claim_path(chunk).unlink(missing_ok=True)
        except FileNotFoundError:  # the journal is gone: its result is in the ledger
            pass

    def release(self, chunk: str) -> None:
        """Give a claimed chunk back undone (its computation failed)."""
        if self.holder(chunk) == self.me:
            self._claim_path(chunk).unlink(missing_ok=True)

    def undo(self, chunk: str) -> None:
        """Forget a done mark whose records the journal does not have (a torn write)."""
        self._done_path(chunk).unlink(missing_ok=True)

    def is_done(self, chunk: str) -> bool:
        return self._done_path(chunk).exists()

    def done_alongside(self, chunk: str) -> bool:
        """`chunk` was computed by another worker that is still alive: a helper of this attempt,
        not an attempt that was interrupted."""
        try:
            by = json.loads(self._done_path(chunk).read_text(encoding="utf-8"))["by"]
            holder = Holder(**by)
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return holder != self.me and holder.alive()

    def busy_elsewhere(self, chunk: str) -> bool:
        """Another live worker holds `chunk`."""
        holder = self.holder(chunk)
        return holder is not None and holder != self.me and holder.alive()

    def devices(self) -> list[str]:
        """The devices that computed this task's chunks (every done mark of the journal)."""
        found = set()
        for path in self.folder.glob("*.done"):
            try:
                found.add(str(json.loads(path.read_text(encoding="utf-8"))["device"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return sorted(found)


def remove(folder: Path) -> None:
    """The result is in the ledger: its journal is no longer needed."""
    shutil.rmtree(folder, ignore_errors=True)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
