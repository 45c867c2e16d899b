"""`watcher results RUN --vs STEP`: every other step's change from STEP, per task and metric,
paired over documents (`report.paired`) where both results kept per-document records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_watcher.errors import WatcherError
from ckpt_watcher.ledger import is_result
from ckpt_watcher.report import samples as sv
from ckpt_watcher.report.table import Table, newest_versions, task_label


def step_changes(ledger_dir: Path, run_path: str, lines: list[dict[str, Any]], vs: int) -> Table:
    """A row per (step, task, metric): the value, its change from step `vs`, the 95% interval
    of that change and how many documents it pairs (empty where either side has no records:
    the change is then the ledger's difference, with no interval), and `beyond noise`."""
    ok = [ln for ln in newest_versions(lines) if is_result(ln)]
    base = {task_label(ln): ln for ln in ok if ln.get("step") == vs}
    if not base:
        steps = sorted({ln["step"] for ln in ok if isinstance(ln.get("step"), int)})
        flagged = any(ln.get("no_op") and ln.get("step") == vs for ln in lines)
        why = " (its checkpoint changes nothing: `no_op` in its lines)" if flagged else ""
        raise WatcherError(f"no ok result at step {vs}{why}; steps with results: {steps or 'none'}")
    base_records = {label: _records(ledger_dir, run_path, ln) for label, ln in base.items()}
    rows: list[list[Any]] = []
    for ln in sorted(ok, key=lambda x: (x.get("step") or 0, task_label(x))):
        label, step = task_label(ln), ln.get("step")
        ref = base.get(label)
        if ref is None or step == vs or not isinstance(step, int):
            continue
        before, after = base_records[label], _records(ledger_dir, run_path, ln)
        keys = [k for k in ln.get("metrics", {}) if k in ref.get("metrics", {})]
        for key in keys:
            if "_stderr" in key or not isinstance(ln["metrics"][key], int | float):
                continue
            value, was = ln["metrics"][key], ref["metrics"][key]
            change = (
                sv.paired_change(before, after, key)
                if before is not None and after is not None and _scored(after, key)
                else None
            )
            if change is None:
                rows.append([step, label, key, value, value - was, None, None, None, None])
                continue
            real = "yes" if change.real else "no"
            figures = [change.delta, change.low, change.high, change.documents, real]
            rows.append([step, label, key, value, *figures])
    columns = ["step", "task", "metric", "value", f"Δ vs {vs}", "ci95_low", "ci95_high"]
    return Table([*columns, "documents", "beyond noise"], rows)


def _records(ledger_dir: Path, run_path: str, line: dict[str, Any]) -> sv.Records | None:
    if not line.get("samples_file"):
        return None
    try:
        return sv.read_records(ledger_dir, run_path, line)
    except WatcherError:
        return None


def _scored(records: sv.Records, key: str) -> bool:
    """Whether the records hold per-response scores of `key` (pass@k keys are per problem
    estimates, not response scores: they get the ledger's difference)."""
    return any(key in rec.get("scores", {}) for rec in records.by_doc.values())
