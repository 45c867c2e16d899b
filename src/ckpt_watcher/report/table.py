"""Ledger lines -> a metric-by-step table (for `watcher results` and the demo's summary)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Table:
    columns: list[str]
    rows: list[list[Any]]


def entry_name(line: dict[str, Any]) -> str:
    """What a ledger line (or task entry) is called: its entry's `name`, else its task."""
    return str(line.get("name") or line["task"])


def task_label(line: dict[str, Any]) -> str:
    """`gsm8k (4-shot)`; `gsm8k` alone where no shots were set (the task kept its own default,
    or the entry is another harness's: verifiers, OLMES, a command); the entry's name instead
    of the task where it has one."""
    shots = line.get("num_fewshot")
    return entry_name(line) if shots is None else f"{entry_name(line)} ({shots}-shot)"


def _point(line: dict[str, Any]) -> tuple[Any, str]:
    return (line.get("step"), line.get("label", ""))


def _version(line: dict[str, Any]) -> str:
    return line.get("fingerprint") or ""


def newest_versions(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The lines of each step's newest checkpoint version (fingerprint): the one whose latest
    line was appended last. A checkpoint rewritten in place shows its new results only."""
    last: dict[tuple[Any, str], dict[str, int]] = {}
    for i, line in enumerate(lines):
        last.setdefault(_point(line), {})[_version(line)] = i
    newest = {point: max(versions, key=versions.__getitem__) for point, versions in last.items()}
    return [ln for ln in lines if newest[_point(ln)] == _version(ln)]


def column(task: str, shots: int | None, metric: str) -> str:
    """A metric's column name: `gsm8k (4-shot) exact_match,strict-match`."""
    return f"{task_label({'task': task, 'num_fewshot': shots})} {metric}"


def baseline_values(
    fixed: list[tuple[str, int | None, dict[str, float]]], evaluated: list[dict[str, Any]]
) -> dict[str, Any]:
    """The baseline by column (stderr columns too): `fixed` numbers per (task, shots), then the
    baseline run's own ledger lines (its latest ok line per task wins)."""
    out = {column(task, shots, k): v for task, shots, metrics in fixed for k, v in metrics.items()}
    for line in newest_versions(evaluated):
        if line.get("status") == "ok":
            for metric, value in line.get("metrics", {}).items():
                out[column(entry_name(line), line.get("num_fewshot"), metric)] = value
    return out


def _stderr_of(metric: str) -> str | None:
    """`exact_match_stderr,none` -> `exact_match,none`; None for a metric that is no stderr."""
    name, sep, filt = metric.partition(",")
    return f"{name[: -len('_stderr')]}{sep}{filt}" if name.endswith("_stderr") else None


@dataclass
class Noise:
    """What a row's Δ marks go by: each metric column's stderr (shown or not), and where both
    sides kept per-document records, the paired test's verdict (`Pairing`)."""

    stderr: dict[str, float] = field(default_factory=dict)
    paired: dict[str, bool] = field(default_factory=dict)  # column -> beyond the noise


# (a ledger line, one of its metric keys) -> whether its change from the baseline is beyond
# the noise by the paired test over documents (None: not paired: the stderr rule decides)
Pairing = Callable[[dict[str, Any], str], bool | None]


def metric_table(
    lines: list[dict[str, Any]],
    include_stderr: bool = False,
    all_versions: bool = False,
    only: list[str] | None = None,
    baseline: dict[str, Any] | None = None,
    baseline_name: str = "baseline",
    include_stats: bool = False,
    pairing: Pairing | None = None,
) -> Table:
    """One row per checkpoint (by step), one column per task/shots/metric; the latest ok line
    wins. A task with failed lines and no ok line for a checkpoint shows `FAILED` (`SKIPPED`
    where the policy skipped it: the backlog). A step
    evaluated in several versions (rewritten in place) shows its newest, or with
    `all_versions` one row per version, with its fingerprint and checkpoint.

    `only`: exactly these columns, in this order (a suite's headline metrics). `baseline`:
    values by column (stderr columns too, where known): a first row, and after each metric
    a `Δ` column, the checkpoint minus the baseline, marked `*` where it is beyond the noise:
    by the paired test over documents where `pairing` can pair it (both sides kept records),
    else where |Δ| exceeds twice the stderr of the difference (sqrt(se² + se_baseline²); a
    baseline without stderr counts 0).
    """
    table, noise = metric_rows(
        lines, include_stderr, all_versions, only, include_stats, pairing if baseline else None
    )
    if baseline is not None:
        head = 3 if all_versions else 1
        table = with_baseline(table, head, baseline, baseline_name, noise)
    return table


def metric_rows(
    lines: list[dict[str, Any]],
    include_stderr: bool = False,
    all_versions: bool = False,
    only: list[str] | None = None,
    include_stats: bool = False,
    pairing: Pairing | None = None,
) -> tuple[Table, list[Noise]]:
    """`metric_table` without a baseline, and each row's `Noise`: what a baseline's Δ needs to
    mark a difference beyond the noise (`pairing`: judge each metric by it where it can).
    `include_stats`: after a task's metrics, its responses' lengths (`length_columns`)."""
    Key = tuple[Any, str, str]  # (step, label, fingerprint)
    cells: dict[Key, dict[str, Any]] = {}
    columns: list[str] = []
    failed: dict[Key, set[str]] = {}
    skipped: dict[Key, set[str]] = {}  # by policy (the backlog): a gap, not a failure
    no_op: dict[Key, set[str]] = {}  # its base model's numbers (ledger `no_op`): not shown
    where: dict[Key, str] = {}
    noise: dict[Key, Noise] = {}
    for line in lines if all_versions else newest_versions(lines):
        key = (*_point(line), _version(line))
        where.setdefault(key, line.get("checkpoint", ""))
        cells.setdefault(key, {})
        if line.get("status") != "ok" or line.get("no_op"):
            gone = no_op if line.get("status") == "ok" else failed
            gone = skipped if line.get("status") == "skipped" else gone
            gone.setdefault(key, set()).add(task_label(line))
            if gone is no_op:  # it covers an earlier attempt's failure
                failed.get(key, set()).discard(task_label(line))
            continue
        row = cells[key]
        judged = noise.setdefault(key, Noise())
        for metric, value in line.get("metrics", {}).items():
            of = _stderr_of(metric)
            if of is not None and isinstance(value, int | float):
                judged.stderr[column(entry_name(line), line.get("num_fewshot"), of)] = value
            if of is None and pairing is not None:
                verdict = pairing(line, metric)
                if verdict is not None:
                    judged.paired[column(entry_name(line), line.get("num_fewshot"), metric)] = (
                        verdict
                    )
            if of is not None and not include_stderr:
                continue
            col = column(entry_name(line), line.get("num_fewshot"), metric)
            if col not in columns:
                columns.append(col)
            row[col] = value
        for col, value in length_columns(line).items() if include_stats else ():
            if col not in columns:
                columns.append(col)
            row[col] = value
    if only is not None:
        columns = list(only)
    # a task that never succeeded has no metric columns: it gets a column of its own
    for label in sorted(
        {f for fs in [*failed.values(), *skipped.values(), *no_op.values()] for f in fs}
    ):
        if not any(col.startswith(label + " ") for col in columns):
            columns.append(label)
    out_rows = []
    order = {key: i for i, key in enumerate(cells)}  # versions of a step: oldest first
    keys = sorted(cells, key=lambda k: (k[0] if k[0] is not None else float("inf"), k[1], order[k]))
    for key in keys:
        step, label, version = key
        row = cells[key]
        values = []
        for col in columns:
            if col in row:
                values.append(row[col])
            elif any(col == f or col.startswith(f + " ") for f in failed.get(key, ())):
                values.append("FAILED")
            elif any(col == f or col.startswith(f + " ") for f in skipped.get(key, ())):
                values.append("SKIPPED")
            elif any(col == f or col.startswith(f + " ") for f in no_op.get(key, ())):
                values.append("NO-OP")
            else:
                values.append(None)
        first = step if step is not None else label
        out_rows.append(
            [first, version or None, where[key], *values] if all_versions else [first, *values]
        )
    head = ["step", "fingerprint", "checkpoint"] if all_versions else ["step"]
    return Table([*head, *columns], out_rows), [noise.get(k, Noise()) for k in keys]


STAT_KEYS = (
    "response_tokens.mean",
    "response_tokens.p90",
    "length_capped_rate",
    "unterminated_rate",
)


def length_stats(line: dict[str, Any]) -> dict[str, float]:
    """A generation result's response lengths by STAT_KEYS name (`response_tokens.mean`, ...,
    `unterminated_rate` where thinking is judged); none for a line without them (likelihood
    tasks, lines written before lengths were measured)."""
    tokens = line.get("response_tokens")
    if not isinstance(tokens, dict):
        return {}
    values = {
        "response_tokens.mean": tokens.get("mean"),
        "response_tokens.p90": tokens.get("p90"),
        "length_capped_rate": line.get("length_capped_rate"),
        "unterminated_rate": line.get("unterminated_rate"),
    }
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float)}


