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
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher.durable import fsync_dir

log = structlog.get_logger("ckpt_watcher.journal")

JOURNAL_FORMAT = 1
_SUFFIX = ".jsonl"


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
    fsynced before it returns (at most the call in progress is lost to a kill)."""

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

    def append(self, records: Iterable[tuple[str, Any]]) -> int:
        lines = [json.dumps({"k": k, "v": v}, ensure_ascii=False) for k, v in records]
        if lines:
            self._write(lines)
        return len(lines)

    def _write(self, lines: list[str]) -> None:
        self._file.write(("\n".join(lines) + "\n").encode("utf-8"))
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def remove(folder: Path) -> None:
    """The result is in the ledger: its journal is no longer needed."""
    shutil.rmtree(folder, ignore_errors=True)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
