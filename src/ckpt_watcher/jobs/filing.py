"""Filing results while the ledger folder cannot be written: nothing is lost, nothing stops.

A full disk, a quota, a read-only remount or an EFS/NFS error on `ledger_dir` makes an append
fail (`LedgerError`). Filing is made to be done again safely: a job's state changes only after
its lines are in, and the ledger drops an `ok` line it already has. So a filing that fails is
kept and tried again every `RETRY_SECONDS` until it goes through (`watcher run`), the worker's
outcome files waiting in the job folder meanwhile, as after a crash. While the folder cannot
be written no job starts (its results could not be kept either): `can_start` looks before each
start, with a probe (`ledger.writable`) when no filing is waiting. `watcher status` says
DEGRADED, with the error and what waits (`summary`, kept in the state by the heartbeat).

`watcher once` does not wait for a disk to be freed: it stops with the error (exit 1), and the
next `once` or `run` files what waits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher.errors import LedgerError
from ckpt_watcher.ledger import writable
from ckpt_watcher.timestamps import iso

log = structlog.get_logger("ckpt_watcher.jobs")

RETRY_SECONDS = 5.0  # how often filings that failed, and the probe after one, are tried again
WAITING_HINT = (
    "free space on it or fix it; the results wait in the state folder's job folders and are "
    "filed as soon as it can be written, and no eval starts until then"
)


@dataclass
class _Trouble:
    since: float
    error: str


class Filing:
    """Filings that failed for want of a writable ledger folder, tried again until they pass."""

    def __init__(self, ledger_dir: Path, keep_trying: bool) -> None:
        """`keep_trying`: False for `watcher once`, which raises instead of waiting."""
        self.ledger_dir = ledger_dir
        self.keep_trying = keep_trying
        self.pending: dict[str, Callable[[float], None]] = {}  # job id -> its filing
        self.trouble: _Trouble | None = None
        self.next_try = 0.0

    def attempt(self, job_id: str, filing: Callable[[float], None], now: float) -> bool:
        """Carry out `filing` (which files a job's lines and moves it on); if the ledger cannot
        be written, keep it for later. True when it went through."""
        try:
            filing(now)
        except LedgerError as e:
            self.pending[job_id] = filing
            self.failed(str(e), now)
            return False
        self.pending.pop(job_id, None)
        return True

    def retry(self, now: float) -> None:
        """When due, try the waiting filings again (the first that fails again ends the round),
        then the folder itself."""
        if self.trouble is None or now < self.next_try:
            return
        for job_id, filing in list(self.pending.items()):
            if not self.attempt(job_id, filing, now):
                return
        self._probe(now)

    def can_start(self, now: float) -> bool:
        """May a job start now: nothing waits to be filed, and the folder takes a write (looked
        at before each start; while it cannot be written, every `RETRY_SECONDS`)."""
        if self.trouble is None:
            self._probe(now)
        else:
            self.retry(now)
        return self.trouble is None

    def failed(self, error: str, now: float) -> None:
        """A ledger write failed (a job's filing, the probe, or a skip or reused result, which
        a later pass does again): no job starts until it can be written."""
        self.next_try = now + RETRY_SECONDS
        if not self.keep_trying:
            raise LedgerError(
                f"{error}. Nothing is lost: finished results wait in the state folder's job "
                "folders; once it can be written, the next `watcher once` or `watcher run` files "
                "them and evaluates the rest"
            )
        if self.trouble is None:
            self.trouble = _Trouble(now, error)
            log.error(
                "ledger.unwritable",
                ledger_dir=str(self.ledger_dir),
                error=error,
                waiting_jobs=sorted(self.pending),
                hint=WAITING_HINT,
            )
        else:
            self.trouble.error = error

    def waits_for(self, job_id: str) -> bool:
        return job_id in self.pending

    def deadline(self) -> float | None:
        """When the loop should try again (None: nothing to try)."""
        return self.next_try if self.trouble is not None else None

    def summary(self, now: float) -> dict[str, Any] | None:
        """What `watcher status` shows while the folder cannot be written (None: it can)."""
        if self.trouble is None:
            return None
        return {
            "ledger_dir": str(self.ledger_dir),
            "since": iso(self.trouble.since),
            "for_s": round(now - self.trouble.since, 1),
            "error": self.trouble.error,
            "waiting_jobs": sorted(self.pending),
        }

    def _probe(self, now: float) -> None:
        why = writable(self.ledger_dir)
        if why is None:
            self._cleared(now)
        else:
            self.failed(f"cannot write to ledger_dir {self.ledger_dir}: {why}", now)

    def _cleared(self, now: float) -> None:
        if self.trouble is None:
            return
        log.info(
            "ledger.writable_again",
            ledger_dir=str(self.ledger_dir),
            after_s=round(now - self.trouble.since, 1),
        )
        self.trouble = None