def length_columns(line: dict[str, Any]) -> dict[str, Any]:
    """`length_stats` as table columns: `gsm8k (8-shot) response_tokens.mean`, ..."""
    label, shots = entry_name(line), line.get("num_fewshot")
    return {column(label, shots, k): v for k, v in length_stats(line).items()}


def _delta(
    value: Any, base: Any, se: float | None, se_base: float | None, paired: bool | None
) -> Any:
    if not isinstance(value, int | float) or not isinstance(base, int | float):
        return None
    d = value - base
    if paired is not None:
        return f"{d:+.4f}{'*' if paired else ''}"
    bound = 2 * ((se or 0.0) ** 2 + (se_base or 0.0) ** 2) ** 0.5
    return f"{d:+.4f}{'*' if se is not None and abs(d) > bound else ''}"


def with_baseline(
    table: Table, head: int, base: dict[str, Any], name: str, noise: list[Noise]
) -> Table:
    """The baseline's row first, and a `Δ` column after each metric column (after its stderr
    column, where that is shown: a metric and its stderr stay side by side). `head`: how many
    columns come before the metrics; `noise`: each row's `Noise` (for the `*`)."""
    shown = set(table.columns[head:])
    metrics = [c for c in table.columns[head:] if c in base and not is_stderr_column(c)]
    # the column each Δ follows: its metric's stderr where shown, else the metric itself
    delta_after = {stderr_column(m) if stderr_column(m) in shown else m: m for m in metrics}
    columns = table.columns[:head]
    for c in table.columns[head:]:
        columns.append(c)
        if c in delta_after:
            columns.append(f"Δ {delta_after[c]}")
    first = [name] + [None] * (head - 1)
    rows = [first + [base.get(c) if not c.startswith("Δ ") else None for c in columns[head:]]]
    for row, judged in zip(table.rows, noise, strict=True):
        by_col = dict(zip(table.columns, row, strict=True))
        out = list(row[:head])
        for c in columns[head:]:
            if c.startswith("Δ "):
                m = c[2:]
                se_base = base.get(stderr_column(m))
                se, paired = judged.stderr.get(m), judged.paired.get(m)
                out.append(_delta(by_col.get(m), base.get(m), se, se_base, paired))
            else:
                out.append(by_col.get(c))
        rows.append(out)
    return Table(columns, rows)


