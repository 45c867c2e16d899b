"""Supervision of running jobs: their workers' exits, time-outs and the stop's kills.

A worker's exit is settled once its outcomes are filed (`JobBook.harvest`): with every task
`ok`, the job is done. Otherwise the checkpoint's source is first asked, off the loop, whether
the checkpoint still exists (a trainer's keep-last-k may have deleted it), then `settle.settle`
gives the verdict (retry, fail, requeue, missed), which the book carries out.

Time-outs count a job's running time on a monotonic clock from the moment this daemon first
sees it running (plus the wall-clock time before that, from its start time in the state): a
wall clock stepped forward (NTP, a VM resumed) never times out a running eval.
"""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import structlog

from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.discovery import Discovery
from ckpt_watcher.executors.base import Executor
from ckpt_watcher.jobs import settle
from ckpt_watcher.jobs.book import JobBook
from ckpt_watcher.jobs.filing import Filing
from ckpt_watcher.jobs.helpers import Helpers
from ckpt_watcher.ledger import task_key
from ckpt_watcher.state import Job, State

log = structlog.get_logger("ckpt_watcher.jobs")

# How long a failed job waits for its source to say whether the checkpoint is still there.
EXISTS_WAIT_SECONDS = 10.0


@dataclass
class _Asking:
    """A failed job waiting to hear whether its checkpoint still exists."""

    rc: int
    asked: Future[bool] | None
    deadline: float


