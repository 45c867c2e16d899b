"""Several runs side by side (`watcher results|plot|report -c C RUN [RUN ...]`): seeds and
ablations in one table, one plot, one page.

What is compared is a list of `Entry`s. An entry is one run; with `--mean`, each RUN argument
is one entry, a *group*: the runs it names (a pattern such as `lr3e-4_seed*`, or one run),
averaged step by step. A group is named by its argument as typed. Its rows hold each metric's
mean over its runs, `<metric> sd` (the sample standard deviation across runs, with at least two)
and `n`, how many of its runs have that metric at that step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ckpt_watcher.report.table import (
    Noise,
    Pairing,
    Table,
    is_stderr_column,
    length_series,
    metric_rows,
    metric_series,
    stderr_column,
    with_baseline,
)

Points = list[tuple[int, float, float]]  # (step, value, spread: stderr, or sd in a group)
SD = " sd"  # a group's spread column: `<metric column> sd`


@dataclass
class Entry:
    """One line of a comparison: a run, or a group of runs shown as their mean."""

    name: str
    runs: list[str]
    lines: list[list[dict[str, Any]]] = field(default_factory=list)  # each run's ledger lines
    grouped: bool = False

    @property
    def every_line(self) -> list[dict[str, Any]]:
        return [ln for lines in self.lines for ln in lines]


def curves(entry: Entry) -> dict[str, Points]:
    """Each metric column's points by step: a run's values and stderrs (`metric_series`), or a
    group's means and standard deviations across its runs."""
    if not entry.grouped:
        return metric_series(entry.lines[0])
    return {col: [(s, m, sd or 0.0) for s, m, sd, _ in pts] for col, pts in _group(entry).items()}


def length_curves(entry: Entry) -> dict[str, Points]:
    """Each generation task's response lengths by step (`length_series`): a run's, or a
    group's means across its runs with their standard deviations."""
    if not entry.grouped:
        return length_series(entry.lines[0])
    return {
        col: [(s, m, sd or 0.0) for s, m, sd, _ in pts]
        for col, pts in _group(entry, metrics=False, lengths=True).items()
    }


def _group(
    entry: Entry, metrics: bool = True, lengths: bool = False
) -> dict[str, list[tuple[int, float, float | None, int]]]:
    """(step, mean, sd or None with one value, n) per metric column (and with `lengths`, per
    response-length column) of a group."""
    values: dict[str, dict[int, list[float]]] = {}
    for lines in entry.lines:
        series = (metric_series(lines) if metrics else {}) | (
            length_series(lines) if lengths else {}
        )
        for col, points in series.items():
            for step, value, _ in points:
                values.setdefault(col, {}).setdefault(step, []).append(value)
    return {
        col: [(s, *_mean_sd(vs), len(vs)) for s, vs in sorted(by_step.items())]
        for col, by_step in values.items()
    }


def _mean_sd(vs: list[float]) -> tuple[float, float | None]:
    mean = sum(vs) / len(vs)
    if len(vs) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vs) / (len(vs) - 1))


def compare_table(
    entries: list[Entry],
    include_stderr: bool = False,
    only: list[str] | None = None,
    baseline: dict[str, Any] | None = None,
    baseline_name: str = "baseline",
    include_stats: bool = False,
    pairing: Pairing | None = None,
) -> Table:
    """One table: a `run` column (the run path, or the group's name), `step` (and `n` where a
    group is shown), then each metric column any entry has; the baseline's row first, with a Δ
    column per metric, as for one run. A group's Δ is marked `*` beyond twice the standard
    error of its mean (sd/√n) combined with the baseline's stderr; a run's, as for one run
    (`pairing`: by the paired test over documents where both sides kept records)."""
    grouped = any(e.grouped for e in entries)
    parts: list[tuple[str, Table, list[Noise]]] = []
    for e in entries:
        if e.grouped:
            parts.append((e.name, *_group_rows(e, only, include_stats)))
        else:
            one = metric_rows(
                e.lines[0],
                include_stderr,
                only=only,
                include_stats=include_stats,
                pairing=pairing if baseline is not None else None,
            )
            parts.append((e.name, *one))
    columns = _merged_columns([t.columns[1:] for _, t, _ in parts])
    head = ["run", "step", "n"] if grouped else ["run", "step"]
    rows: list[list[Any]] = []
    noise: list[Noise] = []
    for name, table, row_noise in parts:
        for row, judged in zip(table.rows, row_noise, strict=True):
            cells = dict(zip(table.columns, row, strict=True))
            n = [cells.pop("n", None)] if grouped else []
            rows.append([name, cells.pop("step"), *n, *(cells.get(c) for c in columns)])
            noise.append(judged)
    out = Table([*head, *columns], rows)
    if baseline is not None:
        out = with_baseline(out, len(head), baseline, baseline_name, noise)
    return out


def _group_rows(
    entry: Entry, only: list[str] | None, include_stats: bool = False
) -> tuple[Table, list[Noise]]:
    """A group's rows (step, n, each metric's mean and sd) and the standard error of each mean."""
    group = _group(entry, lengths=include_stats)
    metrics = [c for c in (only if only is not None else group) if not is_stderr_column(c)]
    steps = sorted({s for col in metrics for s, *_ in group.get(col, [])})
    at = {col: {s: (m, sd, n) for s, m, sd, n in group.get(col, [])} for col in metrics}
    columns = ["step", "n", *(c for col in metrics for c in (col, col + SD))]
    rows, errs = [], []
    for step in steps:
        cells: list[Any] = []
        err: dict[str, float] = {}
        counts = []
        for col in metrics:
            mean, sd, n = at[col].get(step, (None, None, 0))
            cells += [mean, sd]
            counts.append(n)
            if sd is not None:
                err[col] = sd / math.sqrt(n)
        rows.append([step, max(counts, default=0), *cells])
        errs.append(Noise(stderr=err))
    return Table(columns, rows), errs


def _merged_columns(each: list[list[str]]) -> list[str]:
    """Every entry's metric columns in first-seen order, each metric followed by its stderr and
    sd columns where any entry has them."""
    seen: list[str] = []
    for cols in each:
        seen += [c for c in cols if c not in seen and c != "n"]
    present = set(seen)
    plain = [c for c in seen if not is_stderr_column(c) and not c.endswith(SD)]
    out: list[str] = []
    for col in plain:
        out += [c for c in (col, stderr_column(col), col + SD) if c in present and c not in out]
    return out