def is_stderr_column(col: str) -> bool:
    """`gsm8k (4-shot) exact_match_stderr,none` is; `gsm8k (4-shot) exact_match,none` is not."""
    return is_stderr_metric(col.rsplit(" ", 1)[-1])


def stderr_column(col: str) -> str:
    """`gsm8k (4-shot) exact_match,none` -> `gsm8k (4-shot) exact_match_stderr,none`."""
    label, _, metric = col.rpartition(" ")
    return f"{label} {stderr_metric(metric)}"


def stderr_metric(metric: str) -> str:
    """`exact_match,none` -> `exact_match_stderr,none`: where lm-eval puts a metric's stderr."""
    name, sep, filt = metric.partition(",")
    return f"{name}_stderr{sep}{filt}"


def is_stderr_metric(metric: str) -> bool:
    """`exact_match_stderr,none` is; `exact_match,none` is not."""
    return _stderr_of(metric) is not None


def metric_series(lines: list[dict[str, Any]]) -> dict[str, list[tuple[int, float, float]]]:
    """Each metric column's (step, value, stderr; 0 where none) points, by step, from the newest
    version of each step: what `watcher plot` and the HTML report draw."""
    table = metric_table(lines, include_stderr=True)
    return _series(table, [c for c in table.columns[1:] if not is_stderr_column(c)])