class Supervisor:
    def __init__(
        self,
        cfg: WatcherConfig,
        state: State,
        executor: Executor,
        exits: queue.Queue[tuple[str, int]],
        discovery: Discovery,
        book: JobBook,
        helpers: Helpers,
        filing: Filing,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """`monotonic` measures running time (tests on a simulated clock pass that clock)."""
        self.cfg = cfg
        self.monotonic = monotonic
        # a job's run (id, attempt, start) -> (how long it had run when first seen, monotonic then)
        self._first_seen: dict[tuple[str, int, float], tuple[float, float]] = {}
        self.helpers = helpers
        self.state = state
        self.executor = executor
        self.exits = exits  # (job id, exit code), queued by the executor's threads
        self.discovery = discovery
        self.book = book
        self.filing = filing  # exits whose lines the ledger folder could not take yet
        self.timed_out: set[str] = set()
        self.killed_for_stop: set[str] = set()
        self.yielded: dict[str, str] = {}  # job id -> the device given back, and why
        self.asking: dict[str, _Asking] = {}

    def busy(self) -> bool:
        """Jobs queued or running, or exits and verdicts not yet handled."""
        return bool(
            self.state.jobs("queued", "running")
            or not self.exits.empty()
            or self.asking
            or self.filing.pending
        )

    def deadlines(self, now: float) -> list[float]:
        """When supervision next needs the loop: time-outs of running jobs, answers waited for."""
        out = [asking.deadline for asking in self.asking.values()]
        for job in self.state.jobs("running"):
            ran = self.running_for(job, now)
            if ran is not None:
                out.append(now + self.cfg.eval.timeout_seconds - ran)
        return out

    def running_for(self, job: Job, now: float) -> float | None:
        """How long `job` has run: the wall-clock time from its start to the moment this daemon
        first saw it running, then monotonic time (None: not started yet)."""
        if not job.started_at:
            return None
        key = (job.id, job.attempt, job.started_at)
        seen = self._first_seen.get(key)
        if seen is None:
            seen = self._first_seen[key] = (max(0.0, now - job.started_at), self.monotonic())
        return seen[0] + self.monotonic() - seen[1]

    def check_timeouts(self, now: float) -> None:
        limit = self.cfg.eval.timeout_seconds
        running = self.state.jobs("running")
        for gone in set(self._first_seen) - {(j.id, j.attempt, j.started_at) for j in running}:
            del self._first_seen[gone]  # ended, or queued again: its next attempt starts anew
        for job in running:
            if self.filing.waits_for(job.id):
                continue  # its worker has ended: its lines wait for the ledger folder
            ran = self.running_for(job, now)
            if ran is not None and ran > limit and job.id not in self.timed_out:
                self.timed_out.add(job.id)
                log.error("eval.timeout", job_id=job.id, run=job.run, step=job.step, seconds=limit)
                self.executor.kill(job.id)

    def collect(self, now: float) -> None:
        """Handle worker exits, and failed jobs whose source has answered (or not in time).
        An exit whose lines the ledger folder cannot take waits in `filing`, the job still
        `running`, and is handled again from the start when the folder takes them."""
        self.filing.retry(now)
        while True:
            try:
                job_id, rc = self.exits.get_nowait()
            except queue.Empty:
                break
            if self.helpers.exited(job_id, rc):
                continue
            self.filing.attempt(job_id, partial(self._exited, job_id, rc), now)
        for job_id, asking in list(self.asking.items()):
            if asking.asked is not None and not asking.asked.done() and now < asking.deadline:
                continue
            del self.asking[job_id]
            self.filing.attempt(job_id, partial(self._answered, job_id, asking), now)

    def _exited(self, job_id: str, rc: int, now: float) -> None:
        job = self.state.job(job_id)
        if job is None or job.state != "running":
            return
        self.book.harvest(job)
        # its files are held for it (pinned, a staged S3 copy): a failure is no delete
        held = self.discovery.held(self.book.source_name(job), job.location)
        if (
            not self.book.due(job)
            or held
            or job.id in self.killed_for_stop
            or job.id in self.yielded
        ):
            self._settle(job, rc, gone=False, now=now)
            return
        # a failure: was the checkpoint deleted meanwhile? Ask its source, off the loop.
        asked = self.discovery.exists(self.book.source_name(job), job.location)
        self.asking[job.id] = _Asking(rc, asked, now + EXISTS_WAIT_SECONDS)

    def _answered(self, job_id: str, asking: _Asking, now: float) -> None:
        job = self.state.job(job_id)
        if job is not None and job.state == "running":
            self._settle(job, asking.rc, gone=_answered_no(asking.asked), now=now)

    def _settle(self, job: Job, rc: int, gone: bool, now: float) -> None:
        """Carry out `settle.settle`'s verdict on a worker's exit."""
        outcomes = self.book.outcomes(job)
        remaining = self.book.due(job)
        folder = self.book.folder(job)
        crash = folder.crash()
        failed = [outcomes.get(task_key(task)) for task in remaining]
        permanent = (crash is not None and not crash.heals) or bool(
            failed and all(o is not None and not o.heals for o in failed)
        )
        # read here, forgotten once the verdict is carried out (a filing done again reads them)
        timed_out = job.id in self.timed_out
        killed_for_stop = job.id in self.killed_for_stop
        yielded = self.yielded.get(job.id)
        verdict = settle.settle(
            settle.Attempt(
                attempt=job.attempt,
                max_attempts=self.cfg.eval.max_attempts,
                remaining=remaining,
                rc=rc,
                now=now,
                backoff_seconds=self.cfg.eval.retry_backoff_seconds,
                killed_for_stop=killed_for_stop,
                yielded=yielded,
                timed_out_after=self.cfg.eval.timeout_seconds if timed_out else None,
                checkpoint_gone=gone,
                checkpoint_changed=crash is not None and crash.changed,
                task_errors=[
                    f"{task['task']}: {outcomes[task_key(task)].error}"
                    for task in remaining
                    if task_key(task) in outcomes
                ],
                crash_error=crash.error if crash else None,
                heals=not permanent,
                log_tail=folder.log_tail(),
            )
        )
        if verdict.kind == "ok":
            self.book.finish(job, "ok", now)
            log.info("job.ok", job_id=job.id, run=job.run, step=job.step)
        elif verdict.kind == "changed":
            self.book.changed(job, verdict.reason, now)
        elif verdict.kind == "requeue":
            self.book.requeue(job, remaining, attempt=verdict.attempt, error=verdict.reason)
            log.info("job.requeued", job_id=job.id, reason=verdict.reason)
        elif verdict.kind == "missed":
            self.book.missed(job, verdict.reason, now)
        elif verdict.kind == "retry":
            self.book.requeue(
                job,
                remaining,
                attempt=verdict.attempt,
                not_before=verdict.not_before,
                error=verdict.reason,
            )
            log.warning(
                "eval.retry",
                job_id=job.id,
                run=job.run,
                step=job.step,
                attempt=job.attempt,
                max_attempts=self.cfg.eval.max_attempts,
                in_seconds=round(verdict.not_before - now, 3),
                reason=verdict.reason,
            )
        else:
            self.book.fail(job, remaining, outcomes, verdict, now)
        self.timed_out.discard(job.id)
        self.killed_for_stop.discard(job.id)
        self.yielded.pop(job.id, None)

    def give_back(self, busy: dict[str, str], labels: dict[str, str]) -> list[str]:
        """devices.yield_to_others: stop every running job on a device that another process now
        uses (`busy`: device id -> why). Each goes back to the queue with its attempt given
        back; its journal keeps what it finished. Returns the jobs stopped now."""
        stopped = []
        for job in self.state.jobs("running"):
            if (
                job.device not in busy
                or job.id in self.yielded
                or job.id in self.killed_for_stop
                or self.filing.waits_for(job.id)  # its worker has ended already
            ):
                continue
            self.yielded[job.id] = f"{labels.get(job.device, job.device)} ({busy[job.device]})"
            log.warning(
                "eval.yielded",
                job_id=job.id,
                run=job.run,
                step=job.step,
                device=job.device_label,
                why=busy[job.device],
            )
            self.executor.kill(job.id)
            stopped.append(job.id)
        return stopped

    def kill_for_stop(self) -> None:
        """The stop's second stage: kill every running worker now; their jobs are re-queued,
        never marked ok."""
        self.helpers.stop_all()
        for job in self.state.jobs("running"):
            if job.id in self.killed_for_stop or self.filing.waits_for(job.id):
                continue
            self.killed_for_stop.add(job.id)
            log.warning("daemon.killing_worker", job_id=job.id, pid=job.pid)
            self.executor.kill(job.id)
            if job.id not in self.executor.running():
                # no live process to report an exit (e.g. after a restart): settle now
                self.exits.put((job.id, -signal.SIGKILL))


def _answered_no(asked: Future[bool] | None) -> bool:
    """True only if the source answered that the checkpoint is gone (no answer: still there)."""
    if asked is None or not asked.done() or asked.exception() is not None:
        return False
    return asked.result() is False
