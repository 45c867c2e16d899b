"""The worker process: `python -m ckpt_watcher.worker JOB_DIR`.

Reads `JOB_DIR/spec.json`, stages the checkpoint if it is remote, runs every task on it with the
model loaded once, and writes one outcome file per task (`outcome-<i>.json`, tmp + fsync +
rename) as it finishes, so a crash later in the job keeps the tasks already done. The daemon
reads the outcomes and is the only writer of the ledger. Exit codes: 0 all tasks ok, 3 some
task failed, 4 a crash (the traceback ends the log, whose last line the daemon quotes).

Logs go to stdout (the job's `worker.log`) through structlog, as plain text lines.

`--serve HOME SETTINGS` runs a warm worker instead (`warm_worker.py`): one process per device that
takes job folders one after another and keeps its engine between them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from ckpt_watcher.durable import write_json_atomic
from ckpt_watcher.evaluators import heap
from ckpt_watcher.executors.base import CRASH_FILE

if TYPE_CHECKING:
    from ckpt_watcher.evaluators.warm import EngineKeeper

EXIT_OK = 0
EXIT_TASK_FAILED = 3
EXIT_CRASH = 4

log = structlog.get_logger("ckpt_watcher.worker")


def outcome_path(job_dir: Path, index: int) -> Path:
    return job_dir / f"outcome-{index}.json"


def _record_crash(job_dir: Path, e: BaseException) -> None:
    """What stopped the whole job (staging, loading the model), classified like a task's error."""
    from ckpt_watcher.evaluators.failures import classify

    failure = classify(e)
    write_json_atomic(job_dir / CRASH_FILE, {"error": failure.error, "heals": failure.heals})


def _configure_logging() -> None:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.dev.ConsoleRenderer(
                colors=False, exception_formatter=structlog.dev.plain_traceback
            ),
        ],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=True,
    )


def run_job(job_dir: Path, keeper: EngineKeeper | None = None) -> int:
    """One job: stage, load (or have `keeper` swap in) the checkpoint, run its tasks."""
    spec = json.loads((job_dir / "spec.json").read_text(encoding="utf-8"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The daemon decided the device; we only read it.
    log.info(
        "worker.started",
        pid=os.getpid(),
        job_id=spec["job_id"],
        device=spec["device_label"],
        CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        warm=keeper is not None,
    )
    from ckpt_watcher.evaluators.harness import EvalRequest, TaskOutcome, TaskRun, run_tasks

    req_fields = dict(spec["request"])
    stage = spec.get("stage")
    if stage:
        from ckpt_watcher.sources.staging import stage as stage_checkpoint

        try:
            local = stage_checkpoint(
                stage["location"],
                Path(stage["cache_dir"]),
                stage.get("endpoint_url"),
                request_timeout=stage.get("request_timeout", 30.0),
            )
        except Exception as e:
            log.exception("worker.staging_failed", location=stage["location"])
            _record_crash(job_dir, e)
            return EXIT_CRASH
        log.info("worker.staged", location=stage["location"], path=str(local))
        req_fields["checkpoint"] = str(local)
    req_fields["tasks"] = [TaskRun(**t) for t in req_fields["tasks"]]
    req = EvalRequest(**req_fields)
    index = {(t.task, t.num_fewshot): i for i, t in enumerate(req.tasks)}

    def record(outcome: TaskOutcome) -> None:
        path = outcome_path(job_dir, index[(outcome.task, outcome.num_fewshot)])
        write_json_atomic(path, dataclasses.asdict(outcome), default=str, indent=None)
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
        outcomes = run_tasks(req, record, engine)
        failed = [o for o in outcomes if o.status != "ok" and o.heals]
        if keeper is not None and engine is not None and engine.kind == "warm" and failed:
            # a task that failed on a swapped engine (and might not fail again) gets a cold
            # engine before its failure counts
            log.warning("worker.warm_task_failed", tasks=[o.task for o in failed])
            keeper.drop()
            retry = {(o.task, o.num_fewshot) for o in failed}
            sub = dataclasses.replace(
                req, tasks=[t for t in req.tasks if (t.task, t.num_fewshot) in retry]
            )
            again = {
                (o.task, o.num_fewshot): o for o in run_tasks(sub, record, keeper.acquire(sub))
            }
            outcomes = [again.get((o.task, o.num_fewshot), o) for o in outcomes]
    except Exception as e:
        log.exception("worker.crashed")
        _record_crash(job_dir, e)
        if keeper is not None:  # whatever broke may have broken the engine: start cold next
            keeper.drop()
        return EXIT_CRASH
    return EXIT_OK if all(o.status == "ok" for o in outcomes) else EXIT_TASK_FAILED


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    _configure_logging()
    if len(args) == 3 and args[0] == "--serve":
        from ckpt_watcher.warm_worker import serve

        return serve(Path(args[1]), json.loads(args[2]))
    if len(args) != 1:
        sys.stderr.write(
            "usage: python -m ckpt_watcher.worker JOB_DIR\n"
            "       python -m ckpt_watcher.worker --serve HOME SETTINGS_JSON\n"
        )
        return 2
    return run_job(Path(args[0]))


if __name__ == "__main__":
    rc = main()
    heap.thaw()
    sys.exit(rc)
