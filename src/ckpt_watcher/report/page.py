"""`watcher report`: one self-contained HTML page for a run, or for several runs compared (no
script, no network: inline CSS and SVG), with a chart per metric by step (stderr band, baseline
line; a curve per run), the results table, the failures still open, the regressions its results
show, and per task a few documents that flipped between its first and last step.

The daemon writes the same page to `<ledger_dir>/<run_path>/report.html` after each ledger
append (`sinks/page.py`), and the ledger mirror uploads it beside the ledger.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ckpt_watcher.durable import write_atomic
from ckpt_watcher.errors import WatcherError
from ckpt_watcher.ledger import REPORT_NAME, is_result, ledger_path, read_lines
from ckpt_watcher.report import samples as samples_mod
from ckpt_watcher.report.compare import Entry, Points, compare_table, curves, length_curves
from ckpt_watcher.report.table import (
    Pairing,
    entry_name,
    metric_table,
    newest_versions,
    task_label,
)

FLIPS_PER_TASK = 5
Judge = Callable[[list[dict[str, Any]]], list[Any]]  # a run's lines -> its regressions
W, H = 560, 240  # one chart's size in px
LEFT, RIGHT, TOP, BOTTOM = 48, 16, 16, 36


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4f}"
    return "" if v is None else str(v)


# --- charts --------------------------------------------------------------------------------------
PALETTE = ("#3b6fd4", "#d9482b", "#1a8f5a", "#8a4fd0", "#c28a00", "#0f8fa3", "#c2417e", "#5c6b7a")


def chart(column: str, named: list[tuple[str, Points]], base: float | None, base_name: str) -> str:
    """An SVG line chart of (step, value, stderr) points, with a ±stderr band and the baseline
    as a dashed line: one curve per (name, points); one unnamed curve for a run alone, else
    each its colour. Each point is a `circle.point` with `data-step` and `data-value` (and
    `data-run`)."""
    every = [p for _, pts in named for p in pts]
    values = [v for _, v, _ in every] + ([base] if base is not None else [])
    lows = [v - e for _, v, e in every] + values
    highs = [v + e for _, v, e in every] + values
    if all(0 <= v <= 1 for v in values):
        y0, y1 = 0.0, 1.0
    else:
        y0, y1 = min(lows), max(highs)
        pad = (y1 - y0) * 0.1 or abs(y1) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    steps = [s for s, _, _ in every]
    x0, x1 = min(steps), max(steps)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1

    def px(step: float) -> float:
        return LEFT + (step - x0) / (x1 - x0) * (W - LEFT - RIGHT)

    def py(v: float) -> float:
        v = min(max(v, y0), y1)
        return TOP + (y1 - v) / (y1 - y0) * (H - TOP - BOTTOM)

    parts = [
        f'<svg class="chart" data-column="{_e(column)}" data-points="{len(every)}" '
        f'data-runs="{len(named)}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
        f'aria-label="{_e(column)} by step">'
    ]
    for i in range(5):  # y grid and ticks
        v = y0 + (y1 - y0) * i / 4
        y = py(v)
        parts.append(
            f'<line class="grid" x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.3g}</text>'
        )
    ticks = sorted(set(steps))
    for s in ticks if len(ticks) <= 8 else [x0, (x0 + x1) // 2, x1]:
        parts.append(
            f'<text class="tick" x="{px(s):.1f}" y="{H - BOTTOM + 16}" '
            f'text-anchor="middle">{s}</text>'
        )
    parts.append(
        f'<text class="axis" x="{(LEFT + W - RIGHT) / 2}" y="{H - 4}" text-anchor="middle">step</text>'
    )
    if base is not None:
        y = py(base)
        parts.append(
            f'<line class="baseline" x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="baseline-label" x="{W - RIGHT - 4}" y="{y - 5:.1f}" '
            f'text-anchor="end">{_e(base_name)} {base:.4g}</text>'
        )
    for n, (name, pts) in enumerate(named):
        paint = "" if len(named) == 1 else PALETTE[n % len(PALETTE)]
        fill = f' style="fill:{paint}"' if paint else ""
        stroke = f' style="stroke:{paint}"' if paint else ""
        if any(e for _, _, e in pts):
            upper = [f"{px(s):.1f},{py(v + e):.1f}" for s, v, e in pts]
            lower = [f"{px(s):.1f},{py(v - e):.1f}" for s, v, e in reversed(pts)]
            parts.append(f'<polygon class="band" points="{" ".join(upper + lower)}"{fill}/>')
        line = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v, _ in pts)
        parts.append(f'<polyline class="curve" points="{line}"{stroke}/>')
        run = f' data-run="{_e(name)}"' if name else ""
        for s, v, e in pts:
            tip = f"{name + ', ' if name else ''}step {s}: {v:.4f}" + (f" ± {e:.4f}" if e else "")
            parts.append(
                f'<circle class="point" data-step="{s}" data-value="{v}"{run} cx="{px(s):.1f}" '
                f'cy="{py(v):.1f}" r="4"{fill}><title>{_e(tip)}</title></circle>'
            )
    parts.append("</svg>")
    return "".join(parts)


def _count(runs: list[str]) -> str:
    return f"{len(runs)} run{'s' if len(runs) != 1 else ''}"


def _legend(entries: list[Entry]) -> str:
    """The colour of each run compared (chart curves follow PALETTE in this order)."""
    items = []
    for n, e in enumerate(entries):
        what = f" (mean ± sd of {_count(e.runs)}: {', '.join(e.runs)})" if e.grouped else ""
        items.append(
            f'<li><span class="swatch" style="background:{PALETTE[n % len(PALETTE)]}"></span>'
            f"{_e(e.name)}{_e(what)}</li>"
        )
    return f'<ul class="legend">{"".join(items)}</ul>'


# --- the page's other parts -----------------------------------------------------------------------
def _table(
    entries: list[Entry],
    baseline: dict[str, Any] | None,
    base_name: str,
    pairing: Pairing | None,
) -> str:
    """The results table: one run's newest step first (the baseline's row stays on top), or the
    runs compared (`compare_table`), each run's steps in order."""
    if _alone(entries):
        table = metric_table(
            entries[0].lines[0],
            baseline=baseline,
            baseline_name=base_name,
            include_stats=True,
            pairing=pairing,
        )
        first = 1 if baseline is not None else 0
        rows = table.rows[:first] + table.rows[first:][::-1]
    else:
        table = compare_table(
            entries, baseline=baseline, baseline_name=base_name, include_stats=True, pairing=pairing
        )
        rows = table.rows
    head = "".join(f"<th>{_e(c)}</th>" for c in table.columns)
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="{"failed" if v == "FAILED" else ""}">{_e(_fmt(v))}</td>' for v in row
        )
        body.append(f"<tr>{cells}</tr>")
    return f'<table class="results"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _alone(entries: list[Entry]) -> bool:
    return len(entries) == 1 and not entries[0].grouped


