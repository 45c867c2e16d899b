"""The job runner: start workers, collect their exits, time them out, recover after a crash, and
append each finished task's ledger line. It carries out the verdicts of `settle`; the Executor
(local subprocesses, Ray) does the process work.

Crash-safe order for one job: (1) the job row goes `running` (commit) before its worker starts;
(2) the worker writes each task's outcome file (tmp + fsync + rename); (3) the runner appends the
ledger line (fsync), then marks the job `ok`. On start (`recover`), workers left by an earlier
daemon are killed, outcome files they finished are harvested first, and ledger `ok` lines win
over job states, so nothing is lost and nothing is appended twice.
"""

from __future__ import annotations

import json
import queue
import signal
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher import planner, scheduler, settle
from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.devices import Device
from ckpt_watcher.discovery import Discovery
from ckpt_watcher.durable import write_json_atomic
from ckpt_watcher.executors.base import CRASH_FILE, WORKER_MODULE, Executor, is_our_worker
from ckpt_watcher.executors.local import kill_group
from ckpt_watcher.ledger import LedgerIndex, Subject, result_line
from ckpt_watcher.mirror import LedgerMirror
from ckpt_watcher.state import Job, State

log = structlog.get_logger("ckpt_watcher.jobs")

LOG_TAIL_LINES = 25
# How long a failed job waits for its source to say whether the checkpoint is still there.
EXISTS_WAIT_SECONDS = 10.0


def job_dir(state_dir: Path, job_id: str, attempt: int) -> Path:
    return state_dir / "jobs" / job_id / f"attempt-{attempt}"


def find_stray_workers(state_dir: Path) -> list[int]:
    """PIDs of worker processes started for this state_dir (by any earlier daemon instance)."""
    prefix = str(state_dir / "jobs").encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if WORKER_MODULE.encode() in argv and any(a.startswith(prefix) for a in argv):
            pids.append(int(entry.name))
    return pids


@dataclass
class _Settling:
    """A failed job waiting to hear whether its checkpoint still exists."""

    rc: int
    asked: Future[bool] | None
    deadline: float


