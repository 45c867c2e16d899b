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
chunk by hard-linking its own holder file to the chunk's claim name (a link never replaces an
existing name: one winner, and a claim is whole from the moment it exists), journals the
chunk's units, then marks it done. A claim whose holder died (its pid gone, or another start
time) is taken over, so a killed worker gives its chunk back; a done mark names the device that
computed it. A holder is named by its node (`node_identity`: this kernel's boot id and pid
namespace, what makes a pid mean one process; a host name does not: containers on the host
network share one). A holder on another node (Ray nodes sharing `executor.shared_dir`) cannot be
looked up by pid: it is alive while its claim and done files are touched, which a thread of each
worker does every quarter of `LEASE_SECONDS` (`_Lease`, which gives a file up only once it is
gone), and "while" is measured on the shared filesystem's own clock (the server's, on NFS): the
time of a file this worker touches now against the time of the holder's last touch, so no
host's clock is compared with another's.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from time import time_ns
from typing import Any

import structlog

from ckpt_watcher.durable import fsync_dir
from ckpt_watcher.proctable import process_alive, process_start_token

log = structlog.get_logger("ckpt_watcher.journal")

JOURNAL_FORMAT = 1
_RECORD = json.JSONEncoder(ensure_ascii=False)  # one encoder for every record (a chunk has many)
_SUFFIX = ".jsonl"
CLAIMS_FOLDER = "claims"
# a holder on another host whose claim or done file was not touched for this long is gone
LEASE_SECONDS = 60.0


def journals_root(home: Path) -> Path:
    """Where the journals are: under `home` (the state folder, or `journal_home`'s)."""
    return home / "journals"


def journal_home(state_dir: Path, shared_dir: Path | None) -> Path:
    """The folder whose `journals/` holds this daemon's journals: `state_dir`, or with a shared
    folder (executor.shared_dir, seen by every node) a folder of its own there, named after
    this host and state folder, so two daemons sharing it never sweep each other's."""
    if shared_dir is None:
        return state_dir
    owner = f"{socket.gethostname()}:{state_dir.resolve()}"
    return shared_dir / f"ckpt-watcher-{hashlib.sha256(owner.encode()).hexdigest()[:12]}"


def identity(fingerprint: str, settings_hash: str, task: str, num_fewshot: int | None) -> dict:
    """What a journal's records are valid for."""
    return {
        "fingerprint": fingerprint,
        "settings": settings_hash,
        "task": task,
        "num_fewshot": num_fewshot,
    }


