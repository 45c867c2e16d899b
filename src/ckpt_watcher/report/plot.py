"""`watcher plot`: each metric of a run against the step, from its ledger, as a PNG, with its
stderr as error bars, the baseline (when the config has one) as a dashed line, and the steps the
backlog policy skipped as crosses on the step axis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_watcher.report.table import metric_series

MARKERS = "osD^v<>ph"
LINESTYLES = ("-", ":", "-.")  # "--" is the baseline's


def plot_run(
    lines: list[dict[str, Any]],
    run: str,
    out: Path,
    baseline: dict[str, Any] | None = None,
    baseline_name: str = "baseline",
) -> int:
    """Write the PNG; returns how many series were drawn."""
    import matplotlib.pyplot as plt

    fig, drawn = figure(lines, run, baseline, baseline_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return drawn


def figure(
    lines: list[dict[str, Any]],
    run: str,
    baseline: dict[str, Any] | None = None,
    baseline_name: str = "baseline",
) -> tuple[Any, int]:
    """(the figure, how many series): one per task/metric column (steps on x). The y axis spans
    [0, 1] when every value drawn lies in it (accuracies, pass@k)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none touched
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    drawn, values, based = 0, list[float](), False
    for i, (column, points) in enumerate(metric_series(lines).items()):
        xs, ys, errs = zip(*points, strict=True)
        # series with equal values stay visible: each its own hollow marker and line style,
        # each later one smaller (rings inside rings); points at 0 or 1 are drawn whole
        bars = ax.errorbar(
            xs,
            ys,
            yerr=errs,
            marker=MARKERS[i % len(MARKERS)],
            markersize=max(3.0, 10.0 - 2.5 * (i % 4)),
            markerfacecolor="none",
            markeredgewidth=1.5,
            linestyle=LINESTYLES[i % len(LINESTYLES)],
            capsize=3,
            label=column,
            clip_on=False,
        )
        values += ys
        base = (baseline or {}).get(column)
        if isinstance(base, int | float):
            color = bars.lines[0].get_color()
            label = "_nolegend_" if based else f"{baseline_name} (dashed, each metric's colour)"
            ax.axhline(base, color=color, linestyle="--", linewidth=1, label=label)
            based = True
            values.append(base)
        drawn += 1
    gaps = skipped_steps(lines)
    if gaps:  # steps the policy skipped (the backlog): marked on the step axis, not drawn as 0
        ax.plot(
            gaps,
            [0.0] * len(gaps),
            marker="x",
            linestyle="none",
            color="0.45",
            transform=ax.get_xaxis_transform(),
            clip_on=False,
            label="skipped (backlog)",
        )
    if values and all(0 <= v <= 1 for v in values):
        ax.set_ylim(0, 1)
    ax.set_xlabel("step")
    ax.set_ylabel("metric")
    ax.set_title(f"{run}: lm-eval metrics by step")
    ax.grid(True, alpha=0.3)
    if drawn or gaps:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig, drawn


def skipped_steps(lines: list[dict[str, Any]]) -> list[int]:
    """Steps with a `skipped` line and no `ok` one."""
    ok = {ln.get("step") for ln in lines if ln.get("status") == "ok"}
    return sorted(
        {
            ln["step"]
            for ln in lines
            if ln.get("status") == "skipped" and isinstance(ln.get("step"), int)
        }
        - ok
    )