class JobRunner:
    def __init__(
        self,
        cfg: WatcherConfig,
        state: State,
        ledger: LedgerIndex,
        executor: Executor,
        exits: queue.Queue[tuple[str, int]],
        discovery: Discovery,
        mirror: LedgerMirror | None,
        clock: Callable[[], float],
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.ledger = ledger
        self.discovery = discovery
        self.mirror = mirror
        self.clock = clock
        self.exits = exits  # (job id, exit code), queued by the executor's threads
        self.executor = executor
        self.settings_hash = cfg.eval.settings_hash()
        self.all_tasks = [t.model_dump() for t in cfg.eval.tasks]
        self.timed_out: set[str] = set()
        self.killed_for_stop: set[str] = set()
        self.settling: dict[str, _Settling] = {}
        self.failures = 0  # jobs that ended failed since this daemon started

    def busy(self) -> bool:
        """Jobs queued or running, or exits and verdicts not yet handled."""
        return bool(self.state.jobs("queued", "running") or not self.exits.empty() or self.settling)

    def _due(self, job: Job, tasks: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        subject = Subject(job.location, job.run, job.run_path, job.step, job.label, job.fingerprint)
        return self.ledger.due(subject, job.tasks if tasks is None else tasks, self.settings_hash)

    # --- recovery after a crash or restart -----------------------------------------------------
    def recover(self, now: float) -> None:
        for pid in find_stray_workers(self.cfg.state_dir):
            log.warning("recovery.killing_stray_worker", pid=pid)
            kill_group(pid)
        for job in self.state.jobs("running"):
            if job.pid and is_our_worker(job.pid, job.pid_start, job.id):
                kill_group(job.pid)
            self._harvest(job)
            remaining = self._due(job)
            verdict = settle.recover(
                job.attempt, job.daemon_deaths, self.cfg.eval.max_attempts, remaining
            )
            self.state.update_job(job.id, daemon_deaths=verdict.daemon_deaths or job.daemon_deaths)
            if verdict.kind == "requeue":
                self._requeue(job, remaining, attempt=verdict.attempt, error=verdict.reason)
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
                self._fail(job, remaining, {}, verdict, now)
            else:
                self._finish(job, "ok", now)
        for job in self.state.jobs("queued"):
            if job.settings_hash != self.settings_hash:
                self.state.update_job(job.id, state="skipped", error="eval settings changed")
                self.state.upsert_checkpoint(job.location, "", now, state="ready", reason="re-plan")
                continue
            remaining = self._due(job)
            if not remaining:
                self._finish(job, "ok", now)
            elif remaining != job.tasks:
                self.state.update_job(job.id, tasks=remaining)

    # --- dispatch ------------------------------------------------------------------------------
    def dispatch(self, now: float, free: list[Device]) -> None:
        """Give free devices their next jobs (splitting a checkpoint over spare devices)."""
        if not free:
            return
        queued = self.state.jobs("queued")
        if self._split(scheduler.eligible(queued, now), len(free), now):
            queued = self.state.jobs("queued")
        assignments = scheduler.assign(queued, free, now, self.cfg.policy.order)
        if not assignments:
            return
        needed: dict[str, list[str]] = {}
        for job in queued + self.state.jobs("running"):
            needed.setdefault(self._source_name(job), []).append(job.location)
        self.discovery.make_room(needed)  # staged copies of jobs that are due stay
        for job, device in assignments:
            self._start(job, device)

    def _split(self, eligible: list[Job], free: int, now: float) -> bool:
        """Spread one checkpoint's tasks over spare devices (see scheduler.split_plan)."""
        plan = scheduler.split_plan(
            eligible, free, lambda t: self.ledger.estimate(t["task"], t["num_fewshot"])
        )
        for job_id, groups in plan.items():
            job = next(j for j in eligible if j.id == job_id)
            self.state.update_job(job.id, tasks=groups[0])
            for i, group in enumerate(groups[1:], start=1):
                self.state.add_job(job.part(i, group, now))
            log.info("job.split", job_id=job.id, parts=[[t["task"] for t in g] for g in groups])
        return bool(plan)

    def queue(self, q: planner.QueueJob, now: float) -> Job:
        """Carry out a planner QueueJob."""
        job = Job.new(
            id=f"{q.run}-{q.step if q.step is not None else q.label}-{uuid.uuid4().hex[:8]}",
            location=q.location,
            run=q.run,
            step=q.step,
            label=q.label,
            tasks=q.tasks,
            settings_hash=self.settings_hash,
            created_at=now,
            order_key=q.order_key,
            run_path=q.run_path,
            fingerprint=q.fingerprint,
        )
        self.state.add_job(job)
        log.info(
            "job.queued", job_id=job.id, run=q.run, step=q.step, tasks=[t["task"] for t in q.tasks]
        )
        return job

    def _request(self, job: Job, device: Device) -> dict[str, Any]:
        ev = self.cfg.eval
        folder = f"step_{job.step}" if job.step is not None else job.label
        return {
            "checkpoint": job.location,
            "backend": ev.backend,
            "model_args": ev.model_args,
            "tasks": job.tasks,
            "seed": ev.seed,
            "gen_kwargs": ev.gen_kwargs,
            "max_gen_toks": ev.max_gen_toks,
            "include_path": str(ev.include_path) if ev.include_path else None,
            "batch_size": ev.batch_size,
            "limit": ev.limit,
            "results_dir": str((self.cfg.ledger_dir / job.run_path / folder).resolve()),
            "device": device.compute,
            "tensor_parallel_size": ev.tensor_parallel_size,
        }

    def _source_name(self, job: Job) -> str:
        row = self.state.checkpoint(job.location)
        return str(row["source"]) if row is not None else ""

    def _start(self, job: Job, device: Device) -> None:
        attempt = job.attempt + 1
        folder = job_dir(self.cfg.state_dir, job.id, attempt)
        folder.mkdir(parents=True, exist_ok=True)
        spec = {
            "job_id": job.id,
            "device_label": device.label,
            "request": self._request(job, device),
            "stage": self.discovery.stage_spec(self._source_name(job), job.location),
        }
        write_json_atomic(folder / "spec.json", spec)
        # (1) running, committed before the worker exists: a crash now leaves a job to recover
        self.state.update_job(
            job.id,
            state="running",
            attempt=attempt,
            device=device.id,
            device_label=device.label,
            started_at=self.clock(),  # not the loop's `now`: scanning and planning took time
            pid=None,
            pid_start=None,
        )
        env = {"CUDA_VISIBLE_DEVICES": device.visible}
        try:
            handle = self.executor.start(job.id, folder, env, folder / "worker.log")
        except OSError as e:
            self._requeue(job, job.tasks, attempt=job.attempt, error=f"could not start: {e}")
            log.error("eval.start_failed", job_id=job.id, error=str(e))
            return
        self.state.update_job(job.id, pid=handle.pid, pid_start=handle.start_token)
        log.info(
            "eval.started",
            job_id=job.id,
            run=job.run,
            step=job.step,
            device=device.label,
            attempt=attempt,
            pid=handle.pid,
            tasks=[t["task"] for t in job.tasks],
        )

    def check_timeouts(self, now: float) -> None:
        limit = self.cfg.eval.timeout_seconds
        for job in self.state.jobs("running"):
            if job.started_at and now - job.started_at > limit and job.id not in self.timed_out:
                self.timed_out.add(job.id)
                log.error("eval.timeout", job_id=job.id, run=job.run, step=job.step, seconds=limit)
                self.executor.kill(job.id)

    def deadlines(self) -> list[float]:
        """When the runner next needs the loop: timeouts of running jobs, verdicts waited for."""
        out = [s.deadline for s in self.settling.values()]
        for job in self.state.jobs("running"):
            if job.started_at:
                out.append(job.started_at + self.cfg.eval.timeout_seconds)
        return out

    # --- collecting results --------------------------------------------------------------------
    def collect(self, now: float) -> None:
        """Handle worker exits, and failed jobs whose source has answered (or not in time)."""
        while True:
            try:
                job_id, rc = self.exits.get_nowait()
            except queue.Empty:
                break
            job = self.state.job(job_id)
            if job is None or job.state != "running":
                continue
            self._harvest(job)
            if not self._due(job) or job.id in self.killed_for_stop:
                self._settle(job, rc, gone=False, now=now)
                continue
            # a failure: was the checkpoint deleted meanwhile? Ask its source, off the loop.
            asked = self.discovery.exists(self._source_name(job), job.location)
            self.settling[job.id] = _Settling(rc, asked, now + EXISTS_WAIT_SECONDS)
        for job_id, s in list(self.settling.items()):
            if s.asked is not None and not s.asked.done() and now < s.deadline:
                continue
            del self.settling[job_id]
            job = self.state.job(job_id)
            if job is not None and job.state == "running":
                self._settle(job, s.rc, gone=_answered_no(s.asked), now=now)

    def _outcomes(self, job: Job) -> list[dict[str, Any]]:
        folder = job_dir(self.cfg.state_dir, job.id, job.attempt)
        out = []
        for p in sorted(folder.glob("outcome-*.json")):
            try:
                out.append(json.loads(p.read_text(encoding="utf-8")))
            except (OSError, ValueError) as e:  # renamed into place, so never torn; be safe
                log.error("eval.outcome_unreadable", job_id=job.id, path=str(p), error=str(e))
        return out

    def _crash(self, job: Job) -> dict[str, Any] | None:
        """What the worker said stopped it as a whole (worker.CRASH_FILE), if it said."""
        path = job_dir(self.cfg.state_dir, job.id, job.attempt) / CRASH_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _harvest(self, job: Job) -> None:
        """(3) Append an ok ledger line for every finished task of the job's current attempt."""
        for o in self._outcomes(job):
            if o["status"] == "ok":
                self._append(job, o, "ok", None)

    def _append(self, job: Job, o: dict[str, Any], status: str, error: str | None) -> None:
        line = result_line(
            job=job,
            outcome=o,
            status=status,
            error=error,
            eval_cfg=self.cfg.eval,
            ledger_dir=self.cfg.ledger_dir,
        )
        if not self.ledger.append(line):
            return
        if self.mirror is not None:
            self.mirror.request(job.run_path)
        log.info(
            "eval.finished" if status == "ok" else "eval.failed",
            job_id=job.id,
            run=job.run,
            step=job.step,
            task=o["task"],
            num_fewshot=o["num_fewshot"],
            device=job.device_label,
            metrics=line["metrics"],
            error=error,
        )

    def _settle(self, job: Job, rc: int, gone: bool, now: float) -> None:
        """Carry out `settle.settle`'s verdict on a worker's exit."""
        outcomes = {(o["task"], o["num_fewshot"]): o for o in self._outcomes(job)}
        remaining = self._due(job)
        crash = self._crash(job)
        failed = [outcomes.get((t["task"], t["num_fewshot"])) for t in remaining]
        permanent = (crash is not None and crash.get("heals") is False) or bool(
            failed and all(o is not None and o.get("heals") is False for o in failed)
        )
        timed_out = job.id in self.timed_out
        self.timed_out.discard(job.id)
        killed_for_stop = job.id in self.killed_for_stop
        self.killed_for_stop.discard(job.id)
        verdict = settle.settle(
            settle.Attempt(
                attempt=job.attempt,
                max_attempts=self.cfg.eval.max_attempts,
                remaining=remaining,
                rc=rc,
                now=now,
                backoff_seconds=self.cfg.eval.retry_backoff_seconds,
                killed_for_stop=killed_for_stop,
                timed_out_after=self.cfg.eval.timeout_seconds if timed_out else None,
                checkpoint_gone=gone,
                task_errors=[
                    f"{t['task']}: {outcomes[(t['task'], t['num_fewshot'])]['error']}"
                    for t in remaining
                    if (t["task"], t["num_fewshot"]) in outcomes
                ],
                crash_error=crash.get("error") if crash else None,
                heals=not permanent,
                log_tail=self._log_tail(job),
            )
        )
        if verdict.kind == "ok":
            self._finish(job, "ok", now)
            log.info("job.ok", job_id=job.id, run=job.run, step=job.step)
        elif verdict.kind == "requeue":
            self._requeue(job, remaining, attempt=verdict.attempt, error=verdict.reason)
            log.info("job.requeued", job_id=job.id, reason="shutdown")
        elif verdict.kind == "missed":
            self.state.update_job(job.id, state="skipped", error=verdict.reason, pid=None)
            self.state.upsert_checkpoint(
                job.location, self._source_name(job), now, state="missed", reason=verdict.reason
            )
            log.warning("checkpoint.missed", location=job.location, run=job.run, step=job.step)
        elif verdict.kind == "retry":
            self._requeue(
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
            self._fail(job, remaining, outcomes, verdict, now)

    def _fail(
        self,
        job: Job,
        remaining: list[dict[str, Any]],
        outcomes: dict[tuple[str, Any], dict[str, Any]],
        verdict: settle.Verdict,
        now: float,
    ) -> None:
        """A `failed` ledger line for each task still due, then the job ends failed."""
        for t in remaining:
            o = outcomes.get(
                (t["task"], t["num_fewshot"]), {"task": t["task"], "num_fewshot": t["num_fewshot"]}
            )
            self._append(job, o, "failed", verdict.error)
        self.failures += 1
        self._finish(job, "failed", now, error=verdict.reason)

    def _requeue(
        self,
        job: Job,
        tasks: list[dict[str, Any]],
        *,
        attempt: int,
        error: str,
        not_before: float = 0.0,
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

    def _log_tail(self, job: Job) -> str:
        path = job_dir(self.cfg.state_dir, job.id, job.attempt) / "worker.log"
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def _finish(self, job: Job, state: str, now: float, error: str | None = None) -> None:
        self.state.update_job(job.id, state=state, finished_at=now, error=error, pid=None)
        if self.state.jobs("queued", "running", location=job.location):
            return  # other parts of a split checkpoint are still due
        source = self._source_name(job)
        self.discovery.release(source, job.location)
        row = self.state.checkpoint(job.location)
        if row is None:
            return
        mark = planner.after_jobs(
            row["state"],
            self._due(job, self.all_tasks),
            [j.error for j in self.state.jobs("failed", location=job.location) if j.error],
        )
        if mark is not None:
            self.state.upsert_checkpoint(
                job.location, row["source"], now, state=mark.state, reason=mark.reason
            )

    # --- two-stage shutdown --------------------------------------------------------------------
    def kill_for_stop(self) -> None:
        """Kill every running worker now; their jobs are re-queued, never marked ok."""
        for job in self.state.jobs("running"):
            if job.id in self.killed_for_stop:
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
