"""`watcher requeue`: put a run's checkpoints back in line for another try.

Only what is due is run again: tasks whose latest attempt failed, and tasks whose results were
made with other eval settings (stale). A result already `ok` under the current settings is never
run twice. Works with the daemon running or not: it only changes state rows, which the daemon
reads on its next pass (within seconds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ckpt_watcher import planner
from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.ledger import LedgerIndex
from ckpt_watcher.report.table import task_label
from ckpt_watcher.state import State

_REQUEUEABLE = ("done", "failed", "skipped")


@dataclass
class Requeued:
    label: str
    due: list[str]


def requeue(
    cfg: WatcherConfig, run_path: str, step: int | None = None, task: str | None = None
) -> tuple[list[Requeued], list[str]]:
    """Return (checkpoints of the run path put back as ready, checkpoints left alone with why)."""
    from ckpt_watcher.preflight import harness_problems

    # another harness's results are of its version: read it, as the daemon does at start
    cfg.eval.set_harness_versions(harness_problems(cfg)[0])
    ledger = LedgerIndex(cfg.ledger_dir).load()
    settings = cfg.eval.settings_hash()
    tasks = [t for t in cfg.eval.entries() if task is None or task in (t.get("name"), t["task"])]
    state = State(cfg.state_dir)
    done: list[Requeued] = []
    left: list[str] = []
    try:
        rows = [
            r
            for r in state.checkpoints()
            if r.run_path == run_path and (step is None or r.step == step)
        ]
        for row in rows:
            due = [task_label(t) for t in ledger.due(planner.subject(row), tasks, settings)]
            if row.state not in _REQUEUEABLE:
                left.append(f"{row.label}: {row.state} (already in line or not evaluable yet)")
            elif not due:
                left.append(f"{row.label}: every task already ok with the current settings")
            else:
                state.upsert_checkpoint(
                    row.location,
                    row.source,
                    time.time(),
                    state="ready",
                    reason="requeued by hand",
                )
                done.append(Requeued(row.label, due))
    finally:
        state.close()
    return done, left
