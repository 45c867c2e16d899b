"""`python -m ckpt_watcher.worker JOB_DIR` | `--serve HOME SETTINGS_JSON` |
`--starter JOBS_ROOT DAEMON_PID` (see the package)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import structlog

from ckpt_watcher import scratch
from ckpt_watcher.jobfolder import DIE_WITH_PARENT_ENV, STARTER_NAME, WORKER_NAME
from ckpt_watcher.proctable import set_name
from ckpt_watcher.worker import lifeline


def configure_logging() -> None:
    """Plain text lines on stdout, which is the job's `worker.log`."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.dev.ConsoleRenderer(
                colors=False, exception_formatter=structlog.dev.plain_traceback
            ),
        ],
        logger_factory=structlog.WriteLoggerFactory(file=sys.stdout),  # a line in one write
        cache_logger_on_first_use=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    configure_logging()
    if len(args) == 3 and args[0] == "--serve":
        from ckpt_watcher.worker.serve import serve

        return serve(Path(args[1]), json.loads(args[2]))
    if len(args) != 1:
        sys.stderr.write(
            "usage: python -m ckpt_watcher.worker JOB_DIR\n"
            "       python -m ckpt_watcher.worker --serve HOME SETTINGS_JSON\n"
            "       python -m ckpt_watcher.worker --starter JOBS_ROOT DAEMON_PID\n"
        )
        return 2
    from ckpt_watcher.jobfolder import JobFolder
    from ckpt_watcher.worker.job import run_job

    rc = run_job(Path(args[0]))
    JobFolder(Path(args[0])).write_exit(rc)
    return rc


if __name__ == "__main__":
    from ckpt_watcher.evaluators.lm_eval_internals import without_sklearn_in_generation

    without_sklearn_in_generation()  # before the starter's imports, or a worker's own
    forked: list[str] | None = None
    if sys.argv[1:2] == ["--starter"]:  # JOBS_ROOT is there for recovery to tell whose it is
        from ckpt_watcher.worker.starter import serve as serve_forks

        lifeline.die_with_parent(int(sys.argv[3]))  # not its workers: they outlive a daemon
        set_name(STARTER_NAME)
        forked = serve_forks()  # returns only in a worker it forked (starter.py): its arguments
        if forked is None:  # the daemon is gone or going: at once (nothing to flush or finalize)
            os._exit(0)
    parent = os.environ.pop(DIE_WITH_PARENT_ENV, None)  # not for what it starts
    if parent:  # a Ray node's agent started it (executors/node_agent.py): it goes with the agent,
        # or with the agent's worker starter that forked it (which goes with the agent)
        from ckpt_watcher.worker import starter

        lifeline.die_with_parent(starter.forked_from or int(parent))
    set_name(WORKER_NAME)
    lifeline.arm()  # what it forks (vLLM's engine on CUDA) dies with it
    tmp = scratch.enter()  # before anything can create a temporary file (vLLM's sockets)
    rc = main(forked)
    scratch.leave(tmp)  # after a kill, the daemon removes it when it reaps the worker
    # Its results are written and synced, its children die with it (lifeline): it ends now.
    # An interpreter's own teardown (the last collection over torch's, transformers' and
    # lm-eval's objects, atexit handlers) took 1.4 s of every worker's exit here, with nothing
    # left to do, and is where a process holding vLLM may hang.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
