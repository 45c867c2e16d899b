"""`watcher plot`: each metric of a run against the step, from its ledger, as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_watcher.report import metric_table


def plot_run(lines: list[dict[str, Any]], run: str, out: Path) -> int:
    """Draw one line per task/metric column (steps on x); returns how many series were drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none touched
    import matplotlib.pyplot as plt

    table = metric_table(lines)
    rows = [r for r in table.rows if isinstance(r[0], int)]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    drawn = 0
    for i, column in enumerate(table.columns[1:], start=1):
        points = [(r[0], r[i]) for r in rows if isinstance(r[i], int | float)]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=column)
            drawn += 1
    ax.set_xlabel("step")
    ax.set_ylabel("metric")
    ax.set_title(f"{run}: lm-eval metrics by step")
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return drawn
