"""Dispatch: queue the planner's jobs, and start the next ones on free devices.

A job starts in three steps, in this order: its attempt's folder gets the spec (what to
evaluate, where, how); the job row goes `running` (committed: a crash from here on leaves a job
for recovery to find); then the executor starts its worker. When more devices are free than
jobs wait, a checkpoint's tasks are first split over the spare devices (`scheduler.split_plan`);
devices still free then help running jobs (`helpers.py`).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable

import structlog

from ckpt_watcher import planner, scheduler
from ckpt_watcher.config import BASELINE_RUN, WatcherConfig
from ckpt_watcher.devices import Device
from ckpt_watcher.discovery import Discovery
from ckpt_watcher.errors import CheckpointChanged
from ckpt_watcher.executors.base import Executor
from ckpt_watcher.jobfolder import EvalRequest, JobFolder, JobSpec, TaskRun
from ckpt_watcher.jobs.book import JobBook
from ckpt_watcher.jobs.helpers import Helpers
from ckpt_watcher.pins import Pins
from ckpt_watcher.state import Job, State

log = structlog.get_logger("ckpt_watcher.jobs")

PIN_BUDGET_SECONDS = 10.0  # how often the pins' disk is looked at with no pin made


class Dispatcher:
    def __init__(
        self,
        cfg: WatcherConfig,
        state: State,
        executor: Executor,
        discovery: Discovery,
        book: JobBook,
        clock: Callable[[], float],
        pins: Pins,
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.executor = executor
        self.discovery = discovery
        self.book = book
        self.clock = clock
        self.helpers = Helpers(state, executor, cfg.state_dir, clock)
        self.pins = pins
        self.on_skipped: Callable[[str], None] = lambda reason: None  # a checkpoint skipped
        self._next_pin_budget = 0.0

    def queue(self, q: planner.QueueJob, now: float) -> Job | None:
        """Carry out a planner QueueJob; None when its checkpoint turned out to have changed
        since it was judged ready (it is judged again, and planned then)."""
        job = Job(
            id=f"{q.run}-{q.step if q.step is not None else q.label}-{uuid.uuid4().hex[:8]}",
            location=q.location,
            run=q.run,
            step=q.step,
            label=q.label,
            tasks=q.tasks,
            settings_hash=self.book.settings_hash,
            created_at=now,
            order_key=q.order_key,
            run_path=q.run_path,
            fingerprint=q.fingerprint,
            write_mark=q.write_mark,
        )
        self.state.add_job(job)
        try:
            self._hold(job, now)
        except CheckpointChanged as e:
            self.state.delete_job(job.id)
            self.discovery.look_again(self.book.source_name(job), job.location, now, str(e))
            return None
        log.info(
            "job.queued", job_id=job.id, run=q.run, step=q.step, tasks=[t["task"] for t in q.tasks]
        )
        return job

    def _hold(self, job: Job, now: float) -> None:
        """The job's checkpoint is due: hold its files until its results are in, so a trainer's
        keep-last-k cannot take them (local: pins; S3: its source stages them now)."""
        if job.run_path == BASELINE_RUN or not self.cfg.policy.pin:
            return
        if job.location.startswith("s3://"):
            self.discovery.hold(self.book.source_name(job), job.location)
        elif self.pins.pin(job.location, job.fingerprint, now, job.write_mark) is not None:
            self._keep_pins_within_budget(now, spare=job.location)

    def pin_budget_due(self) -> None:
        """A pinned checkpoint was deleted: look at the pins' disk at the next pass."""
        self._next_pin_budget = 0.0

    def enforce_pin_budget(self, now: float) -> None:
        """policy.pin_max_gb, looked at every PIN_BUDGET_SECONDS and when a pinned checkpoint
        is deleted: pins cost disk once the trainer deletes its own names of their files,
        which happens with no pin made."""
        if self.pins.max_bytes is None or now < self._next_pin_budget:
            return
        self._next_pin_budget = now + PIN_BUDGET_SECONDS
        self._keep_pins_within_budget(now)

    def _keep_pins_within_budget(self, now: float, spare: str | None = None) -> None:
        """Over policy.pin_max_gb: the oldest pins of checkpoints not started go, and those
        checkpoints are skipped (visibly), rather than evaluated unprotected."""
        spared = {j.location for j in self.state.jobs("running")}
        if spare is not None:  # the checkpoint just pinned: its job is next in line
            spared.add(spare)
        for location in self.pins.keep_within_budget(spared):
            for waiting in self.state.jobs("queued", location=location):
                self.book.skip(waiting, "pin budget (policy.pin_max_gb)", now)
            self.on_skipped("pin budget")

    def enforce_backlog(self, now: float) -> list[str]:
        """policy.backlog: per run, at most `max_pending` checkpoints wait; the others are
        skipped as `overflow` says (planner.backlog_skips). Returns the locations skipped."""
        policy = self.cfg.policy.backlog
        if policy.max_pending is None or policy.overflow == "keep":
            return []
        queued = [j for j in self.state.jobs("queued") if j.run_path != BASELINE_RUN]
        by_run: dict[str, dict[str, Job]] = {}
        for job in queued:
            by_run.setdefault(job.run_path, {}).setdefault(job.location, job)
        skipped = []
        for run_path, jobs in by_run.items():
            if len(jobs) <= policy.max_pending:
                continue
            started = [
                j.order_key
                for j in self.state.jobs("running", "ok")
                if j.run_path == run_path and j.location not in jobs
            ]
            pending = [
                planner.Pending(loc, j.order_key, j.order_key != int(j.order_key) or j.step is None)
                for loc, j in jobs.items()
            ]
            reason = f"backlog ({policy.overflow}, max_pending {policy.max_pending})"
            for location in planner.backlog_skips(
                pending, max(started, default=None), policy.max_pending, policy.overflow
            ):
                for job in (j for j in queued if j.location == location):
                    self.book.skip(job, reason, now)
                skipped.append(location)
                self.on_skipped("backlog")
        return skipped

    def dispatch(
        self,
        now: float,
        free: list[Device],
        may_start: Callable[[float], bool],
        prefer: dict[str, str] | None = None,
    ) -> None:
        """Give free devices their next jobs (splitting a checkpoint over spare devices); the
        devices still free then join running jobs' tasks (helpers); helpers give their devices
        back to queued jobs that have none. `may_start` is asked before jobs start (no: none
        starts, as while the ledger folder cannot be written). `prefer`: run path -> the device
        whose engine waits for that run (scheduler.assign)."""
        queued = self.state.jobs("queued")
        self.pins.sweep({j.location for j in queued + self.state.jobs("running")})
        eligible = scheduler.eligible(queued, now)
        self.helpers.reap(devices_wanted=len(eligible) - len(free))
        if not free:
            return
        if self._split(eligible, len(free), now):
            queued = self.state.jobs("queued")
        if self.pins.max_bytes is not None and eligible:
            # before a job starts from its pin: the pins' disk (the trainer may have deleted
            # what they hold since), so a checkpoint over budget is skipped, not started
            self._keep_pins_within_budget(now)
            queued = self.state.jobs("queued")
        assignments = scheduler.assign(queued, free, now, self.cfg.policy.order, prefer)
        if assignments and not may_start(now):
            return
        if assignments:
            needed: dict[str, list[str]] = {}
            for job in queued + self.state.jobs("running"):
                needed.setdefault(self.book.source_name(job), []).append(job.location)
            self.discovery.make_room(needed)  # staged copies of jobs that are due stay
            for job, device in assignments:
                self._start(job, device)
        taken = {device.id for _, device in assignments}
        # an engine there waits for the next job of a run that has none running: no helper of
        # another run's job takes its device (a helper of a running run's job may: its model)
        running = {j.run_path for j in self.state.jobs("running")}
        waiting = {d for run, d in (prefer or {}).items() if run not in running}
        spare = [d for d in free if d.id not in taken and d.label not in waiting]
        self.helpers.start(spare, self.helper_spec)

    def _split(self, eligible: list[Job], free: int, now: float) -> bool:
        """Spread one checkpoint's tasks over spare devices (see scheduler.split_plan)."""
        plan = scheduler.split_plan(
            eligible, free, lambda t: self.book.ledger.estimate(t["task"], t["num_fewshot"])
        )
        for job_id, groups in plan.items():
            job = next(j for j in eligible if j.id == job_id)
            self.state.update_job(job.id, tasks=groups[0])
            for i, group in enumerate(groups[1:], start=1):
                self.state.add_job(job.part(i, group, now))
            log.info("job.split", job_id=job.id, parts=[[t["task"] for t in g] for g in groups])
        return bool(plan)

    def helper_spec(self, job: Job, device: Device) -> JobSpec | None:
        """What a helper of `job` runs on `device`: the job's tasks still due that keep a
        journal (None: none). The helper joins each once the job's own worker has begun it
        (resume.py): nothing here makes a journal for a task nobody has begun."""
        spec = self.spec(job, device, self.book.due(job))
        shared = [t for t in spec.request.tasks if t.journal is not None and t.harness == "lm-eval"]
        if not shared:
            return None
        return dataclasses.replace(spec, request=dataclasses.replace(spec.request, tasks=shared))

    def spec(self, job: Job, device: Device, tasks: list[dict] | None = None) -> JobSpec:
        """What the job's worker is asked to do on `device`."""
        ev = self.cfg.eval
        folder = f"step_{job.step}" if job.step is not None else job.label
        request = EvalRequest(
            checkpoint=self.pins.path(job.location) or job.location,
            backend=ev.backend,
            model_args=ev.model_args,
            tasks=[
                TaskRun.from_entry(t, self.book.journal_ref(job, t))
                for t in (job.tasks if tasks is None else tasks)
            ],
            seed=ev.seed,
            gen_kwargs=ev.gen_kwargs,
            max_gen_toks=ev.max_gen_toks,
            include_path=str(ev.include_path) if ev.include_path else None,
            batch_size=ev.batch_size,
            limit=ev.limit,
            results_dir=str((self.cfg.ledger_dir / job.run_path / folder).resolve()),
            device=device.compute,
            tensor_parallel_size=ev.tensor_parallel_size,
            compile_cache=str(self.cfg.compile_cache),
            adapter_base=self.discovery.adapter_base(self.book.source_name(job)),
            convert=self.discovery.convert(self.book.source_name(job)),
            serve_adapters=ev.serve_adapters,
        )
        stage = self.discovery.stage_spec(self.book.source_name(job), job.location)
        return JobSpec(
            job.id,
            device.label,
            request,
            stage,
            write_mark=job.write_mark,
            fingerprint=job.fingerprint,
            run_path=job.run_path,
        )

    def _start(self, job: Job, device: Device) -> None:
        attempt = job.attempt + 1
        folder = JobFolder.of(self.cfg.state_dir, job.id, attempt)
        folder.write_spec(self.spec(job, device))
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
        try:
            handle = self.executor.start(job.id, folder, device.worker_env())
        except OSError as e:
            self.book.requeue(job, job.tasks, attempt=job.attempt, error=f"could not start: {e}")
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
