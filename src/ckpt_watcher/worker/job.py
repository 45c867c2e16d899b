"""One job in a worker: read the job folder's spec, stage the checkpoint if it is remote, run
every task on it with the model loaded once (or swapped into a warm engine), and write each
task's outcome as it finishes, so a crash later in the job keeps the tasks already done. The
daemon reads the outcomes and is the only writer of the ledger. The exit code says how the job
ended (`jobfolder.EXIT_*`); what stopped a whole job goes in the folder's crash file.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from ckpt_watcher.jobfolder import EXIT_CRASH, EXIT_OK, EXIT_TASK_FAILED, Crash, JobFolder

if TYPE_CHECKING:
    from ckpt_watcher.evaluators.keeper import EngineKeeper
    from ckpt_watcher.jobfolder import Progress, TaskOutcome

PROGRESS_EVERY_SECONDS = 1.0

log = structlog.get_logger("ckpt_watcher.worker")


def _record_crash(folder: JobFolder, e: BaseException) -> None:
    """What stopped the whole job (staging, loading the model), classified like a task's error."""
    from ckpt_watcher.evaluators.failures import classify

    failure = classify(e)
    folder.write_crash(Crash(failure.error, failure.heals))


def run_job(job_dir: Path, keeper: EngineKeeper | None = None) -> int:
    """One job: stage, load (or have `keeper` swap in) the checkpoint, run its tasks."""
    folder = JobFolder(job_dir)
    spec = folder.read_spec()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The daemon decided the device; we only read it.
    log.info(
        "worker.started",
        pid=os.getpid(),
        job_id=spec.job_id,
        device=spec.device_label,
        CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        warm=keeper is not None,
    )
    from ckpt_watcher.evaluators.harness import run_tasks

    req = spec.request
    if spec.stage is not None:
        from ckpt_watcher.sources.staging import stage as stage_checkpoint

        try:
            local = stage_checkpoint(
                spec.stage.location,
                Path(spec.stage.cache_dir),
                spec.stage.endpoint_url,
                request_timeout=spec.stage.request_timeout,
            )
        except Exception as e:
            log.exception("worker.staging_failed", location=spec.stage.location)
            _record_crash(folder, e)
            return EXIT_CRASH
        log.info("worker.staged", location=spec.stage.location, path=str(local))
        req = dataclasses.replace(req, checkpoint=str(local))
    index = {t.key: i for i, t in enumerate(req.tasks)}

    last_progress = [0.0]

    def progress(now: Progress) -> None:  # at most once a second, and at each task's end
        if now.done >= now.total or now.at - last_progress[0] >= PROGRESS_EVERY_SECONDS:
            folder.write_progress(now)
            last_progress[0] = now.at

    def record(outcome: TaskOutcome) -> None:
        folder.write_outcome(index[outcome.key], outcome)
        log.info(
            "worker.task_done",
            task=outcome.task,
            num_fewshot=outcome.num_fewshot,
            status=outcome.status,
            error=outcome.error,
        )

    try:
        engine = keeper.acquire(req) if keeper is not None else None
        if engine is not None:
            log.info("worker.engine", engine=engine.kind, seconds=round(engine.seconds, 3))
        outcomes = run_tasks(req, record, engine, progress, spec.device_label)
        failed = [o for o in outcomes if o.status == "failed" and o.heals]
        if keeper is not None and engine is not None and engine.kind == "warm" and failed:
            # a task that failed on a swapped engine (and might not fail again) gets a cold
            # engine before its failure counts
            log.warning("worker.warm_task_failed", tasks=[o.task for o in failed])
            keeper.drop()
            retry = {o.key for o in failed}
            sub = dataclasses.replace(req, tasks=[t for t in req.tasks if t.key in retry])
            again = {
                o.key: o
                for o in run_tasks(sub, record, keeper.acquire(sub), progress, spec.device_label)
            }
            outcomes = [again.get(o.key, o) for o in outcomes]
    except Exception as e:
        log.exception("worker.crashed")
        _record_crash(folder, e)
        if keeper is not None:  # whatever broke may have broken the engine: start cold next
            keeper.drop()
        return EXIT_CRASH
    return EXIT_OK if all(o.status != "failed" for o in outcomes) else EXIT_TASK_FAILED
