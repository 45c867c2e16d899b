"""Pure planning: which ready checkpoints get a job, which are skipped or done, and what state a
checkpoint ends in once its jobs end. Rows, the ledger's answer and the policy go in; actions
come out. No I/O, no clock: the daemon carries the actions out.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_watcher.scheduler import order_key, step_due
from ckpt_watcher.state import Job

Row = Mapping[str, Any] | sqlite3.Row  # a `checkpoints` row: location, run, step, label, final
Tasks = list[dict[str, Any]]


@dataclass(frozen=True)
class MarkCheckpoint:
    """Set a checkpoint's state (and the reason `watcher status` shows)."""

    location: str
    state: str
    reason: str = ""


@dataclass(frozen=True)
class QueueJob:
    """Queue one job: the checkpoint's tasks that are still due."""

    location: str
    run: str
    step: int | None
    label: str
    tasks: Tasks
    order_key: float


@dataclass(frozen=True)
class SkipJob:
    """Drop a queued job (its checkpoint is marked with the same reason)."""

    job_id: str
    location: str
    reason: str


Action = MarkCheckpoint | QueueJob | SkipJob


def plan_ready(
    rows: Sequence[Row],
    due: Callable[[Row], Tasks],
    has_jobs: Callable[[str], bool],
    every_n_steps: int,
) -> list[Action]:
    """Actions for `ready` checkpoints. `due(row)` is the row's tasks with no ok ledger line yet;
    `has_jobs(location)` is True while a job of that checkpoint is queued or running."""
    actions: list[Action] = []
    for row in rows:
        loc, step, final = row["location"], row["step"], bool(row["final"])
        if not step_due(step, final, every_n_steps):
            reason = f"step {step} is not a multiple of policy.every_n_steps={every_n_steps}"
            actions.append(MarkCheckpoint(loc, "skipped", reason))
            continue
        tasks = due(row)
        if not tasks:
            actions.append(MarkCheckpoint(loc, "done", "all tasks in the ledger"))
            continue
        if not has_jobs(loc):
            actions.append(
                QueueJob(loc, row["run"], step, row["label"], tasks, order_key(step, final))
            )
        actions.append(MarkCheckpoint(loc, "planned"))
    return actions


def superseded(rows: Sequence[Row], queued: Sequence[Job]) -> list[Action]:
    """policy.skip_superseded: a queued job is dropped once a newer checkpoint of its run is
    ready, planned or done. `rows` are those checkpoints."""
    newest: dict[str, float] = {}
    for row in rows:
        key = order_key(row["step"], bool(row["final"]))
        newest[row["run"]] = max(newest.get(row["run"], -1.0), key)
    reason = "superseded by a newer checkpoint"
    actions: list[Action] = []
    for job in queued:
        if job.order_key < newest.get(job.run, -1.0):
            actions += [
                SkipJob(job.id, job.location, reason),
                MarkCheckpoint(job.location, "skipped", reason),
            ]
    return actions


def after_jobs(row_state: str, due_left: Tasks, job_errors: Sequence[str]) -> MarkCheckpoint | None:
    """A checkpoint's last job ended: `done` if nothing is due, else `failed` with the last
    failed job's error. None where the checkpoint has moved on (missed, skipped, requeued...)."""
    if row_state not in ("planned", "ready"):
        return None
    if not due_left:
        return MarkCheckpoint("", "done")
    return MarkCheckpoint("", "failed", job_errors[-1] if job_errors else "")