def length_series(lines: list[dict[str, Any]]) -> dict[str, list[tuple[int, float, float]]]:
    """Each generation task's response lengths (`length_columns`) by step, as `metric_series`
    gives metrics (no stderr): what the report and `plot --stats` draw."""
    table = metric_table(lines, include_stats=True)
    return _series(table, [c for c in table.columns[1:] if c.rsplit(" ", 1)[-1] in STAT_KEYS])


def _series(table: Table, columns: list[str]) -> dict[str, list[tuple[int, float, float]]]:
    """(step, value, stderr; 0 where none) points of `columns` over a table's step rows."""
    at = {c: i for i, c in enumerate(table.columns)}
    rows = [r for r in table.rows if isinstance(r[0], int)]
    out: dict[str, list[tuple[int, float, float]]] = {}
    for column in columns:
        i, e = at[column], at.get(stderr_column(column))
        points = [
            (r[0], float(r[i]), float(r[e]) if e is not None and _is_number(r[e]) else 0.0)
            for r in rows
            if _is_number(r[i])
        ]
        if points:
            out[column] = points
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def render(table: Table, fmt: str, width: int | None = None) -> str:
    """The table as `table` (aligned text), `md`, `csv` or `json`. A text table wider than
    `width` (the terminal's) is wrapped: headers on two lines (the task, then the metric) and
    the metric columns in blocks that fit, each block repeating the leading columns (run, step)."""
    if fmt == "json":
        return json.dumps([dict(zip(table.columns, r, strict=True)) for r in table.rows], indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(table.columns)
        w.writerows([["" if v is None else v for v in r] for r in table.rows])
        return buf.getvalue().rstrip("\n")
    text = [[_fmt(v) for v in r] for r in table.rows]
    if fmt == "md":
        head = "| " + " | ".join(table.columns) + " |"
        sep = "|" + "|".join("---:" for _ in table.columns) + "|"
        body = ["| " + " | ".join(r) + " |" for r in text]
        return "\n".join([head, sep, *body])
    one_line = [("", c) for c in table.columns]
    plain = _aligned(one_line, text, _widths(one_line, text), list(range(len(one_line))))
    if width is None or max(len(line) for line in plain) <= width:
        return "\n".join(plain)
    heads = [_two_lines(c) for c in table.columns]
    widths = _widths(heads, text)
    blocks = _blocks(heads, widths, width)
    return "\n\n".join("\n".join(_aligned(heads, text, widths, cols)) for cols in blocks)


KEY_COLUMNS = frozenset({"run", "step", "n", "fingerprint", "checkpoint", "dataset", "problems"})


def _two_lines(col: str) -> tuple[str, str]:
    """`gsm8k (8-shot) exact_match,strict-match` -> (`gsm8k (8-shot)`, `exact_match,strict-match`);
    a column with no task label stays on the second line."""
    label, sep, metric = col.rpartition(") ")
    return (label + ")", metric) if sep else ("", col)


def _widths(heads: list[tuple[str, str]], text: list[list[str]]) -> list[int]:
    return [max(len(a), len(b), *(len(r[i]) for r in text)) for i, (a, b) in enumerate(heads)]


def _blocks(heads: list[tuple[str, str]], widths: list[int], width: int) -> list[list[int]]:
    """Column indexes per block: the leading key columns, then as many others as fit `width`
    (at least one)."""
    keys = 0
    while keys < len(heads) and heads[keys][1] in KEY_COLUMNS and not heads[keys][0]:
        keys += 1
    base = sum(widths[:keys]) + 2 * keys
    blocks: list[list[int]] = []
    cols: list[int] = []
    used = base
    for i in range(keys, len(heads)):
        if cols and used + widths[i] > width:
            blocks.append(list(range(keys)) + cols)
            cols, used = [], base
        cols.append(i)
        used += widths[i] + 2
    if cols or not blocks:
        blocks.append(list(range(keys)) + cols)
    return blocks


def _aligned(
    heads: list[tuple[str, str]], text: list[list[str]], widths: list[int], cols: list[int]
) -> list[str]:
    """Right-aligned text lines of `cols`: two header lines (the first left out where empty),
    a rule, the rows."""
    out = [
        "  ".join(heads[i][0].rjust(widths[i]) for i in cols).rstrip(),
        "  ".join(heads[i][1].rjust(widths[i]) for i in cols),
        "  ".join("-" * widths[i] for i in cols),
    ]
    out += ["  ".join(r[i].rjust(widths[i]) for i in cols) for r in text]
    return out if out[0] else out[1:]
