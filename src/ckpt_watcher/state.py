"""The daemon's durable state: SQLite in WAL mode under `state_dir` (local disk, never NFS).

Tables: `checkpoints` (every checkpoint seen and where it is in its life cycle), `jobs` (one
eval of one checkpoint's due tasks: queued/running/ok/failed/skipped, attempts, worker pid),
`sources` (last scan and error), `meta` (heartbeat, daemon pid). The ledger, not this
database, is the record of results: on start, ledger `ok` lines win over job states.
`watcher status` opens the same file read-only.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_watcher.errors import DaemonAlreadyRunning, StateError

DB_NAME = "state.sqlite"
LOCK_NAME = "daemon.lock"
# The daemon writes its heartbeat into `meta` this often; `watcher status` calls it stale after
# ten missed beats.
HEARTBEAT_SECONDS = 2.0

CHECKPOINT_STATES = (
    "incomplete",  # being written: waiting (reason says why)
    "invalid",  # will not become evaluable by itself (reason says why)
    "unrecognised",  # a folder with model files whose name follows no known pattern
    "ready",  # complete; jobs not planned yet
    "planned",  # a job is queued or running
    "done",  # every task has an ok ledger line
    "failed",  # some task ran out of attempts
    "skipped",  # by policy (every_n_steps, superseded)
    "missed",  # deleted before it was evaluated
)
JOB_STATES = ("queued", "running", "ok", "failed", "skipped")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS sources (
    name TEXT PRIMARY KEY, last_scan_at REAL, last_ok_at REAL, last_error TEXT,
    n_checkpoints INTEGER DEFAULT 0);
CREATE TABLE IF NOT EXISTS checkpoints (
    location TEXT PRIMARY KEY, source TEXT NOT NULL, run TEXT, step INTEGER, label TEXT,
    final INTEGER DEFAULT 0, state TEXT NOT NULL, reason TEXT DEFAULT '',
    fingerprint TEXT, unchanged_since REAL, first_seen REAL, updated_at REAL, ready_at REAL);
CREATE INDEX IF NOT EXISTS checkpoints_state ON checkpoints(state);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, location TEXT NOT NULL, run TEXT NOT NULL, step INTEGER,
    label TEXT NOT NULL, tasks TEXT NOT NULL, settings_hash TEXT NOT NULL, state TEXT NOT NULL,
    attempt INTEGER DEFAULT 0, not_before REAL DEFAULT 0, device TEXT, device_label TEXT,
    pid INTEGER,
    pid_start TEXT, host TEXT, created_at REAL, started_at REAL, finished_at REAL,
    error TEXT, order_key REAL DEFAULT 0);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
"""
# Columns added after the first release: (table, column, declaration). A database written by an
# older watcher gets them on open.
_ADDED_COLUMNS = (
    ("jobs", "daemon_deaths", "INTEGER DEFAULT 0"),
    ("sources", "unreachable_since", "REAL"),
    # identity (run path and content fingerprint); before them, `checkpoints.fingerprint` held
    # what is now `write_mark` (names, sizes, mtimes/ETags), and is moved there on upgrade
    ("checkpoints", "write_mark", "TEXT"),
    ("checkpoints", "run_path", "TEXT"),
    ("checkpoints", "previous_fingerprint", "TEXT"),
    ("checkpoints", "rewritten_at", "REAL"),
    ("jobs", "run_path", "TEXT"),
    ("jobs", "fingerprint", "TEXT"),
    ("jobs", "write_mark", "TEXT"),
)
# Run once when a column is added to a database that had none: the upgrade of its rows.
_UPGRADES = {
    (
        "checkpoints",
        "write_mark",
    ): "UPDATE checkpoints SET write_mark = fingerprint, fingerprint = NULL",
}
# Run at every open for writing (cheap when there is nothing to do): rows written before a
# column existed, or by a version that left it empty, get its value.
_FILL = (
    "UPDATE checkpoints SET run_path = run WHERE run_path IS NULL AND run IS NOT NULL",
    "UPDATE jobs SET run_path = run WHERE run_path IS NULL",
)


