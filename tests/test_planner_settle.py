"""The daemon's decisions as tables of cases: no processes, no clock, no files."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ckpt_watcher import planner
from ckpt_watcher.jobs import settle
from ckpt_watcher.ledger import TaskPlan
from ckpt_watcher.planner import MarkCheckpoint, QueueJob, ReuseResults, SkipJob
from ckpt_watcher.state import CheckpointRow, Job

T0 = {"task": "a", "num_fewshot": 0}
T1 = {"task": "b", "num_fewshot": 5}


def row(
    step: int | None,
    state: str = "ready",
    final: bool = False,
    run: str = "r",
    fp: str | None = None,
    where: str = "/c",
) -> CheckpointRow:
    label = f"{run}_final" if final else f"{run}_step{step}"
    return CheckpointRow(
        location=f"{where}/{label}",
        source="s",
        run=run,
        step=step,
        label=label,
        final=final,
        state=state,
        reason="",
        fingerprint=fp,
        write_mark=None,
        unchanged_since=None,
        first_seen=None,
        updated_at=None,
        ready_at=None,
        run_path=run,
        previous_fingerprint=None,
        rewritten_at=None,
    )


def Q(location: str, step: int | None, label: str, tasks: list, key: float, fp: str | None = None):
    return QueueJob(location, "r", step, label, tasks, key, run_path="r", fingerprint=fp)


REUSED = {"task": "a", "reused_from": "/efs/r_step100"}


@pytest.mark.parametrize(
    "rows, due, busy, every, expected",
    [
        # ready, nothing done: one job with both tasks, marked planned
        (
            [row(100)],
            [T0, T1],
            set(),
            1,
            [
                Q("/c/r_step100", 100, "r_step100", [T0, T1], 100.0),
                MarkCheckpoint("/c/r_step100", "planned"),
            ],
        ),
        # only what is still due is queued
        (
            [row(100)],
            [T1],
            set(),
            1,
            [
                Q("/c/r_step100", 100, "r_step100", [T1], 100.0),
                MarkCheckpoint("/c/r_step100", "planned"),
            ],
        ),
        # everything in the ledger already
        (
            [row(100)],
            [],
            set(),
            1,
            [MarkCheckpoint("/c/r_step100", "done", "all tasks in the ledger")],
        ),
        # a job is already queued or running: no second job
        ([row(100)], [T0], {"/c/r_step100"}, 1, [MarkCheckpoint("/c/r_step100", "planned")]),
        # every_n_steps: 150 is skipped, 200 planned
        (
            [row(150)],
            [T0],
            set(),
            100,
            [
                MarkCheckpoint(
                    "/c/r_step150",
                    "skipped",
                    "step 150 is not a multiple of policy.every_n_steps=100",
                )
            ],
        ),
        # finals are always evaluated, and sort after their step
        (
            [row(150, final=True)],
            [T0],
            set(),
            100,
            [
                Q("/c/r_final", 150, "r_final", [T0], 150.5),
                MarkCheckpoint("/c/r_final", "planned"),
            ],
        ),
        # a final with no known step sorts after everything
        (
            [row(None, final=True)],
            [T0],
            set(),
            100,
            [
                Q("/c/r_final", None, "r_final", [T0], 1e18),
                MarkCheckpoint("/c/r_final", "planned"),
            ],
        ),
    ],
)
def test_plan_ready(rows, due, busy, every, expected) -> None:
    actions = planner.plan_ready(
        rows, plan=lambda r: TaskPlan(due), has_jobs=lambda loc: loc in busy, every_n_steps=every
    )
    assert actions == expected


def test_content_evaluated_elsewhere_is_reused_not_run_again() -> None:
    actions = planner.plan_ready(
        [row(100, fp="F", where="/s3")],
        plan=lambda r: TaskPlan(due=[], reuse=[REUSED]),
        has_jobs=lambda loc: False,
        every_n_steps=1,
    )
    assert actions == [
        ReuseResults("/s3/r_step100", [REUSED]),
        MarkCheckpoint(
            "/s3/r_step100",
            "done",
            "all tasks in the ledger (reused from /efs/r_step100: same content)",
        ),
    ]


def test_a_twin_of_content_being_evaluated_waits_for_its_results() -> None:
    twins = [row(100, fp="F", where="/efs"), row(100, fp="F", where="/s3"), row(200, fp="G")]
    actions = planner.plan_ready(
        twins, plan=lambda r: TaskPlan([T0]), has_jobs=lambda loc: False, every_n_steps=1
    )
    wait = "same content as /efs/r_step100, which is being evaluated: its results will be reused"
    assert actions == [
        Q("/efs/r_step100", 100, "r_step100", [T0], 100.0, fp="F"),
        MarkCheckpoint("/efs/r_step100", "planned"),
        MarkCheckpoint("/s3/r_step100", "ready", wait),
        Q("/c/r_step200", 200, "r_step200", [T0], 200.0, fp="G"),
        MarkCheckpoint("/c/r_step200", "planned"),
    ]
    # on later passes, a job already in flight holds it back the same way (said once)
    waiting = dataclasses.replace(row(100, fp="F", where="/s3"), reason=wait)
    assert (
        planner.plan_ready(
            [waiting],
            plan=lambda r: TaskPlan([T0]),
            has_jobs=lambda loc: False,
            every_n_steps=1,
            in_flight={"F": "/efs/r_step100"},
        )
        == []
    )


def queued(jid: str, step: int, run: str = "r") -> Job:
    return Job(
        id=jid,
        location=f"/c/{run}_step{step}",
        run=run,
        step=step,
        label=f"{run}_step{step}",
        tasks=[T0],
        settings_hash="h",
        created_at=0.0,
        order_key=float(step),
    )


def test_superseded_drops_older_queued_jobs_of_the_same_run_only() -> None:
    rows = [row(100, "planned"), row(300, "ready"), row(50, "done", run="other")]
    jobs = [queued("j100", 100), queued("j300", 300), queued("o10", 10, run="other")]
    reason = "superseded by a newer checkpoint"
    assert planner.superseded(rows, jobs) == [
        SkipJob("j100", "/c/r_step100", reason),
        MarkCheckpoint("/c/r_step100", "skipped", reason),
        SkipJob("o10", "/c/other_step10", reason),
        MarkCheckpoint("/c/other_step10", "skipped", reason),
    ]


@pytest.mark.parametrize(
    "state, due, errors, expected",
    [
        ("planned", [], [], MarkCheckpoint("", "done")),
        ("planned", [T0], ["first", "last"], MarkCheckpoint("", "failed", "last")),
        ("ready", [T0], [], MarkCheckpoint("", "failed", "")),
        ("missed", [T0], [], None),  # moved on: deleted meanwhile
        ("skipped", [], [], None),
    ],
)
def test_after_jobs(state, due, errors, expected) -> None:
    assert planner.after_jobs(state, due, errors) == expected


def attempt(**over: Any) -> settle.Attempt:
    base: dict[str, Any] = {
        "attempt": 1,
        "max_attempts": 3,
        "remaining": [T0],
        "rc": 1,
        "now": 1000.0,
        "backoff_seconds": 30.0,
    }
    return settle.Attempt(**(base | over))


@pytest.mark.parametrize(
    "case, expected",
    [
        (attempt(remaining=[]), settle.Verdict("ok", attempt=1)),
        (
            attempt(remaining=[], rc=-9),
            settle.Verdict("ok", attempt=1),
        ),  # killed after its last task
        (
            attempt(killed_for_stop=True, attempt=2),
            settle.Verdict("requeue", "interrupted by shutdown", attempt=1),
        ),
        (  # killed to give its GPU back to training: no attempt spent
            attempt(yielded="cuda:6 (30000 MiB held by other processes)", rc=-9),
            settle.Verdict(
                "requeue", "yielded cuda:6 (30000 MiB held by other processes)", attempt=0
            ),
        ),
        (
            attempt(checkpoint_gone=True),
            settle.Verdict("missed", "checkpoint deleted during evaluation", attempt=1),
        ),
        (  # the worker found the checkpoint's files other than judged: no attempt spent, even
            # on the last one; judged again (what it finished before stands)
            attempt(rc=5, attempt=3, checkpoint_changed=True, crash_error="x: its files changed"),
            settle.Verdict("changed", "x: its files changed", attempt=2),
        ),
        (
            attempt(rc=-9),
            settle.Verdict(
                "retry",
                "worker killed by signal SIGKILL (OOM killer?)",
                attempt=1,
                not_before=1030.0,
            ),
        ),
        (
            attempt(rc=-9, attempt=2),
            settle.Verdict(
                "retry",
                "worker killed by signal SIGKILL (OOM killer?)",
                attempt=2,
                not_before=1060.0,
            ),
        ),
        (
            attempt(rc=4, log_tail="Traceback ...\nValueError: bad shape"),
            settle.Verdict(
                "retry",
                "worker exited with code 4: ValueError: bad shape",
                attempt=1,
                not_before=1030.0,
            ),
        ),
        (
            attempt(rc=3, task_errors=["a: KeyError: 'x'"], timed_out_after=60.0),
            settle.Verdict(
                "retry", "timed out after 60s (eval.timeout_seconds)", attempt=1, not_before=1030.0
            ),
        ),
        (
            attempt(rc=3, task_errors=["a: KeyError: 'x'"], attempt=3),
            settle.Verdict(
                "fail", "a: KeyError: 'x'", attempt=3, error="a: KeyError: 'x' (after 3 attempts)"
            ),
        ),
        (
            attempt(rc=-9, attempt=3, log_tail="loading"),
            settle.Verdict(
                "fail",
                "worker killed by signal SIGKILL (OOM killer?)",
                attempt=3,
                error="worker killed by signal SIGKILL (OOM killer?) (after 3 attempts)\n--- worker log tail ---\nloading",
            ),
        ),
        # cannot heal: failed at once, attempts left or not
        (
            attempt(rc=3, task_errors=["a: KeyError: 'x' (check the task name)"], heals=False),
            settle.Verdict(
                "fail",
                "a: KeyError: 'x' (check the task name)",
                attempt=1,
                error="a: KeyError: 'x' (check the task name) (not retried: it would fail the same way)",
            ),
        ),
        # a worker that said why it stopped (crash.json) is quoted rather than its log
        (
            attempt(
                rc=4,
                crash_error="ValueError: Unrecognized model (re-save)",
                heals=False,
                log_tail="x",
            ),
            settle.Verdict(
                "fail",
                "ValueError: Unrecognized model (re-save)",
                attempt=1,
                error="ValueError: Unrecognized model (re-save) (not retried: it would fail the same way)",
            ),
        ),
        (
            attempt(rc=4, crash_error="OSError: [Errno 5] Input/output error", log_tail="x"),
            settle.Verdict(
                "retry", "OSError: [Errno 5] Input/output error", attempt=1, not_before=1030.0
            ),
        ),
        # killed for stop wins over a gone checkpoint: the next start judges it again
        (
            attempt(killed_for_stop=True, checkpoint_gone=True),
            settle.Verdict("requeue", "interrupted by shutdown", attempt=0),
        ),
    ],
)
def test_settle(case: settle.Attempt, expected: settle.Verdict) -> None:
    assert settle.settle(case) == expected


@pytest.mark.parametrize(
    "attempt_no, deaths, max_attempts, remaining, explained, kind, new_deaths, new_attempt",
    [
        (1, 0, 3, [], False, "ok", None, 1),  # finished before the daemon died: harvested
        (1, 0, 3, [T0], False, "requeue", 1, 0),  # a single kill -9 costs no attempt
        (1, 1, 3, [T0], False, "requeue", 2, 0),
        (1, 2, 3, [T0], False, "fail", 3, 1),  # the third death while it ran: a crash loop
        (1, 0, 1, [T0], False, "requeue", 1, 0),  # even with max_attempts 1, one is forgiven
        (1, 1, 1, [T0], False, "fail", 2, 1),
        (2, 0, 3, [T0], False, "requeue", 1, 1),  # an earlier real failure keeps its attempt
        # the worker outlived the daemon, or finished a task since: that death is not counted
        (1, 2, 3, [T0], True, "requeue", 2, 0),
        (1, 5, 3, [T0], True, "requeue", 5, 0),
    ],
)
def test_recover(
    attempt_no, deaths, max_attempts, remaining, explained, kind, new_deaths, new_attempt
) -> None:
    v = settle.recover(attempt_no, deaths, max_attempts, remaining, explained)
    assert (v.kind, v.daemon_deaths, v.attempt) == (kind, new_deaths, new_attempt)
    if kind == "fail":
        assert v.reason == f"the daemon died while this job ran ({new_deaths} times)"
        assert v.error.startswith(v.reason) and "watcher requeue" in v.error


def test_backlog_thin_fills_the_largest_gaps_from_the_newest_evaluated_step() -> None:
    pending = [planner.Pending(f"c{s}", float(s), False) for s in range(110, 210, 10)]
    # step 100 is evaluated (the anchor): keep 200, then 150 (middle of 100-200), then 120
    # (the middle of 100-150, the first of two equal gaps)
    skip = planner.backlog_skips(pending, 100.0, 3, "thin")
    assert sorted(set(p.location for p in pending) - set(skip)) == ["c120", "c150", "c200"]
    # newest first left older steps waiting below the anchor: the oldest bounds the range
    assert "c110" not in planner.backlog_skips(pending, 300.0, 3, "thin")
    assert planner.backlog_skips(pending, None, 3, "keep") == []
    assert planner.backlog_skips(pending[:3], None, 3, "thin") == []
