"""One step of a sampled suite as the table DeepScaleR's users read (`watcher results RUN --step
N [--suite math-passk]`): a row per dataset (task) with its number of problems and pass@1 ...
pass@K, and an AGGREGATE row, each pass@k averaged over datasets weighted by their problems."""

from __future__ import annotations

import re
from typing import Any

from ckpt_watcher.ledger import is_result
from ckpt_watcher.report.table import Table, entry_name, newest_versions

PASS_AT = re.compile(r"^(?P<metric>.+)_pass@(?P<k>\d+),(?P<filter>.*)$")
AGGREGATE = "AGGREGATE"


def passk_metric(key: str) -> tuple[str, str] | None:
    """`math_verify_pass@16,final-answer` -> (`math_verify`, `final-answer`); None for a key
    that is no pass@k (or is its stderr)."""
    m = PASS_AT.match(key)
    return (m["metric"], m["filter"]) if m and not m["metric"].endswith("_stderr") else None


def dataset_table(
    lines: list[dict[str, Any]],
    step: int,
    tasks: list[tuple[str, int | None, str | None]] | None = None,
) -> Table:
    """The table of `step`'s sampled results (newest checkpoint version, ok lines). `tasks`:
    (task or entry name, shots, headline key) in order (a suite's), the headline naming the metric and
    filter whose pass@k to show; default every sampled task of the step by name, each with the
    first metric that has a pass@k. Columns: dataset, problems, pass@k for every k any row has."""
    at_step = [
        ln
        for ln in newest_versions(lines)
        if ln.get("step") == step and is_result(ln) and ln.get("pass_at")
    ]
    chosen: list[tuple[dict[str, Any], str | None]] = []
    if tasks is None:
        last = {(entry_name(ln), ln.get("num_fewshot")): ln for ln in at_step}
        chosen = [(last[key], None) for key in sorted(last, key=str)]
    else:
        for task, shots, key in tasks:
            found = [
                ln for ln in at_step if (entry_name(ln), ln.get("num_fewshot")) == (task, shots)
            ]
            if found:  # the last ok line of the task at that step
                chosen.append((found[-1], key))
    rows: list[tuple[str, int | None, dict[int, float]]] = []
    for ln, key in chosen:
        rows.append((entry_name(ln), ln.get("n_samples"), _pass_at(ln, key)))
    ks = sorted({k for _, _, by_k in rows for k in by_k})
    out = [[name, n, *(by_k.get(k) for k in ks)] for name, n, by_k in rows]
    if rows:
        out.append([AGGREGATE, *_aggregate(rows, ks)])
    return Table(["dataset", "problems", *(f"pass@{k}" for k in ks)], out)


def _pass_at(line: dict[str, Any], headline: str | None) -> dict[int, float]:
    """A line's pass@k by k, for the headline's metric and filter (`math_verify_pass@16,x` or
    the plain mean `math_verify,x`), or else its first metric with a pass@k."""
    want = None
    if headline:
        metric, _, filt = headline.partition(",")
        want = passk_metric(headline) or (metric, filt)
    out: dict[int, float] = {}
    for key, value in line.get("metrics", {}).items():
        m = PASS_AT.match(key)
        if not m or passk_metric(key) is None or not isinstance(value, int | float):
            continue
        if want is None:
            want = (m["metric"], m["filter"])
        if (m["metric"], m["filter"]) == want:
            out[int(m["k"])] = float(value)
    return out


def _aggregate(rows: list[tuple[str, int | None, dict[int, float]]], ks: list[int]) -> list[Any]:
    """(problems, each pass@k weighted by problems); a k that some dataset lacks, or a dataset
    whose problem count is unknown, leaves that figure empty rather than skewed."""
    counts = [n for _, n, _ in rows if isinstance(n, int) and n > 0]
    if len(counts) < len(rows):
        return [None, *(None for _ in ks)]
    total = sum(counts)
    figures: list[float | None] = []
    for k in ks:
        if any(k not in by_k for _, _, by_k in rows):
            figures.append(None)
        else:
            figures.append(
                sum(n * by_k[k] for n, (_, _, by_k) in zip(counts, rows, strict=True)) / total
            )
    return [total, *figures]