@dataclass
class Job:
    """One eval of one checkpoint version's due tasks (a row of `jobs`)."""

    id: str
    location: str
    run: str
    step: int | None
    label: str
    tasks: list[dict[str, Any]]
    settings_hash: str
    created_at: float
    order_key: float
    run_path: str = ""  # the run's path under its source root (the ledger's folder)
    fingerprint: str | None = None  # the checkpoint's content when the job was queued
    write_mark: str | None = None  # the mark of the files that fingerprint was taken from
    state: str = "queued"
    attempt: int = 0  # attempts started (and not given back)
    not_before: float = 0.0  # a retry waits until then
    device: str | None = None
    device_label: str | None = None
    pid: int | None = None
    pid_start: str | None = None
    host: str | None = None  # the node running it (Ray), once known
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    daemon_deaths: int = 0  # times the daemon died while this job ran

    def __post_init__(self) -> None:
        self.run_path = self.run_path or self.run

    def part(self, index: int, tasks: list[dict[str, Any]], created_at: float) -> Job:
        """Part `index` of this job when its checkpoint is split over several devices: the same
        checkpoint and settings, some of its tasks, never run yet."""
        return Job(
            id=f"{self.id}-{index}",
            location=self.location,
            run=self.run,
            step=self.step,
            label=self.label,
            tasks=tasks,
            settings_hash=self.settings_hash,
            created_at=created_at,
            order_key=self.order_key,
            run_path=self.run_path,
            fingerprint=self.fingerprint,
            write_mark=self.write_mark,
        )

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Job:
        have = set(row.keys())  # a database no daemon of this version has opened yet
        values: dict[str, Any] = {
            name: row[name] if name in have else None for name in _JOB_COLUMNS
        }
        values["tasks"] = json.loads(values["tasks"])
        for name in ("not_before", "created_at", "order_key"):
            values[name] = values[name] or 0.0
        values["daemon_deaths"] = values["daemon_deaths"] or 0
        values["attempt"] = values["attempt"] or 0
        values["run_path"] = values["run_path"] or ""
        return cls(**values)

    def as_row(self) -> list[Any]:
        """Values in `_JOB_COLUMNS` order, as stored."""
        values = dataclasses.asdict(self) | {"tasks": json.dumps(self.tasks)}
        return [values[name] for name in _JOB_COLUMNS]


_JOB_COLUMNS = tuple(f.name for f in dataclasses.fields(Job))


@dataclass(frozen=True)
class CheckpointRow:
    """A checkpoint as the daemon knows it (a row of `checkpoints`)."""

    location: str
    source: str
    run: str  # "" when unrecognised (no run, step or label)
    step: int | None
    label: str
    final: bool
    state: str  # one of CHECKPOINT_STATES
    reason: str
    fingerprint: str | None  # content (checkpoints/fingerprint.py), once judged ready
    write_mark: str | None  # names, sizes, mtimes or ETags: moves when files are rewritten
    unchanged_since: float | None
    first_seen: float | None
    updated_at: float | None
    ready_at: float | None
    run_path: str  # the run's path under its source root ("" when unrecognised)
    previous_fingerprint: str | None
    rewritten_at: float | None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> CheckpointRow:
        have = set(row.keys())  # a database no daemon of this version has opened yet
        values: dict[str, Any] = {
            name: row[name] if name in have else None for name in _CHECKPOINT_COLUMNS
        }
        values["final"] = bool(values["final"])
        for name in ("run", "label", "reason"):
            values[name] = values[name] or ""
        values["run_path"] = values["run_path"] or values["run"]
        return cls(**values)


_CHECKPOINT_COLUMNS = tuple(f.name for f in dataclasses.fields(CheckpointRow))


def _where(states: tuple[str, ...], **equal: Any) -> tuple[str, list[Any]]:
    """A WHERE clause: state in `states` (if any) and column = value for each non-None value.
    Column names come from our own keyword arguments, never from input."""
    cond: list[str] = []
    args: list[Any] = []
    if states:
        cond.append(f"state IN ({','.join('?' * len(states))})")
        args.extend(states)
    for column, value in equal.items():
        if value is not None:
            cond.append(f"{column}=?")
            args.append(value)
    return (" WHERE " + " AND ".join(cond) if cond else ""), args


