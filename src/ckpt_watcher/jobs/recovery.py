"""Recovery, once at start: what an earlier daemon left behind becomes jobs this one runs.

A job the earlier daemon left `running` whose worker is still alive is adopted: this daemon
waits for its outcome as if it had started it (`Executor.adopt`), so a kill -9 of the daemon
costs no work at all. Every other worker of this state_dir (an idle warm worker, one no executor
here can adopt) is killed with its process group. A job whose worker is gone first gets its
finished outcomes filed, then `settle.recover` decides: done, back to the queue, or (a job under
which the daemon keeps dying with nothing else to explain it) failed. Queued jobs are trimmed to
what is still due, and dropped when the eval settings changed since they were queued (their
checkpoint is planned again under the new settings). What the workers that ended meanwhile
left is removed: their temporary folders (scratch.py), and the rest of their process groups
(vLLM's engine process on CUDA, forked from its worker, outlives a kill -9 of it).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import structlog

from ckpt_watcher import scratch
from ckpt_watcher.executors.base import Executor, WorkerHandle
from ckpt_watcher.executors.processes import (
    find_workers,
    is_our_worker,
    kill_group,
    reap_remnants,
)
from ckpt_watcher.jobfolder import engine_files
from ckpt_watcher.jobs import settle
from ckpt_watcher.jobs.book import JobBook
from ckpt_watcher.jobs.filing import Filing
from ckpt_watcher.proctable import process_alive

log = structlog.get_logger("ckpt_watcher.jobs")


def recover(book: JobBook, executor: Executor, filing: Filing, now: float) -> None:
    state = book.state
    adopted: set[int] = set()
    for job in state.jobs("running"):
        alive = bool(job.pid and is_our_worker(job.pid, job.pid_start))
        folder = book.folder(job)
        if alive and job.pid and job.pid_start:
            if executor.adopt(job.id, WorkerHandle(job.id, job.pid, job.pid_start), folder):
                adopted.add(job.pid)
                log.info("recovery.adopted", job_id=job.id, run=job.run, step=job.step, pid=job.pid)
                continue
            kill_group(job.pid)
        elif job.pid:
            reap_remnants(job.pid)  # a worker killed with the daemon: its engine lives on
        # a ledger folder that cannot be written keeps the job running, filed on a later pass
        filing.attempt(job.id, partial(_settle_gone, book, job.id, alive), now)
    for pid in find_workers(book.cfg.state_dir):
        if pid not in adopted:
            log.warning("recovery.killing_stray_worker", pid=pid)
            kill_group(pid)
    for pid in _warm_workers_gone_unreleased(book.cfg.state_dir):
        reap_remnants(pid)  # an idle warm worker killed with the daemon: its engine lives on
    swept = scratch.sweep()  # workers that ended while no daemon watched them (vLLM's sockets)
    if swept:
        log.info("recovery.temp_folders_removed", workers=swept)
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


def _warm_workers_gone_unreleased(state_dir: Path) -> list[int]:
    """The warm workers whose `engine.json` says they held an engine (busy or idle, not
    released) and whose process is gone."""
    pids = []
    for engine in engine_files(state_dir):
        try:
            pid = int(engine.get("pid") or 0)
        except (ValueError, TypeError):
            continue
        if engine.get("state") != "released" and pid > 0 and not process_alive(pid):
            pids.append(pid)
    return pids


def _settle_gone(book: JobBook, job_id: str, alive: bool, now: float) -> None:
    """A running job whose worker is gone (or was just killed): file what it finished, then
    `settle.recover` decides."""
    state = book.state
    job = state.job(job_id)
    if job is None or job.state != "running":
        return
    book.harvest(job)
    remaining = book.due(job)
    progressed = len(remaining) < len(job.tasks)  # a task finished since it last started
    verdict = settle.recover(
        job.attempt,
        job.daemon_deaths,
        book.cfg.eval.max_attempts,
        remaining,
        explained=alive or progressed,
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
            worker_outlived_daemon=alive,
            progressed=progressed,
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
