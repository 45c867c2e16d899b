"""Pure verdicts on a job whose worker ended, or that was running when the daemon died.

`settle` reads as its table of cases, in order:

| case                                   | verdict  | attempt spent | when again                  |
|----------------------------------------|----------|---------------|-----------------------------|
| every task has its ok line             | ok       | -             | -                           |
| the checkpoint's files changed under it (the worker found them other than judged) | changed | no | once judged again |
| killed by our own shutdown             | requeue  | no            | next start                  |
| stopped to give its GPU back (another process started using it: devices.yield_to_others) | requeue | no | next free device |
| checkpoint deleted meanwhile           | missed   | -             | never                       |
| failed in a way that cannot heal (evaluators/failures.py: unknown task, missing data file, checkpoint that cannot load, code execution not allowed, broken template) | fail | yes | `watcher requeue` |
| failed, attempts left                  | retry    | yes           | now + backoff * 2**(n-1)    |
| failed, no attempts left               | fail     | yes           | `watcher requeue`           |

`recover` (a job found `running` when the daemon starts, whose worker was not adopted):

| case                                   | verdict  | attempt spent | daemon death counted |
|----------------------------------------|----------|---------------|----------------------|
| every task has its ok line             | ok       | -             | -                    |
| the death is explained: the job's worker outlived the daemon, or it finished a task since the daemon last died | requeue | no | no |
| the daemon has now died N times while this job ran, N >= max(2, max_attempts) | fail | yes | yes |
| otherwise                              | requeue  | no            | yes                  |

A kill -9 or crash of the daemon never costs a job an attempt (a worker still running is
adopted, not even restarted: `jobs/recovery.py`); only a job under which the daemon keeps dying,
with nothing else to explain it (memory pressure, say), stops the crash loop with a `failed`
line.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["ok", "changed", "requeue", "missed", "retry", "fail"]


@dataclass(frozen=True)
class Attempt:
    """What is known when a worker has ended."""

    attempt: int  # the attempt that just ran (1-based)
    max_attempts: int
    remaining: list[dict[str, Any]]  # tasks still without an ok line
    rc: int  # the worker's exit code (negative: killed by that signal)
    now: float
    backoff_seconds: float = 30.0
    killed_for_stop: bool = False
    yielded: str | None = None  # why it was stopped to give its device back
    timed_out_after: float | None = None  # eval.timeout_seconds, when the worker was timed out
    checkpoint_gone: bool = False
    checkpoint_changed: bool = False  # the worker found its files other than judged
    task_errors: list[str] = field(default_factory=list)  # "task: error" from the worker
    crash_error: str | None = None  # what stopped the whole worker, if it said (crash.json)
    heals: bool = True  # False: the worker classified every remaining failure as permanent
    log_tail: str = ""


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    reason: str = ""
    attempt: int = 0  # the job's attempt count from now on
    not_before: float = 0.0
    error: str = ""  # for `fail`: what the failed ledger lines say
    daemon_deaths: int | None = None  # for `recover`: the job's new count


def failure_reason(a: Attempt) -> str:
    """Why an attempt failed, most specific first."""
    if a.timed_out_after is not None:
        return f"timed out after {a.timed_out_after:g}s (eval.timeout_seconds)"
    if a.task_errors:
        return "; ".join(a.task_errors)
    if a.crash_error:
        return a.crash_error
    if a.rc < 0:
        try:
            name = signal.Signals(-a.rc).name
        except ValueError:
            name = str(-a.rc)
        return f"worker killed by signal {name} (OOM killer?)"
    reason = f"worker exited with code {a.rc}"
    last = a.log_tail.strip().splitlines()[-1][:300] if a.log_tail.strip() else ""
    return f"{reason}: {last}" if last else reason


def settle(a: Attempt) -> Verdict:
    if not a.remaining:
        return Verdict("ok", attempt=a.attempt)
    if a.checkpoint_changed:
        reason = a.crash_error or "the checkpoint changed under its eval"
        return Verdict("changed", reason, attempt=max(0, a.attempt - 1))
    if a.killed_for_stop:
        return Verdict("requeue", "interrupted by shutdown", attempt=max(0, a.attempt - 1))
    if a.yielded is not None:
        return Verdict("requeue", f"yielded {a.yielded}", attempt=max(0, a.attempt - 1))
    if a.checkpoint_gone:
        return Verdict("missed", "checkpoint deleted during evaluation", attempt=a.attempt)
    reason = failure_reason(a)
    if not a.heals:
        error = f"{reason} (not retried: it would fail the same way)"
        return Verdict("fail", reason, attempt=a.attempt, error=error)
    if a.attempt < a.max_attempts:
        delay = a.backoff_seconds * 2 ** (a.attempt - 1)
        return Verdict("retry", reason, attempt=a.attempt, not_before=a.now + delay)
    tail = f"\n--- worker log tail ---\n{a.log_tail}" if a.log_tail else ""
    error = f"{reason} (after {a.attempt} attempts){tail}"
    return Verdict("fail", reason, attempt=a.attempt, error=error)


def recover(
    attempt: int, daemon_deaths: int, max_attempts: int, remaining: list[Any], explained: bool
) -> Verdict:
    """A job was `running` when the daemon died (`daemon_deaths` counts earlier deaths that
    nothing explained; `explained`: this one is, see the table)."""
    if not remaining:
        return Verdict("ok", attempt=attempt)
    if explained:
        return Verdict(
            "requeue", "daemon restarted", attempt=max(0, attempt - 1), daemon_deaths=daemon_deaths
        )
    deaths = daemon_deaths + 1
    if deaths >= max(2, max_attempts):
        reason = f"the daemon died while this job ran ({deaths} times)"
        error = (
            f"{reason}: evaluating this checkpoint may be what kills it (memory?); "
            "see the daemon's log, then `watcher requeue`"
        )
        return Verdict("fail", reason, attempt=attempt, error=error, daemon_deaths=deaths)
    return Verdict("requeue", "daemon restarted", attempt=max(0, attempt - 1), daemon_deaths=deaths)
