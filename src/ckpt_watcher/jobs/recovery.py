"""Recovery, once at start: what an earlier daemon left behind becomes jobs this one can run.

Workers of this state_dir still alive are killed (with their process groups). A job the earlier
daemon left `running` first gets its finished outcomes filed, then `settle.recover` decides:
done, back to the queue, or (a job that keeps taking the daemon down) failed. Queued jobs are
trimmed to what is still due, and dropped when the eval settings changed since they were queued
(their checkpoint is planned again under the new settings).
"""

from __future__ import annotations

import structlog

from ckpt_watcher.executors.processes import find_workers, is_our_worker, kill_group
from ckpt_watcher.jobs import settle
from ckpt_watcher.jobs.book import JobBook

log = structlog.get_logger("ckpt_watcher.jobs")


def recover(book: JobBook, now: float) -> None:
    state = book.state
    for pid in find_workers(book.cfg.state_dir):
        log.warning("recovery.killing_stray_worker", pid=pid)
        kill_group(pid)
    for job in state.jobs("running"):
        if job.pid and is_our_worker(job.pid, job.pid_start, job.id):
            kill_group(job.pid)
        book.harvest(job)
        remaining = book.due(job)
        verdict = settle.recover(
            job.attempt, job.daemon_deaths, book.cfg.eval.max_attempts, remaining
        )
        state.update_job(job.id, daemon_deaths=verdict.daemon_deaths or job.daemon_deaths)
        if verdict.kind == "requeue":
            book.requeue(job, remaining, attempt=verdict.attempt, error=verdict.reason)
            log.info(
                "recovery.requeued",
                job_id=job.id,
                run=job.run,
                step=job.step,
                daemon_deaths=verdict.daemon_deaths,
            )
        elif verdict.kind == "fail":
            log.error(
                "recovery.crash_loop",
                job_id=job.id,
                run=job.run,
                step=job.step,
                reason=verdict.reason,
            )
            book.fail(job, remaining, {}, verdict, now)
        else:
            book.finish(job, "ok", now)
    for job in state.jobs("queued"):
        if job.settings_hash != book.settings_hash:
            state.update_job(job.id, state="skipped", error="eval settings changed")
            state.upsert_checkpoint(job.location, "", now, state="ready", reason="re-plan")
            continue
        remaining = book.due(job)
        if not remaining:
            book.finish(job, "ok", now)
        elif remaining != job.tasks:
            state.update_job(job.id, tasks=remaining)
