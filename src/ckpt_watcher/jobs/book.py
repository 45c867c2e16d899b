"""The job book: what a job's attempt means for the ledger, the state and its checkpoint.

It files each finished task's `ok` line (step 3 of the crash-safe order), files `failed` lines
when a job gives up, puts a job back in the queue, and ends a job, marking its checkpoint `done`
or `failed` once its last job has ended. Dispatch, supervision and recovery all end jobs through
it, so a job ends the same way whoever ends it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher import journal, planner
from ckpt_watcher.config import WatcherConfig, task_settings_hash
from ckpt_watcher.discovery import Discovery
from ckpt_watcher.jobfolder import JobFolder, TaskOutcome
from ckpt_watcher.jobs.settle import Verdict
from ckpt_watcher.journal import JournalRef
from ckpt_watcher.ledger import LedgerIndex, Subject, result_lines, task_key
from ckpt_watcher.state import Job, State

log = structlog.get_logger("ckpt_watcher.jobs")

Tasks = list[dict[str, Any]]


def bare_outcome(task: dict[str, Any], status: str) -> TaskOutcome:
    """The outcome of a task entry no worker wrote one for (a failure, a skip)."""
    return TaskOutcome(task["task"], task["num_fewshot"], status, name=task.get("name"))


class JobBook:
    def __init__(
        self, cfg: WatcherConfig, state: State, ledger: LedgerIndex, discovery: Discovery
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.ledger = ledger
        self.discovery = discovery
        self.settings_hash = cfg.eval.settings_hash()
        self.all_tasks = cfg.eval.entries()
        self.failures = 0  # jobs that ended failed since this daemon started
        self.journal_home = journal.journal_home(cfg.state_dir, cfg.executor.shared_dir)

    # --- what is known about a job --------------------------------------------------------
    def folder(self, job: Job) -> JobFolder:
        """The folder of the job's current attempt."""
        return JobFolder.of(self.cfg.state_dir, job.id, job.attempt)

    def due(self, job: Job, tasks: Tasks | None = None) -> Tasks:
        """The job's tasks (or `tasks`) that have no `ok` line for its checkpoint yet."""
        return self.ledger.due(
            Subject.of_job(job), job.tasks if tasks is None else tasks, self.settings_hash
        )

    def outcomes(self, job: Job) -> dict[tuple[str, int | None], TaskOutcome]:
        """What the current attempt's worker wrote, by task."""
        found, unreadable = self.folder(job).outcomes()
        for problem in unreadable:
            log.error("eval.outcome_unreadable", job_id=job.id, error=problem)
        return {o.key: o for o in found}

    def journal_ref(self, job: Job, task: dict[str, Any]) -> JournalRef | None:
        """Where the units of `task` on the job's checkpoint are journaled (None without a
        fingerprint: content not identified, so nothing could be replayed safely)."""
        if not job.fingerprint:
            return None
        ident = journal.identity(
            job.fingerprint,
            task_settings_hash(job.settings_hash, task),
            task["task"],
            task["num_fewshot"],
        )
        return JournalRef(str(journal.folder_for(self.journal_home, ident)), ident)

    def source_name(self, job: Job) -> str:
        row = self.state.checkpoint(job.location)
        return row.source if row is not None else ""

    # --- filing results -------------------------------------------------------------------
    def harvest(self, job: Job) -> None:
        """(3) An `ok` ledger line for every task the current attempt finished."""
        for outcome in self.outcomes(job).values():
            if outcome.status == "ok":
                self.file(job, outcome, "ok", None)

    def file(self, job: Job, outcome: TaskOutcome, status: str, error: str | None) -> None:
        """Append one task's ledger line (the ledger drops an `ok` it already has)."""
        lines = result_lines(
            job=job,
            outcome=outcome,
            status=status,
            error=error,
            eval_cfg=self.cfg.eval,
            ledger_dir=self.cfg.ledger_dir,
        )
        written = [self.ledger.append(line) for line in lines]
        line = lines[0]
        if status == "ok":  # in the ledger now (or already): its journal is done with
            entry = next((t for t in job.tasks if task_key(t) == outcome.key), None)
            ref = self.journal_ref(job, entry) if entry is not None else None
            if ref is not None:
                journal.remove(Path(ref.folder))
        if not any(written):
            return
        if status == "skipped":
            return  # said once for the job (skip)
        log.info(
            "eval.finished" if status == "ok" else "eval.failed",
            job_id=job.id,
            run=job.run,
            step=job.step,
            task=outcome.task,
            num_fewshot=outcome.num_fewshot,
            device=job.device_label,
            metrics=line["metrics"],
            error=error,
        )

    # --- ending an attempt ------------------------------------------------------------------
    def fail(
        self,
        job: Job,
        remaining: Tasks,
        outcomes: dict[tuple[str, int | None], TaskOutcome],
        verdict: Verdict,
        now: float,
    ) -> None:
        """A `failed` ledger line for each task still due, then the job ends failed."""
        for task in remaining:
            outcome = outcomes.get(task_key(task)) or bare_outcome(task, "failed")
            self.file(job, outcome, "failed", verdict.error)
        self.failures += 1
        self.finish(job, "failed", now, error=verdict.reason)

    def skip(self, job: Job, reason: str, now: float) -> None:
        """A queued job given up by policy (the backlog): a `skipped` ledger line for each of
        its tasks, saying why; the job and its checkpoint end `skipped`."""
        for task in self.due(job):
            self.file(job, bare_outcome(task, "skipped"), "skipped", reason)
        self.state.update_job(job.id, state="skipped", finished_at=now, error=reason)
        if not self.state.jobs("queued", "running", location=job.location):
            self.state.upsert_checkpoint(
                job.location, self.source_name(job), now, state="skipped", reason=reason
            )
        log.info("job.skipped", job_id=job.id, run=job.run, step=job.step, reason=reason)

    def requeue(
        self, job: Job, tasks: Tasks, *, attempt: int, error: str, not_before: float = 0.0
    ) -> None:
        """Back to the queue with the tasks still due; the device and worker are released."""
        self.state.update_job(
            job.id,
            state="queued",
            tasks=tasks,
            attempt=attempt,
            not_before=not_before,
            pid=None,
            device=None,
            device_label=None,
            error=error,
        )

    def finish(self, job: Job, state: str, now: float, error: str | None = None) -> None:
        """The job ends (`ok` or `failed`); its checkpoint's last job marks the checkpoint."""
        self.state.update_job(job.id, state=state, finished_at=now, error=error, pid=None)
        if self.state.jobs("queued", "running", location=job.location):
            return  # other parts of a split checkpoint are still due
        source = self.source_name(job)
        self.discovery.release(source, job.location)
        row = self.state.checkpoint(job.location)
        if row is None:
            return
        mark = planner.after_jobs(
            row.state,
            self.due(job, self.all_tasks),
            [j.error for j in self.state.jobs("failed", location=job.location) if j.error],
        )
        if mark is not None:
            self.state.upsert_checkpoint(
                job.location, row.source, now, state=mark.state, reason=mark.reason
            )

    def changed(self, job: Job, reason: str, now: float) -> None:
        """The checkpoint's files changed under the job (its worker found them other than
        judged): what it finished before stands; the rest of this job and of the checkpoint's
        queued jobs is dropped, and the checkpoint is judged again (no attempt spent)."""
        self.state.update_job(
            job.id, state="skipped", finished_at=now, error=f"judged again: {reason}", pid=None
        )
        for waiting in self.state.jobs("queued", location=job.location):
            self.state.delete_job(waiting.id)
        source = self.source_name(job)
        if not self.state.jobs("running", location=job.location):
            self.discovery.release(source, job.location)
        self.discovery.look_again(source, job.location, now, reason)

    def missed(self, job: Job, reason: str, now: float) -> None:
        """The checkpoint was deleted before its results were in."""
        self.state.update_job(job.id, state="skipped", error=reason, pid=None)
        self.state.upsert_checkpoint(
            job.location, self.source_name(job), now, state="missed", reason=reason
        )
        log.warning("checkpoint.missed", location=job.location, run=job.run, step=job.step)
