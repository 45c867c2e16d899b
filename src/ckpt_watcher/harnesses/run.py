"""One entry of another harness on one checkpoint, inside the job's worker.

The harness runs as a subprocess in its own interpreter (`interp.py`), in a folder of its own
beside lm-eval's result files, with the worker's device variables (so it sees exactly the job's
device), killed with the worker (PDEATHSIG) and at the entry's time-out. Where it talks to a
model over HTTP (verifiers; a command with `serve: true`), the worker serves the checkpoint
first (`server.py`, behind the entry's loopback proxy, `endpoint.py`); a server that dies or
hangs meanwhile ends the attempt with `ServerLost`, which is retried and resumes from the
journal. Its scores come from the files it writes, never its exit status alone; they become
one `TaskOutcome` (OLMES: one part per OLMES task), with per-sample records in the watcher's
own samples format for `watcher samples`.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from ckpt_watcher import redact
from ckpt_watcher.errors import AdapterNotServed, CheckpointChanged, EvalError, ServerLost
from ckpt_watcher.evaluators.failures import classify
from ckpt_watcher.evaluators.harness import safe_filename, write_samples
from ckpt_watcher.harnesses import interp, reaper
from ckpt_watcher.harnesses.base import LOG_NAME, Context, Harness
from ckpt_watcher.harnesses.command import COMMAND
from ckpt_watcher.harnesses.endpoint import serve
from ckpt_watcher.harnesses.olmes import OLMES
from ckpt_watcher.harnesses.verifiers import VERIFIERS
from ckpt_watcher.jobfolder import EvalRequest, Progress, TaskOutcome, TaskRun
from ckpt_watcher.timestamps import utcnow

if TYPE_CHECKING:
    from ckpt_watcher.harnesses.server import Servers

log = structlog.get_logger("ckpt_watcher.harnesses")

POLL_SECONDS = 0.5


HARNESSES: dict[str, Harness] = {"command": COMMAND, "verifiers": VERIFIERS, "olmes": OLMES}


def harness(kind: str) -> Harness:
    try:
        return HARNESSES[kind]
    except KeyError:
        raise EvalError(f"harness {kind!r} is not one this worker runs") from None


def run_entry(
    req: EvalRequest,
    servers: Servers,
    t: TaskRun,
    device_label: str,
    unchanged: Callable[[], None],
    on_progress: Callable[[Progress], None] | None = None,
    timeout: float | None = None,
) -> TaskOutcome:
    """Run entry `t` on `req.checkpoint`; its outcome (failed with the reason where it failed).
    `servers` serves the checkpoint for a harness that talks to a model over HTTP.
    `unchanged` raises CheckpointChanged when the checkpoint's files are no longer those judged
    (checked while it runs, and before its result counts)."""
    spec = dict(t.spec or {})
    h = harness(t.harness)
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H-%M-%S.%f")
    out = Path(req.results_dir) / f"{safe_filename(t.task)}_{t.harness}_{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    outcome = TaskOutcome(
        t.task,
        None,
        "failed",
        started_at=utcnow(),
        harness=t.harness,
        harness_version=t.harness_version,
        lm_eval_version="",
    )
    ctx = Context(
        spec,
        req.checkpoint,
        out,
        device_label,
        req.device,
        req.seed,
        req.limit,
    )
    began = time.time()
    time_limit = spec.get("timeout_seconds") or timeout
    with ExitStack() as stack:
        endpoint = None
        try:
            if h.served(spec):
                endpoint = stack.enter_context(serve(servers, spec, out, t.journal, time_limit))
                ctx.url, ctx.model = endpoint.url, endpoint.model
                outcome.engine = endpoint.engine
                outcome.engine_seconds = round(endpoint.ready_seconds, 3)

            def watch() -> None:
                """Once a second while the harness runs: the server's health, the progress."""
                if endpoint is None:
                    return
                endpoint.check()
                if on_progress is None:
                    return
                total = h.total(ctx) or 0
                done = endpoint.answered()
                on_progress(
                    Progress(
                        t.task,
                        done,
                        max(total, done),
                        "requests",
                        began,
                        endpoint.resumed,
                        time.time(),
                    )
                )

            rc = _run(h, ctx, unchanged, watch, time_limit)
            unchanged()
            if endpoint is not None:
                endpoint.ended()
            parsed = h.read(ctx, rc)
        except Exception as e:
            if isinstance(e, CheckpointChanged | AdapterNotServed):  # the job's to handle:
                raise  # (an adapter the server refuses is merged, and the entry run again)
            if isinstance(e, ServerLost):
                servers.stop()  # what is left of it; the next attempt starts a new one
            failure = classify(e)
            log.warning("harness.failed", task=t.task, harness=t.harness, error=failure.error)
            outcome.error, outcome.heals = failure.error, failure.heals
            outcome.finished_at = utcnow()
            return outcome
        finally:
            if endpoint is not None:
                outcome.resumed = endpoint.resumed
                outcome.clamped_requests = endpoint.clamped
            # its log and files stay in the ledger folder: without the keys it was given (the
            # model server never has them: only the harness's process gets the entry's env)
            secrets = redact.Redactor.of({"tasks": [spec]})
            for written in [out / LOG_NAME, *_text_files(out)]:
                redact.in_file(written, secrets)
    outcome.finished_at = utcnow()
    outcome.metrics, outcome.n_samples, outcome.parts = (
        parsed.metrics,
        parsed.n_samples,
        parsed.parts,
    )
    outcome.results_file = parsed.results_file
    if parsed.records:
        sfile = out / f"samples_{safe_filename(t.task)}.jsonl.gz"
        write_samples(sfile, parsed.records)
        outcome.samples_file = str(sfile)
    if parsed.error is not None:
        outcome.error = parsed.error
        outcome.heals = False
        return outcome
    outcome.status = "ok"
    return outcome


