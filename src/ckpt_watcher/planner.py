"""Pure planning: which ready checkpoints get a job, which are skipped or done, and what state a
checkpoint ends in once its jobs end. Rows, the ledger's answer and the policy go in; actions
come out. No I/O, no clock: the daemon carries the actions out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_watcher.ledger import Subject, TaskPlan
from ckpt_watcher.scheduler import order_key, step_due
from ckpt_watcher.state import CheckpointRow, Job

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
    run_path: str = ""
    fingerprint: str | None = None
    write_mark: str | None = None  # of the files the fingerprint was taken from


@dataclass(frozen=True)
class ReuseResults:
    """Append ledger lines copied from the same content evaluated elsewhere (`reused_from`)."""

    location: str
    lines: list[dict[str, Any]]


@dataclass(frozen=True)
class SkipJob:
    """Drop a queued job (its checkpoint is marked with the same reason)."""

    job_id: str
    location: str
    reason: str


Action = MarkCheckpoint | QueueJob | SkipJob | ReuseResults


def plan_ready(
    rows: Sequence[CheckpointRow],
    plan: Callable[[CheckpointRow], TaskPlan],
    has_jobs: Callable[[str], bool],
    every_n_steps: int,
    in_flight: Mapping[str, str] | None = None,
) -> list[Action]:
    """Actions for `ready` checkpoints. `plan(row)` splits the row's tasks into due ones and
    results reusable from the same content elsewhere; `has_jobs(location)` is True while a job
    of that checkpoint is queued or running; `in_flight` maps the fingerprints of queued and
    running jobs to their checkpoint: a twin waits for its results instead of running again."""
    actions: list[Action] = []
    busy = dict(in_flight or {})
    for row in rows:
        loc, step, final = row.location, row.step, row.final
        if not step_due(step, final, every_n_steps):
            reason = f"step {step} is not a multiple of policy.every_n_steps={every_n_steps}"
            actions.append(MarkCheckpoint(loc, "skipped", reason))
            continue
        tasks = plan(row)
        if tasks.reuse:
            actions.append(ReuseResults(loc, tasks.reuse))
        if not tasks.due:
            reason = "all tasks in the ledger"
            if tasks.reuse:
                reason += f" (reused from {tasks.reuse[0]['reused_from']}: same content)"
            actions.append(MarkCheckpoint(loc, "done", reason))
            continue
        if has_jobs(loc):
            actions.append(MarkCheckpoint(loc, "planned"))
            continue
        fp = row.fingerprint
        twin = busy.get(fp) if fp else None
        if twin is not None and twin != loc:
            reason = f"same content as {twin}, which is being evaluated: its results will be reused"
            if row.reason != reason:
                actions.append(MarkCheckpoint(loc, "ready", reason))
            continue
        if fp:
            busy[fp] = loc
        actions.append(
            QueueJob(
                loc,
                row.run,
                step,
                row.label,
                tasks.due,
                order_key(step, final),
                run_path=row.run_path,
                fingerprint=fp,
                write_mark=row.write_mark,
            )
        )
        actions.append(MarkCheckpoint(loc, "planned"))
    return actions


def subject(row: CheckpointRow) -> Subject:
    """The checkpoint version a row stands for, as the ledger files results under it. Lines
    from before fingerprints count for it until it is seen rewritten."""
    return Subject(
        location=row.location,
        run=row.run,
        run_path=row.run_path,
        step=row.step,
        label=row.label,
        fingerprint=row.fingerprint,
        legacy_ok=row.rewritten_at is None,
    )


def superseded(rows: Sequence[CheckpointRow], queued: Sequence[Job]) -> list[Action]:
    """policy.skip_superseded: a queued job is dropped once a newer checkpoint of its run path
    is ready, planned or done. `rows` are those checkpoints."""
    newest: dict[str, float] = {}
    for row in rows:
        key = order_key(row.step, row.final)
        run_path = row.run_path
        newest[run_path] = max(newest.get(run_path, -1.0), key)
    reason = "superseded by a newer checkpoint"
    actions: list[Action] = []
    for job in queued:
        if job.order_key < newest.get(job.run_path, -1.0):
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


@dataclass(frozen=True)
class Pending:
    """A checkpoint of one run waiting for a device (policy.backlog counts these)."""

    location: str
    order_key: float  # its step (a final just after)
    final: bool


def backlog_skips(
    pending: Sequence[Pending], anchor: float | None, max_pending: int, overflow: str
) -> list[str]:
    """The pending checkpoints of one run to skip so that at most `max_pending` wait; the
    newest and every final are always kept.

    - `skip_oldest`: the oldest go.
    - `thin`: an evenly spaced subset, coarse to fine: the newest first (and the oldest, when
      no step of the run evaluated or running, `anchor`, lies below it), then again and again
      the one nearest the middle of the largest gap between kept steps and the anchor.
    - `keep`: none.
    """
    if overflow == "keep" or len(pending) <= max_pending:
        return []
    ranked = sorted(pending, key=lambda p: p.order_key)
    keep = [ranked[-1], *(p for p in ranked[:-1] if p.final)]
    if overflow == "skip_oldest":
        for p in reversed(ranked):
            if len(keep) >= max_pending:
                break
            if p not in keep:
                keep.append(p)
    else:
        if anchor is not None and anchor >= ranked[0].order_key:
            anchor = None  # evaluated past the oldest waiting (newest first): no lower bound
        if anchor is None and ranked[0] not in keep and len(keep) < max_pending:
            keep.append(ranked[0])
        while len(keep) < max_pending:
            bounds = sorted(
                {p.order_key for p in keep} | ({anchor} if anchor is not None else set())
            )
            best: tuple[float, Pending] | None = None
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                inside = [p for p in ranked if lo < p.order_key < hi and p not in keep]
                if not inside:
                    continue
                mid = (lo + hi) / 2
                pick = min(inside, key=lambda p: (abs(p.order_key - mid), p.order_key))
                if best is None or hi - lo > best[0]:
                    best = (hi - lo, pick)
            if best is None:
                break
            keep.append(best[1])
    return [p.location for p in ranked if p not in keep]
