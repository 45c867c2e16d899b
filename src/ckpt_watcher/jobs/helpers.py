"""Helpers: devices left idle join a running job's tasks, so one long task is spread over them.

When devices are still free after every eligible queued job has one, each starts a helper: a
worker on that device for a running job's journaled tasks. It claims chunks from the tasks'
journals beside the job's own worker (`evaluators/resume.py`) and leaves when none is left to
claim; the job's own worker waits for the chunks helpers hold, computes the metrics once from
the complete journal, and its ledger line names every device that computed (`devices`).

A helper is not a job: it has no ledger line, no attempt and no retry. It is killed when its
job ends (done, failed; a job queued for another attempt keeps its helpers), when a queued job
needs its device, and when the daemon stops; its chunk in hand then goes back to the queue (a claim whose holder died
is taken over). A device helps one attempt of a job at most once. A daemon that restarts kills
the helpers it finds (recovery's strays) and starts new ones where devices are idle.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from ckpt_watcher import scheduler
from ckpt_watcher.devices import Device
from ckpt_watcher.executors.base import Executor
from ckpt_watcher.jobfolder import JobFolder, JobSpec
from ckpt_watcher.state import Job, State

log = structlog.get_logger("ckpt_watcher.jobs")


@dataclass
class Helper:
    id: str  # the executor's name for it
    job_id: str
    attempt: int
    device: Device
    pid: int
    started_at: float


class Helpers:
    def __init__(
        self,
        state: State,
        executor: Executor,
        state_dir: Path,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state = state
        self.executor = executor
        self.state_dir = state_dir
        self.clock = clock
        self.active: dict[str, Helper] = {}
        self.killed: set[str] = set()  # helpers told to go, whose exit is not in yet
        self.tried: set[tuple[str, int, str]] = set()  # (job id, attempt, device id)

    # --- what the daemon needs to know -------------------------------------------------------
    def device_ids(self) -> list[str]:
        return [h.device.id for h in self.active.values()]

    def pids(self) -> set[int]:
        return {h.pid for h in self.active.values() if h.pid}

    # --- starting and ending -----------------------------------------------------------------
    def start(
        self,
        spare: list[Device],
        spec: Callable[[Job, Device], JobSpec | None],
    ) -> None:
        """Spare devices join running jobs (`scheduler.help_plan`); `spec` is what a helper of
        the job on that device runs (None: nothing of the job can be shared)."""
        if not spare or not self.executor.shares_journals:
            return
        helping: dict[str, int] = {}
        for h in self.active.values():
            helping[h.job_id] = helping.get(h.job_id, 0) + 1
        plan = scheduler.help_plan(self.state.jobs("running"), spare, helping, self.tried)
        for job, device in plan:
            self.tried.add((job.id, job.attempt, device.id))
            job_spec = spec(job, device)
            if job_spec is None:
                continue
            folder = JobFolder.helper(self.state_dir, job.id, job.attempt, device.label)
            helper_id = f"{job.id}.help-{device.label}.{job.attempt}"
            job_spec = dataclasses.replace(
                job_spec,
                job_id=helper_id,
                request=dataclasses.replace(job_spec.request, helps=job.id),
            )
            folder.write_spec(job_spec)
            try:
                handle = self.executor.start(helper_id, folder, device.worker_env())
            except OSError as e:
                log.warning(
                    "eval.helper_start_failed", job_id=job.id, device=device.label, error=str(e)
                )
                continue
            self.active[helper_id] = Helper(
                helper_id, job.id, job.attempt, device, handle.pid, self.clock()
            )
            log.info(
                "eval.helping",
                job_id=job.id,
                run=job.run,
                step=job.step,
                device=device.label,
                pid=handle.pid,
                tasks=[t.task for t in job_spec.request.tasks],
            )
        self._publish()

    def exited(self, helper_id: str, rc: int) -> bool:
        """True if `helper_id` was a helper (its exit is handled here: nothing to file)."""
        h = self.active.pop(helper_id, None)
        if h is None:
            return False
        self.killed.discard(helper_id)
        log.info("eval.helper_done", job_id=h.job_id, device=h.device.label, rc=rc)
        self._publish()
        return True

    def reap(self, devices_wanted: int) -> None:
        """Kill helpers whose job has ended (a job queued for its next attempt keeps them: what
        they journal counts for it), and up to `devices_wanted` more (newest first) to free
        devices for queued jobs."""
        alive = {j.id for j in self.state.jobs("queued", "running")}
        live = [h for h in self.active.values() if h.id not in self.killed]
        ended = [h for h in live if h.job_id not in alive]
        rest = sorted((h for h in live if h.job_id in alive), key=lambda h: h.started_at)
        for h in ended:
            self._kill(h, "its job ended")
        wanted = devices_wanted - len(self.killed)
        for h in rest[-wanted:] if wanted > 0 else []:
            self._kill(h, "a queued job needs the device")

    def give_back(self, busy: dict[str, str]) -> None:
        """devices.yield_to_others: helpers on a device another process now uses go."""
        for h in list(self.active.values()):
            if h.device.id in busy and h.id not in self.killed:
                self._kill(h, f"another process uses the device ({busy[h.device.id]})")

    def stop_all(self) -> None:
        for h in list(self.active.values()):
            self._kill(h, "the daemon stops")

    def _kill(self, h: Helper, why: str) -> None:
        log.info("eval.helper_stopped", job_id=h.job_id, device=h.device.label, why=why)
        self.killed.add(h.id)
        self.executor.kill(h.id)

    def _publish(self) -> None:
        """For `watcher status`: which devices help which job."""
        self.state.set_meta(
            helpers=[
                {"job_id": h.job_id, "device": h.device.label, "pid": h.pid}
                for h in self.active.values()
            ]
        )