def _text_files(out: Path) -> list[Path]:
    """What a harness wrote in its results folder that may quote its settings (OLMES's metrics
    keep its model arguments): its JSON and text files."""
    text = (".json", ".jsonl", ".txt", ".log", ".csv", ".tsv", ".yaml", ".yml", ".md")
    return [p for p in out.rglob("*") if p.suffix in text and p.is_file()]


def _run(
    h: Harness,
    ctx: Context,
    unchanged: Callable[[], None],
    watch: Callable[[], None],
    timeout: float | None,
) -> int:
    """The harness's process to its end; its exit status. `unchanged` and `watch` are called
    about once a second while it runs: either raising ends it."""
    argv = h.argv(ctx)
    env = h.environ(ctx, interp.environment(ctx.spec))
    ctx.started = time.time()
    logfile = ctx.output_dir / LOG_NAME
    log.info("harness.started", argv=argv, output_dir=str(ctx.output_dir), device=ctx.device)
    with open(logfile, "ab") as sink:
        try:
            proc = subprocess.Popen(
                reaper.reaped(argv),
                cwd=ctx.output_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        except OSError as e:
            raise EvalError(f"cannot start {argv[0]}: {e.strerror or e}") from e
        deadline = None if timeout is None else time.monotonic() + timeout
        last = 0.0
        try:
            while True:
                try:
                    return proc.wait(timeout=POLL_SECONDS)
                except subprocess.TimeoutExpired:
                    pass
                if time.monotonic() - last >= 1.0:
                    unchanged()
                    watch()
                    last = time.monotonic()
                if deadline is not None and time.monotonic() > deadline:
                    raise EvalError(f"{argv[0]} ran past its {timeout:g}s time-out")
        finally:
            if proc.poll() is None:
                proc.terminate()  # the reaper ends the harness and all it started
                try:
                    proc.wait(timeout=reaper.GRACE_SECONDS + 10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
