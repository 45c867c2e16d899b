"""Journals kept only while a job can use them, and within `policy.journal_max_gb`.

A task's journal (journal.py) lets its job resume; once no queued or running job can use it
(its `ok` line is in the ledger, the job failed or was skipped, the checkpoint was rewritten
or missed, the settings changed, a kill came between the ledger append and the removal, or a
helper left an empty folder) it is removed, at the daemon's start and every SWEEP_SECONDS.
Beyond `policy.journal_max_gb` the journals of queued jobs go, oldest job first (those tasks
start from zero), never a running job's. What is left is published for `watcher status`
(meta `journals`: folders, bytes, max_bytes).
"""

from __future__ import annotations

from pathlib import Path

import structlog

from ckpt_watcher import journal
from ckpt_watcher.errors import ConfigError
from ckpt_watcher.jobs.book import JobBook
from ckpt_watcher.state import Job, State

log = structlog.get_logger("ckpt_watcher.jobs")

SWEEP_SECONDS = 60.0


class Journals:
    def __init__(self, book: JobBook, state: State, max_bytes: int | None) -> None:
        self.book = book
        self.state = state
        self.max_bytes = max_bytes
        self._next = 0.0
        self._warned_over = False

    def check_home(self, *, ray: bool, shared: bool) -> None:
        """At start: the journals' folder must be writable; under Ray, say where a retried
        task resumes (only a shared folder lets a retry on another node find its journal)."""
        root = journal.journals_root(self.book.journal_home)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"config field executor.shared_dir: cannot create {root} ({e}); "
                "name a folder every node can write (EFS, NFS)"
            ) from None
        if ray and not shared:
            log.warning(
                "executor.journals_on_this_host",
                message="the tasks' journals are under state_dir, which other nodes do not "
                "see: a task retried on another node starts from zero; set executor.shared_dir "
                "to a folder every node sees (EFS) to resume it there",
            )
        else:
            log.info("executor.journals", folder=str(root))

    def tick(self, now: float) -> None:
        """Sweep if one is due (at the first call, then every SWEEP_SECONDS)."""
        if now >= self._next:
            self._next = now + SWEEP_SECONDS
            self.sweep()

    def sweep(self) -> None:
        running = {f for job in self.state.jobs("running") for f in self._folders(job)}
        queued = [(job, self._folders(job)) for job in self.state.jobs("queued")]  # oldest first
        keep = running | {f for _, folders in queued for f in folders}
        found = {str(Path(f)): n for f, n in journal.sizes(self.book.journal_home).items()}
        for folder in sorted(set(found) - keep):
            journal.remove(Path(folder))
            log.info(
                "journal.removed", folder=folder, bytes=found.pop(folder), why="no job uses it"
            )
        total = sum(found.values())
        if self.max_bytes is not None and total > self.max_bytes:
            for job, folders in queued:
                for folder in folders:
                    if total <= self.max_bytes:
                        break
                    if folder in found and folder not in running:
                        journal.remove(Path(folder))
                        total -= found.pop(folder)
                        log.warning(
                            "journal.dropped",
                            job_id=job.id,
                            folder=folder,
                            why="policy.journal_max_gb reached: the task starts from zero",
                        )
            over = total > self.max_bytes
            if over and not self._warned_over:
                log.warning(
                    "journal.over_budget",
                    bytes=total,
                    max_bytes=self.max_bytes,
                    hint="running jobs' journals alone exceed policy.journal_max_gb: they are "
                    "kept (their results depend on them); raise the limit or free state_dir",
                )
            self._warned_over = over
        self.state.set_meta(
            journals={"folders": len(found), "bytes": total, "max_bytes": self.max_bytes}
        )

    def _folders(self, job: Job) -> list[str]:
        refs = (self.book.journal_ref(job, t) for t in job.tasks)
        return [str(Path(ref.folder)) for ref in refs if ref is not None]