def folder_for(home: Path, ident: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    return journals_root(home) / digest


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
        lines = [_RECORD.encode({"k": k, "v": v}) for k, v in records]
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


def _hostname() -> str:
    return socket.gethostname()


@functools.cache
def node_identity() -> str:
    """Where a pid names one process: this kernel (its boot id) and this pid namespace. Two
    containers on one host (KubeRay `hostNetwork` pods) share a host name, never both."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="utf-8").strip()
    except OSError:  # not Linux: the host name, the best there is
        boot = socket.gethostname()
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{boot}/{namespace}"


@dataclass(frozen=True)
class Holder:
    """A worker process that claims chunks: it is alive while its pid has its start time."""

    host: str  # its host name, for people reading a claim
    pid: int
    start: str
    device: str
    node: str = ""  # node_identity() where it runs ("": a claim of an older version)

    @classmethod
    def me(cls, device: str) -> Holder:
        pid = os.getpid()
        return cls(
            socket.gethostname(), pid, process_start_token(pid) or "", device, node_identity()
        )

    def alive(
        self, touched: str | Path | None = None, clock: Callable[[], float] = time.time
    ) -> bool:
        """Seen from this node: a holder here while its pid has its start time; a holder on
        another node while `touched` (its claim or done file, which its lease keeps touching)
        was touched within LEASE_SECONDS of `clock()` (the filesystem's time now)."""
        here = self.node == node_identity() or (not self.node and self.host == _hostname())
        if here:  # (a claim of an older version names its host only)
            return process_alive(self.pid) and process_start_token(self.pid) == self.start
        try:  # a touch in the future by more than a lease: the server's clock stepped back
            return touched is not None and abs(clock() - os.stat(touched).st_mtime) < LEASE_SECONDS
        except OSError:  # gone: its chunk is done, or taken over
            return False


class _Lease:
    """This process's claim and done files, touched every quarter of LEASE_SECONDS while it
    lives, by one thread: what a holder on another host is seen alive by."""

    def __init__(self) -> None:
        self._forked()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:  # (and a forked worker: its own files, its own thread)
        self.files: set[str] = set()
        self.lock = threading.Lock()
        self.added = threading.Event()
        self.thread: threading.Thread | None = None

    def add(self, path: str) -> None:
        with self.lock:
            self.files.add(path)
            self.added.set()  # a new holder: its first touches at the current interval
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="journal-lease", daemon=True)
                self.thread.start()

    def drop(self, path: str) -> None:
        with self.lock:
            self.files.discard(path)

    def _run(self) -> None:
        while True:
            self.added.wait(LEASE_SECONDS / 4)
            self.added.clear()
            with self.lock:
                files = list(self.files)
            for path in files:
                try:
                    os.utime(path)
                except FileNotFoundError:  # the journal is gone (its result is in the ledger)
                    self.drop(path)
                except OSError as e:  # EIO, ESTALE, an EFS time-out: touched at the next turn
                    log.warning("journal.lease_touch_failed", path=path, error=str(e))


_lease = _Lease()


class ChunkQueue:
    """A task's chunks, for the workers that evaluate it together (see the module's doc).

    `claim` is true for one live worker at a time (two that take over one dead holder's chunk
    at the same moment may both compute it: the same values, journaled twice); `done` is
    written after the chunk's records are in the journal (a worker killed in between loses that
    one chunk, which is computed again).

    Each worker writes two small files once per task, its claim (who holds) and its done mark
    (who computed, on which device), and every claim or done mark it makes is a hard link to
    one of them: a chunk costs links and renames, never a file written, so the bookkeeping of
    a task of 100,000 chunks stays a small part of it (bench/journal_bookkeeping.py)."""

    def __init__(self, ref: JournalRef, me: Holder) -> None:
        self.folder = Path(ref.folder) / CLAIMS_FOLDER
        self.me = me
        self._token = f"{me.pid}.{time_ns()}"
        self._dir = str(self.folder)  # paths as strings: a chunk's bookkeeping is a few syscalls
        self._own_files: dict[str, str] = {}
        self._written = 0
        self._clock_file = f"{self._dir}/.clock.{self._token}"
        self._clock: tuple[float, float] | None = None  # (filesystem time, monotonic) then

    def now(self) -> float:
        """The queue's filesystem's time now (its server's, on NFS: the clock that stamps the
        leases' touches), read by touching a file of this worker's there at most once a second;
        this host's clock where the folder is gone."""
        mono = time.monotonic()
        if self._clock is None or mono - self._clock[1] > 1.0:
            try:
                with open(self._clock_file, "a"):
                    pass
                os.utime(self._clock_file)
                self._clock = (os.stat(self._clock_file).st_mtime, mono)
            except OSError:
                return time.time()
        return self._clock[0] + (mono - self._clock[1])

    def _claim_path(self, chunk: str) -> Path:
        return Path(self._claim_name(chunk))

    def _claim_name(self, chunk: str) -> str:
        return f"{self._dir}/{chunk}.claim"

    def _done_path(self, chunk: str) -> Path:
        return Path(f"{self._dir}/{chunk}.done")

    def _own(self, kind: str, full: bool = False) -> str:
        """This worker's claim or done file, written once, or again when the one it has has
        as many links as its filesystem allows (`full`: ext4 65,000, btrfs a few hundred in
        one folder). FileNotFoundError: the journal is gone."""
        path = self._own_files.get(kind)
        if path is None or full or not os.path.exists(path):
            self._written += 1
            path = f"{self._dir}/.{kind}.{self._token}.{self._written}"
            me = dataclasses.asdict(self.me)
            content = me if kind == "claim" else {"device": self.me.device, "by": me}
            self.folder.mkdir(exist_ok=True)  # FileNotFoundError when the journal is gone
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(json.dumps(content))
            os.replace(path + ".tmp", path)
            self._own_files[kind] = path
            _lease.add(path)
        return path

    def claim(self, chunk: str) -> bool:
        """Take `chunk` for this worker: True if it is ours now (free, or its holder died)."""
        try:
            mine = self._own("claim")
        except FileNotFoundError:  # the journal is gone: its result is in the ledger
            return False
        path = self._claim_name(chunk)
        for _ in range(3):  # a dead holder's claim is moved aside once, then tried again
            try:  # a hard link appears whole or not at all, and never over another claim
                os.link(mine, path)
            except FileNotFoundError:  # the journal was removed just now
                return False
            except FileExistsError:
                holder = self.holder(chunk)
                if holder == self.me:  # a task this worker runs again (a warm engine's retry)
                    return True
                if holder is not None and holder.alive(path, self.now):
                    return False
                self._move_aside_if_dead(Path(path))
                continue
            except OSError as e:
                if e.errno != errno.EMLINK:
                    raise
                mine = self._own("claim", full=True)
                continue
            if self.is_done(chunk):  # done (mark, then claim removed) since the first look
                os.unlink(path)
                return False
            return True
        return False

    def _move_aside_if_dead(self, path: Path) -> None:
        """Move a dead holder's claim out of the way. Another taker may have replaced it with a
        live claim since it was read: what was moved is read again, and a live claim moved by
        mistake is put back (unless a third worker claimed meanwhile; then two compute the
        chunk: the same values, journaled twice)."""
        aside = path.with_suffix(f".stale-{self.me.pid}-{time_ns()}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:  # another taker moved it first
            return
        try:
            moved = Holder(**json.loads(aside.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return
        if moved != self.me and moved.alive(aside, self.now):
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)

    def holder(self, chunk: str) -> Holder | None:
        """Who holds `chunk`'s claim (None: nobody, or an unreadable claim, taken for dead)."""
        try:
            return Holder(**json.loads(self._claim_path(chunk).read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None

    def done(self, chunk: str) -> None:
        """The chunk's records are in the journal."""
        mark = f"{self._dir}/{chunk}.done"
        try:
            try:
                os.link(self._own("done"), mark)
            except OSError as e:
                if e.errno != errno.EMLINK:
                    raise
                os.link(self._own("done", full=True), mark)
        except FileExistsError:  # another worker computed it too (a takeover race): done
            pass
        except FileNotFoundError:  # the journal is gone: its result is in the ledger
            return
        try:
            os.unlink(self._claim_name(chunk))
        except FileNotFoundError:  # moved aside by a worker that took this one for dead
            pass

    def release(self, chunk: str) -> None:
        """Give a claimed chunk back undone (its computation failed)."""
        if self.holder(chunk) == self.me:
            self._claim_path(chunk).unlink(missing_ok=True)

    def undo(self, chunk: str) -> None:
        """Forget a done mark whose records the journal does not have (a torn write)."""
        self._done_path(chunk).unlink(missing_ok=True)

    def is_done(self, chunk: str) -> bool:
        return os.path.exists(f"{self._dir}/{chunk}.done")

    def done_names(self) -> set[str]:
        """Every chunk marked done, from one listing of the queue."""
        return set(self.done_by())

    def done_by(self) -> dict[str, dict[str, Any]]:
        """Every chunk marked done, and its mark ({device, by}), from one listing; each mark
        file read once however many chunks link to it."""
        out: dict[str, dict[str, Any]] = {}
        read: dict[int, dict[str, Any]] = {}
        try:
            entries = [e for e in os.scandir(self.folder) if e.name.endswith(".done")]
        except FileNotFoundError:
            return out
        for entry in entries:
            try:
                inode = entry.inode()
                if inode not in read:
                    read[inode] = json.loads(Path(entry.path).read_text(encoding="utf-8"))
                out[entry.name[: -len(".done")]] = read[inode]
            except (OSError, ValueError):
                continue
        return out

    def done_alongside(self) -> set[str]:
        """Chunks computed by another worker that is still alive: a helper of this attempt, not
        an attempt that was interrupted (each worker looked up once)."""
        alive: dict[str, bool] = {}
        out = set()
        for chunk, mark in self.done_by().items():
            by = mark.get("by")
            key = json.dumps(by, sort_keys=True)
            if key not in alive:
                try:
                    holder = Holder(**by)  # type: ignore[arg-type]
                except TypeError:
                    alive[key] = False
                else:
                    alive[key] = holder != self.me and holder.alive(
                        self._done_path(chunk), self.now
                    )
            if alive[key]:
                out.add(chunk)
        return out

    def busy_elsewhere(self, chunk: str) -> bool:
        """Another live worker holds `chunk`."""
        holder = self.holder(chunk)
        return (
            holder is not None
            and holder != self.me
            and holder.alive(self._claim_path(chunk), self.now)
        )

    def devices(self) -> list[str]:
        """The devices that computed this task's chunks (every done mark of the journal)."""
        return sorted({str(m.get("device")) for m in self.done_by().values() if "device" in m})


def remove(folder: Path) -> None:
    """The result is in the ledger: its journal is no longer needed."""
    shutil.rmtree(folder, ignore_errors=True)


def sizes(home: Path) -> dict[str, int]:
    """Every journal folder under `home` and the bytes its files hold."""
    out: dict[str, int] = {}
    root = journals_root(home)
    try:
        folders = [e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return out
    for folder in folders:
        total = 0
        for dirpath, _, files in os.walk(folder):
            for name in files:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except OSError:
                    continue  # removed while we looked
        out[folder] = total
    return out


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