def _runs(entries: list[Entry]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Every run shown, once, with its ledger lines."""
    out: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        for run, lines in zip(e.runs, e.lines, strict=True):
            out.setdefault(run, lines)
    return list(out.items())


def open_failures(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Failed lines that no later `ok` line for the same checkpoint version and task covers."""
    ok = {
        (
            ln.get("step"),
            ln.get("label"),
            ln.get("fingerprint"),
            entry_name(ln),
            ln.get("num_fewshot"),
        )
        for ln in lines
        if ln.get("status") == "ok"
    }
    seen: set[tuple[Any, ...]] = set()
    out = []
    for ln in reversed(lines):
        key = (
            ln.get("step"),
            ln.get("label"),
            ln.get("fingerprint"),
            entry_name(ln),
            ln.get("num_fewshot"),
        )
        if ln.get("status") != "failed" or key in ok or key in seen:
            continue
        seen.add(key)
        out.append(ln)
    return out


def _failures(entries: list[Entry]) -> str:
    runs = _runs(entries)
    items = []
    for run, lines in runs:
        for ln in open_failures(lines):
            error = (ln.get("error") or "").strip().splitlines()
            step = ln.get("step") if ln.get("step") is not None else ln.get("label")
            when = f", {ln['finished_at']}" if ln.get("finished_at") else ""
            where = f"{run} " if len(runs) > 1 else ""
            items.append(
                f'<li class="failure">{_e(where)}<b>step {_e(step)}</b> {_e(task_label(ln))}'
                f"{_e(when)}: <code>{_e(error[0] if error else '')}</code></li>"
            )
    if not items:
        return '<p class="none">No open failures.</p>'
    return f'<ul class="failures">{"".join(items)}</ul>'


def _regressions(entries: list[Entry], judge: Judge | None) -> str:
    """Each run's standing regressions (`sinks.alerts.standing`): a result below its run's
    best earlier step or the baseline by more than the noise (the paired test over documents,
    or `alerts.drop_stderr` standard errors) and `alerts.min_drop`."""
    if judge is None:
        return '<p class="none">Not judged.</p>'
    runs = _runs(entries)
    rows = []
    for run, lines in runs:
        for r in judge(lines):
            label = task_label({"task": r.task, "num_fewshot": r.num_fewshot})
            where = f"<td>{_e(run)}</td>" if len(runs) > 1 else ""
            rows.append(
                f'<tr class="regression">{where}<td>{r.step}</td>'
                f"<td>{_e(label)}</td><td>{_e(r.metric)}</td>"
                f"<td>{r.value:.4f}</td><td>{_e(r.against)}: {r.reference:.4f}</td>"
                f"<td>{_e(r.beyond_noise())}</td></tr>"
            )
    if not rows:
        return '<p class="none">No regressions.</p>'
    head = "<th>run</th>" if len(runs) > 1 else ""
    return (
        f'<table class="regressions"><thead><tr>{head}<th>step</th><th>task</th><th>metric</th>'
        "<th>value</th><th>below</th><th>beyond the noise</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _flips(ledger_dir: Path, entries: list[Entry]) -> str:
    runs = _runs(entries)
    sections = []
    for run, lines in runs:
        sections += _run_flips(ledger_dir, run, lines, f"{run}: " if len(runs) > 1 else "")
    if not sections:
        return '<p class="none">Flips need per-document records at two evaluated steps.</p>'
    return "".join(sections)


def _run_flips(
    ledger_dir: Path, run_path: str, lines: list[dict[str, Any]], prefix: str
) -> list[str]:
    """Per task, the documents that flipped between its first and its last step with
    per-document records: what training changed (two neighbouring steps often differ in none)."""
    by_task: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for ln in newest_versions(lines):
        if is_result(ln) and ln.get("samples_file") and isinstance(ln.get("step"), int):
            by_task.setdefault((entry_name(ln), ln.get("num_fewshot")), []).append(ln)
    sections = []
    for group in by_task.values():
        if len(group) < 2:
            continue
        a, b = min(group, key=lambda ln: ln["step"]), max(group, key=lambda ln: ln["step"])
        try:
            ra = samples_mod.read_records(ledger_dir, run_path, a)
            rb = samples_mod.read_records(ledger_dir, run_path, b)
            key = samples_mod.headline_metric(rb, None)
        except WatcherError:
            continue
        pairs = samples_mod.flips(ra, rb, key)
        learned = sum(1 for _, r in pairs if samples_mod.is_right(r, key))
        rows = []
        for before, after in pairs[:FLIPS_PER_TASK]:
            now_right = samples_mod.is_right(after, key)
            rows.append(
                f'<tr class="flip {"learned" if now_right else "forgot"}">'
                f"<td>{_e(after['doc_id'])}</td><td><pre>{_e(_clip(after['prompt']))}</pre></td>"
                f"<td>{_e(_clip(after['target']))}</td>"
                f"<td>{_e(_clip(_first(before)))}</td><td>{_e(_clip(_first(after)))}</td>"
                f"<td>{'learned' if now_right else 'forgot'}</td></tr>"
            )
        sections.append(
            f"<h3>{_e(prefix)}{_e(task_label(b))}, {_e(key)}, "
            f"step {a['step']} → step {b['step']}: "
            f"{learned} learned, {len(pairs) - learned} forgot</h3>"
            + (
                '<table class="flips"><thead><tr><th>doc</th><th>prompt</th><th>target</th>'
                f"<th>step {a['step']}</th><th>step {b['step']}</th><th></th></tr></thead>"
                f"<tbody>{''.join(rows)}</tbody></table>"
                if rows
                else '<p class="none">No document flipped.</p>'
            )
        )
    return sections


def _first(rec: dict[str, Any]) -> str:
    responses = rec.get("responses") or [""]
    return str(responses[0])


def _clip(text: Any, width: int = 300) -> str:
    s = str(text)
    return s if len(s) <= width else s[: width - 1] + "…"


STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#1d2430;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #dde}
h3{font-size:14px;margin:16px 0 6px}.meta{color:#667}
.charts{display:flex;flex-wrap:wrap;gap:16px}.card{border:1px solid #e3e6ee;border-radius:6px;padding:8px}
.card h3{margin:0 0 4px;font-weight:600}
svg .grid{stroke:#eef0f4}svg .tick,svg .axis{fill:#667;font-size:11px}
svg .band{fill:#3b6fd4;opacity:.15}svg .curve{fill:none;stroke:#3b6fd4;stroke-width:2}
svg .point{fill:#3b6fd4}svg .baseline{stroke:#d9822b;stroke-dasharray:6 4;stroke-width:1.5}
svg .baseline-label{fill:#d9822b;font-size:11px}
table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #e3e6ee;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f5f6fa}td.failed{color:#b3261e;font-weight:600}tr.learned td:last-child{color:#1a7f37}
tr.forgot td:last-child{color:#b3261e}pre{margin:0;white-space:pre-wrap;max-width:420px}
.none{color:#667}code{font-size:12px}ul.legend{list-style:none;padding:0;display:flex;flex-wrap:wrap;gap:6px 18px}
.swatch{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:6px;vertical-align:-1px}
"""


def render_page(
    lines: list[dict[str, Any]],
    run_path: str,
    ledger_dir: Path,
    baseline: dict[str, Any] | None = None,
    baseline_name: str = "baseline",
    judge: Judge | None = None,
    pairing: Pairing | None = None,
) -> str:
    """The whole page for one run's ledger lines."""
    entries = [Entry(run_path, [run_path], [lines])]
    return render_entries(entries, ledger_dir, baseline, baseline_name, judge, pairing)


def render_entries(
    entries: list[Entry],
    ledger_dir: Path,
    baseline: dict[str, Any] | None = None,
    baseline_name: str = "baseline",
    judge: Judge | None = None,
    pairing: Pairing | None = None,
) -> str:
    """The whole page for one run, or for runs compared (`report.compare`): a chart per metric
    with a curve per run (a group's mean, its sd as the band), one table (its Δ marks by
    `pairing` where it pairs, `report.table.Pairing`), every run's failures, regressions
    (`judge`: a run's ledger lines -> its regressions) and flips."""
    alone = _alone(entries)
    cards = _cards(entries, [curves(e) for e in entries], "card", baseline, baseline_name)
    of_runs = [length_curves(e) for e in entries]
    lengths = _cards(entries, of_runs, "card lengths", None, baseline_name)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    every = [ln for e in entries for ln in e.every_line]
    n_ok = sum(1 for ln in every if is_result(ln))
    title = ", ".join(e.name for e in entries)
    runs = "" if alone else f"{len(_runs(entries))} runs; "
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}: ckpt-watcher report</title><style>{STYLE}</style></head><body>"
        f"<h1>{_e(title)}</h1>"
        f'<p class="meta">{runs}{n_ok} results, {len(every)} ledger lines; written {stamp} by '
        "ckpt-watcher. The ledger is the source of these numbers.</p>"
        + ("" if alone else _legend(entries))
        + "<h2>Metrics by step</h2>"
        + (
            f'<div class="charts">{"".join(cards)}</div>'
            if cards
            else '<p class="none">No results yet.</p>'
        )
        + (
            "<h2>Response lengths by step</h2>"
            '<p class="meta">Tokens per response (mean, p90) and the share the length cap '
            f'stopped.</p><div class="charts">{"".join(lengths)}</div>'
            if lengths
            else ""
        )
        + "<h2>Results</h2>"
        + _table(entries, baseline, baseline_name, pairing)
        + "<h2>Failures</h2>"
        + _failures(entries)
        + "<h2>Regressions</h2>"
        + _regressions(entries, judge)
        + "<h2>Documents that flipped</h2>"
        + _flips(ledger_dir, entries)
        + "</body></html>\n"
    )


def _cards(
    entries: list[Entry],
    series: list[dict[str, Points]],
    css: str,
    baseline: dict[str, Any] | None,
    baseline_name: str,
) -> list[str]:
    """A chart card per column any entry has (`series`: each entry's points by column), a
    curve per entry that has it (unnamed for a run alone)."""
    alone = _alone(entries)
    cards = []
    for column in dict.fromkeys(col for by_column in series for col in by_column):
        named = [
            ("" if alone else e.name, by_column[column])
            for e, by_column in zip(entries, series, strict=True)
            if column in by_column
        ]
        svg = chart(column, named, _base(baseline, column), baseline_name)
        cards.append(f'<div class="{css}"><h3>{_e(column)}</h3>{svg}</div>')
    return cards


def _base(baseline: dict[str, Any] | None, column: str) -> float | None:
    v = (baseline or {}).get(column)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def write_report(
    ledger_dir: Path,
    run_path: str,
    out: Path | None = None,
    baseline: dict[str, Any] | None = None,
    baseline_name: str = "baseline",
    judge: Judge | None = None,
    pairing: Pairing | None = None,
) -> Path:
    """Write the run's page (default `<ledger_dir>/<run_path>/report.html`); returns the path."""
    entries = [Entry(run_path, [run_path], [read_lines(ledger_path(ledger_dir, run_path)).lines])]
    out = out or ledger_dir / run_path / REPORT_NAME
    return write_comparison(entries, ledger_dir, out, baseline, baseline_name, judge, pairing)


def write_comparison(
    entries: list[Entry],
    ledger_dir: Path,
    out: Path,
    baseline: dict[str, Any] | None = None,
    baseline_name: str = "baseline",
    judge: Judge | None = None,
    pairing: Pairing | None = None,
) -> Path:
    """Write the page of runs compared (or of one run) to `out`; returns it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    page = render_entries(entries, ledger_dir, baseline, baseline_name, judge, pairing)
    write_atomic(out, page)
    return out
