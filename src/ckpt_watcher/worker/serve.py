"""A warm worker: `python -m ckpt_watcher.worker --serve HOME SETTINGS_JSON`.

One long-lived process per device (`executors/warm.py` starts it). It reads job folders from
stdin, one line each, runs each exactly like a one-shot worker (`job.run_job`, same outcome
files, same crash file) but keeps its engine between jobs (`evaluators/keeper.py`), and the model
server of served harnesses too (`harnesses/server.py`), and reports
each job's exit code as a status line on the file descriptor named by STATUS_FD_ENV (both in
`jobfolder`). A `prepare` line starts an engine before its checkpoint's weights exist
(`early.py`); its status line says whether it is ready (0) or not. While a job runs, its stdout and stderr go to that job's `worker.log`.

It releases its engine and exits when stdin closes (the daemon stopped or died: the job in
hand is finished first, and a daemon started meanwhile adopts it), after `idle_seconds` without
a job, and on SIGTERM. `HOME/engine.json` says what it holds, for `watcher status`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher.durable import write_json_atomic
from ckpt_watcher.jobfolder import (
    ENGINE_FILE,
    EXIT_CRASH,
    KILLED_FILE,
    LOG_FILE,
    PLACEHOLDER_DIR,
    PREPARE_PREFIX,
    STATUS_FD_ENV,
    WARM_FAILING_JOBS,
    JobFolder,
    status_line,
)
from ckpt_watcher.worker.early import prepare
from ckpt_watcher.worker.job import run_job

log = structlog.get_logger("ckpt_watcher.worker.serve")


class Lines:
    """The lines of a file descriptor (the worker's stdin), each as soon as it is whole.

    Not `select` on stdin and then `sys.stdin.readline()`: two lines that come in one read
    (a request for an engine ahead of its weights and, at once, the job of that step: the
    daemon sends both in one pass) leave the second in the text buffer, where `select` on the
    descriptor does not see it, and the job waits for ever."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def next(self, timeout: float) -> str | None:
        """The next line, with its newline; "" once the descriptor is closed (a last line
        without its newline is dropped: never a half-written job); None when no line came
        within `timeout` seconds."""
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return ""
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode("utf-8", errors="replace") + "\n"


def _redirect_output(path: Path) -> None:
    """Point fds 1 and 2 (ours and what we start from now on) at `path`, appending."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


class Failing:
    """The jobs that crashed in a row on this device's warm workers (kept in engine.json, so a
    worker that died mid-job is counted by the next one); a job that ends ok clears it."""

    def __init__(self, before: dict[str, Any], killed: str | None) -> None:
        """`before`: the last engine.json; `killed`: the pid the daemon killed on purpose."""
        kept = before.get("failing") or {}
        self.jobs: list[str] = list(kept.get("jobs") or [])
        self.last: str | None = kept.get("last")
        died = before.get("state") == "busy" and before.get("job")
        if died and str(before.get("pid")) != killed:  # died with its job, not killed by us
            self.add(str(before["job"]), f"the warm worker (pid {before.get('pid')}) died in it")

    def add(self, job: str, why: str) -> None:
        if job not in self.jobs:
            self.jobs.append(job)
        self.last = f"job {job}: {why}"

    def ended(self, job: str, rc: int) -> None:
        if rc == EXIT_CRASH:
            self.add(job, f"exit {rc} (crash.json in its folder says why)")
        else:  # ok, or a task's own failure: the engine did its part
            self.jobs, self.last = [], None

    def as_dict(self) -> dict[str, Any]:
        return {"jobs": self.jobs[-WARM_FAILING_JOBS:], "last": self.last}


def _describe(
    home: Path,
    keeper: Any,
    device: str,
    state: str,
    job: str | None,
    failing: Failing,
    ready_for: str | None = None,
) -> None:
    write_json_atomic(
        home / ENGINE_FILE,
        {
            "pid": os.getpid(),
            "device": device,
            "state": state,  # busy | idle | preparing | ready | released
            "job": job,
            "checkpoint": keeper.checkpoint,
            "ready_for": ready_for if keeper.ahead or state == "preparing" else None,
            "since": time.time(),
            "swaps": sum(keeper.swaps.values()),
            "swaps_by_signature": keeper.swaps,
            "cold_for_good": keeper.cold_for_good,
            "events": keeper.events,
            "failing": failing.as_dict(),
        },
    )


def _release_on_sigterm(*_: Any) -> None:
    raise SystemExit(0)


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def handle_sigterm() -> None:
    """SIGTERM releases the engine and ends the worker (through SystemExit, so `finally` runs).

    Processes forked from here (lm-eval's bootstrap Pool) must still die on SIGTERM as under a
    one-shot worker: a child that inherits the handler turns Pool.terminate()'s SIGTERM into a
    SystemExit that it may never act on while blocked on the pool's queue lock, and the job then
    hangs in Pool.__exit__ (seen in CI; here 2 of 4 loops of 200 pools hung)."""
    signal.signal(signal.SIGTERM, _release_on_sigterm)
    os.register_at_fork(after_in_child=_default_sigterm)


def serve(home: Path, settings: dict[str, Any]) -> int:
    from ckpt_watcher.evaluators.keeper import EngineKeeper
    from ckpt_watcher.harnesses.server import Servers

    home.mkdir(parents=True, exist_ok=True)
    status_fd = int(os.environ[STATUS_FD_ENV])
    idle_seconds = float(settings["idle_seconds"])
    device = str(settings["device"])
    keeper = EngineKeeper(verify_every=int(settings["verify_every"]))
    before: dict[str, Any] = {}
    try:  # this device's earlier workers: an architecture that failed its check stays cold for
        # good, and one already checked is checked again after verify_every swaps, not at once
        before = json.loads((home / ENGINE_FILE).read_text(encoding="utf-8"))
        keeper.cold_for_good.update(before.get("cold_for_good") or {})
        keeper.swaps.update(before.get("swaps_by_signature") or {})
    except (OSError, ValueError):
        pass
    try:
        killed: str | None = (home / KILLED_FILE).read_text(encoding="utf-8").strip()
        (home / KILLED_FILE).unlink()
    except OSError:
        killed = None
    failing = Failing(before, killed)
    servers = Servers(keeper)  # the model server of served harnesses, kept as the engine is

    handle_sigterm()
    own_log = home / LOG_FILE
    reason = "stdin closed"
    in_job = False
    try:
        _describe(home, keeper, device, "idle", None, failing)
        lines = Lines(sys.stdin.fileno())
        while True:
            line = lines.next(idle_seconds)
            if line is None:
                reason = f"idle for {idle_seconds:g} s"
                break
            if not line:
                break
            if line.startswith(PREPARE_PREFIX):  # an engine ahead of its weights: no report
                folder = JobFolder(Path(line[len(PREPARE_PREFIX) :].strip()))
                run = folder.path.name
                try:
                    run = folder.read_spec().job_id
                    _describe(home, keeper, device, "preparing", None, failing, run)
                    prepare(folder, home / PLACEHOLDER_DIR, keeper)
                except Exception as e:  # the step's files moved on, an engine that would
                    # not start: its checkpoint loads cold when it comes, as without
                    log.warning("engine.prepare_failed", run=run, error=f"{type(e).__name__}: {e}")
                    keeper.drop()
                now = "ready" if keeper.ahead else "idle"
                _describe(home, keeper, device, now, None, failing, run)
                try:  # 0: ready; the daemon's idle clock for this worker starts now
                    os.write(status_fd, status_line(0 if keeper.ahead else 1, folder.path))
                except BrokenPipeError:
                    reason = "the daemon is gone"
                    break
                continue
            job_dir = Path(line.strip())
            folder = JobFolder(job_dir)
            _redirect_output(folder.log)
            _describe(home, keeper, device, "busy", job_dir.parent.name, failing)
            in_job = True
            try:
                rc = run_job(job_dir, keeper, servers)
            except Exception:  # spec unreadable and the like: a crash of this job only
                log.exception("worker.crashed")
                keeper.drop()
                servers.stop()
                rc = EXIT_CRASH
            folder.write_exit(rc)
            in_job = False
            failing.ended(job_dir.parent.name, rc)
            _redirect_output(own_log)
            _describe(home, keeper, device, "idle", None, failing)
            try:
                os.write(status_fd, status_line(rc, job_dir))
            except BrokenPipeError:  # the daemon died: a new one reads the job's exit file
                reason = "the daemon is gone"
                break
    except SystemExit:
        reason = "SIGTERM"
    finally:
        log.info("engine.released", device=device, reason=reason, checkpoint=keeper.checkpoint)
        keeper.drop(exiting=True)
        servers.stop()
        _describe(home, keeper, device, "released", None, failing)
    return 128 + signal.SIGTERM if in_job else 0  # a job cut short must not read as a success