def _connect(path: Path, readonly: bool = False) -> sqlite3.Connection:
    try:
        if readonly:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
        else:
            conn = sqlite3.connect(path, timeout=30, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
    except sqlite3.Error as e:
        raise StateError(f"cannot open state database {path}: {e}") from e
    conn.row_factory = sqlite3.Row
    return conn


class State:
    """Read/write access to the state database (the daemon holds one; tools open their own)."""

    def __init__(self, state_dir: Path, readonly: bool = False) -> None:
        self.dir = state_dir
        self.path = state_dir / DB_NAME
        if readonly:
            if not self.path.exists():
                raise StateError(
                    f"no watcher state at {self.path}: the daemon has not run with this state_dir"
                )
        else:
            try:
                state_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StateError(f"cannot create state_dir {state_dir}: {e.strerror}") from e
        self.conn = _connect(self.path, readonly)
        self._lock_fd: int | None = None
        if readonly:
            self._check_schema()
        else:
            self._create_schema()

    def _create_schema(self) -> None:
        """Tables, added columns and their upgrades in one transaction: a reader (`watcher
        status` while the daemon starts) sees the whole schema or none of it."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self.conn.execute(statement)
            for table, column, decl in _ADDED_COLUMNS:
                have = {r["name"] for r in self.conn.execute(f"PRAGMA table_info({table})")}
                if column not in have:
                    self.conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
                    if (table, column) in _UPGRADES:
                        self.conn.execute(_UPGRADES[(table, column)])
            for statement in _FILL:
                self.conn.execute(statement)
        except BaseException:
            self.conn.execute("ROLLBACK")
            self.conn.close()
            raise
        self.conn.execute("COMMIT")

    def _check_schema(self) -> None:
        try:
            found = self.conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type='table' AND name='jobs'"
            ).fetchone()
        except sqlite3.Error as e:
            self.conn.close()
            raise StateError(f"cannot read state database {self.path}: {e}") from e
        if found is None:
            self.conn.close()
            raise StateError(
                f"the watcher state at {self.path} has no tables yet: a daemon is starting "
                "(or stopped while creating it); run the command again in a moment"
            )

    def close(self) -> None:
        self.conn.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # --- the daemon lock: one live daemon per state_dir --------------------------------------
    def acquire_daemon_lock(self) -> None:
        fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(fd)
            pid = self.get_meta("daemon_pid") or "?"
            raise DaemonAlreadyRunning(
                f"another watcher daemon (pid {pid}) is using state_dir {self.dir}; stop it first "
                "or give this one its own state_dir"
            ) from e
        self._lock_fd = fd

    def daemon_lock_held(self) -> bool:
        """True if some live process holds the daemon lock (works after kill -9: no stale pid)."""
        try:
            fd = os.open(self.dir / LOCK_NAME, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    # --- meta ----------------------------------------------------------------------------------
    def set_meta(self, **values: Any) -> None:
        with self.conn:
            for k, v in values.items():
                self.conn.execute(
                    "INSERT INTO meta(key, value) VALUES(?, ?) "
                    "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                    (k, json.dumps(v)),
                )

    def get_meta(self, key: str) -> Any:
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return json.loads(row["value"]) if row else None

    # --- sources -------------------------------------------------------------------------------
    def record_scan(self, name: str, at: float, error: str | None, n: int | None) -> None:
        """A scan of source `name` ended at `at`: ok (`error` None, `n` checkpoints) or failed.
        A source is unreachable from its first failed scan until one succeeds."""
        with self.conn:
            self.conn.execute(
                "INSERT INTO sources(name, last_scan_at, last_ok_at, last_error, n_checkpoints, "
                "unreachable_since) VALUES(?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
                "last_scan_at=excluded.last_scan_at, last_error=excluded.last_error, "
                "last_ok_at=COALESCE(excluded.last_ok_at, sources.last_ok_at), "
                "n_checkpoints=COALESCE(excluded.n_checkpoints, sources.n_checkpoints), "
                "unreachable_since=CASE WHEN excluded.last_error IS NULL THEN NULL "
                "ELSE COALESCE(sources.unreachable_since, excluded.unreachable_since) END",
                (name, at, None if error else at, error, n, at if error else None),
            )

    def mark_unreachable(self, name: str, since: float, error: str) -> None:
        """A scan of `name` has had no answer since `since` (it is still running)."""
        with self.conn:
            self.conn.execute(
                "INSERT INTO sources(name, last_error, unreachable_since) VALUES(?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET last_error=excluded.last_error, "
                "unreachable_since=COALESCE(sources.unreachable_since, excluded.unreachable_since)",
                (name, error, since),
            )

    def sources(self) -> list[sqlite3.Row]:
        return list(self.conn.execute("SELECT * FROM sources ORDER BY name"))

    # --- checkpoints ---------------------------------------------------------------------------
    def checkpoint(self, location: str) -> CheckpointRow | None:
        row = self.conn.execute(
            "SELECT * FROM checkpoints WHERE location=?", (location,)
        ).fetchone()
        return CheckpointRow.from_row(row) if row is not None else None

    def upsert_checkpoint(self, location: str, source: str, now: float, **fields: Any) -> None:
        """Insert a checkpoint row or update the given fields of an existing one."""
        existing = self.checkpoint(location)
        with self.conn:
            if existing is None:
                fields.setdefault("state", "incomplete")
                cols = ["location", "source", "first_seen", "updated_at", *fields]
                vals = [location, source, now, now, *fields.values()]
                marks = ",".join("?" * len(cols))
                self.conn.execute(
                    f"INSERT INTO checkpoints({','.join(cols)}) VALUES({marks})", vals
                )
            elif fields:
                sets = ",".join(f"{k}=?" for k in fields)
                self.conn.execute(
                    f"UPDATE checkpoints SET {sets}, updated_at=? WHERE location=?",
                    [*fields.values(), now, location],
                )

    def delete_checkpoint(self, location: str) -> None:
        """Forget a checkpoint never judged ready (it has no jobs): its model is elsewhere now."""
        with self.conn:
            self.conn.execute(
                "DELETE FROM checkpoints WHERE location=? AND state IN ('incomplete', 'invalid')",
                (location,),
            )

    def checkpoints_in(self, folder: str) -> list[CheckpointRow]:
        """The checkpoints located inside `folder` (verl's step folder: its model folders); a range
        of the primary key, so one index look-up however many checkpoints there are."""
        rows = self.conn.execute(
            "SELECT * FROM checkpoints WHERE location > ? AND location < ?",
            (f"{folder}/", f"{folder}0"),  # '0' is the character after '/'
        )
        return [CheckpointRow.from_row(r) for r in rows]

    def checkpoints(self, *states: str, source: str | None = None) -> list[CheckpointRow]:
        where, args = _where(states, source=source)
        rows = self.conn.execute(f"SELECT * FROM checkpoints{where} ORDER BY run, step", args)
        return [CheckpointRow.from_row(r) for r in rows]

    def checkpoint_counts(self) -> dict[str, int]:
        rows = self.conn.execute("SELECT state, COUNT(*) n FROM checkpoints GROUP BY state")
        return {r["state"]: r["n"] for r in rows}

    # --- jobs ----------------------------------------------------------------------------------
    def add_job(self, job: Job) -> None:
        marks = ",".join("?" * len(_JOB_COLUMNS))
        with self.conn:
            self.conn.execute(
                f"INSERT INTO jobs({','.join(_JOB_COLUMNS)}) VALUES({marks})", job.as_row()
            )

    def delete_job(self, job_id: str) -> None:
        """Forget a job that never started (its checkpoint is to be judged again)."""
        with self.conn:
            self.conn.execute("DELETE FROM jobs WHERE id=? AND state='queued'", (job_id,))

    def job(self, job_id: str) -> Job | None:
        row = self.conn.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        return Job.from_row(row) if row else None

    def jobs(self, *states: str, location: str | None = None) -> list[Job]:
        where, args = _where(states, location=location)
        rows = self.conn.execute(f"SELECT * FROM jobs{where} ORDER BY created_at", args)
        return [Job.from_row(r) for r in rows]

    def update_job(self, job_id: str, **fields: Any) -> None:
        if "tasks" in fields:
            fields["tasks"] = json.dumps(fields["tasks"])
        sets = ",".join(f"{k}=?" for k in fields)
        with self.conn:
            self.conn.execute(f"UPDATE jobs SET {sets} WHERE id=?", [*fields.values(), job_id])

    def job_counts(self) -> dict[str, int]:
        rows = self.conn.execute("SELECT state, COUNT(*) n FROM jobs GROUP BY state")
        return {r["state"]: r["n"] for r in rows}
