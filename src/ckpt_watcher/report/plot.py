"""`watcher plot`: each metric of a run (or of several runs compared) against the step, from
the ledgers, as a PNG, with its stderr (a group's sd) as error bars, the baseline (when the
config has one) as a dashed line, and the steps the backlog policy skipped as crosses on the
step axis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_watcher.report.compare import Entry, curves, length_curves

MARKERS = "osD^v<>ph"
LINESTYLES = ("-", ":", "-.")  # "--" is the baseline's
# an axis of shares (accuracy, pass@k): 0 to 1, with room beyond so a marker at 0 or 1 is
# drawn whole inside the frame, not cut in half by it
SHARE_LIMITS = (-0.05, 1.05)
SHARE_TICKS = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]


def plot_run(
    lines: list[dict[str, Any]],
    run: str,
    out: Path,
    baseline: dict[str, Any] | None = None,
    baseline_name: str = "baseline",
) -> int:
    """Write one run's PNG; returns how many series were drawn."""
    return plot_entries([Entry(run, [run], [lines])], out, baseline, baseline_name)


def plot_entries(
    entries: list[Entry],
    out: Path,
    baseline: dict[str, Any] | None = None,
    baseline_name: str = "baseline",
    stats: bool = False,
) -> int:
    """Write the PNG of runs compared (`report.compare`); returns how many series were drawn.
    `stats`: their response lengths (`lengths_figure`) instead of their metrics."""
    import matplotlib.pyplot as plt

    fig, drawn = lengths_figure(entries) if stats else figure_of(entries, baseline, baseline_name)
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
    """(the figure, how many series) of one run."""
    return figure_of([Entry(run, [run], [lines])], baseline, baseline_name)


def figure_of(
    entries: list[Entry],
    baseline: dict[str, Any] | None = None,
    baseline_name: str = "baseline",
) -> tuple[Any, int]:
    """(the figure, how many series): one per entry and task/metric column (steps on x), its
    stderr (a group's sd across runs) as error bars. One run: a colour per metric. Several: a
    colour per run, a marker and line style per metric. The y axis shows [0, 1] when every
    value drawn lies in it (accuracies, pass@k), with room for a marker at either end; the
    legend stands beside the plot, never over a point."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none touched
    import matplotlib.pyplot as plt

    one = len(entries) == 1
    fig, ax = plt.subplots(figsize=(9, 4.5) if one else (11, 5.5), dpi=120)
    drawn, values, based = 0, list[float](), set[str]()
    of_entry = [curves(e) for e in entries]
    order = list(dict.fromkeys(col for c in of_entry for col in c))
    for e, (entry, series) in enumerate(zip(entries, of_entry, strict=True)):
        for column, points in series.items():
            m = order.index(column)
            xs, ys, errs = zip(*points, strict=True)
            # series with equal values stay visible: each its own hollow marker and line style,
            # each later one smaller (rings inside rings); points at 0 or 1 are drawn whole
            k = m if one else e
            bars = ax.errorbar(
                xs,
                ys,
                yerr=errs,
                marker=MARKERS[m % len(MARKERS)],
                markersize=max(3.0, 10.0 - 2.5 * (k % 4)),
                markerfacecolor="none",
                markeredgewidth=1.5,
                linestyle=LINESTYLES[m % len(LINESTYLES)],
                capsize=3,
                color=None if one else f"C{e % 10}",
                label=column if one else _label(entry, column),
                clip_on=False,
            )
            values += ys
            base = (baseline or {}).get(column)
            if isinstance(base, int | float) and column not in based:
                color = bars.lines[0].get_color() if one else "0.3"
                what = "dashed, each metric's colour" if one else "dashed"
                label = "_nolegend_" if based else f"{baseline_name} ({what})"
                ax.axhline(base, color=color, linestyle="--", linewidth=1, label=label)
                based.add(column)
                values.append(base)
            drawn += 1
        gaps = skipped_steps(entry.every_line)
        if gaps:  # steps the policy skipped (the backlog): marked on the step axis, not drawn as 0
            ax.plot(
                gaps,
                [0.0] * len(gaps),
                marker="x",
                linestyle="none",
                color="0.45" if one else f"C{e % 10}",
                transform=ax.get_xaxis_transform(),
                clip_on=False,
                label="skipped (backlog)" if one else f"{entry.name}: skipped (backlog)",
            )
    if values and all(0 <= v <= 1 for v in values):
        _shares(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("metric")
    ax.set_title(f"{_title(entries)}: lm-eval metrics by step")
    ax.grid(True, alpha=0.3)
    _legend(ax, 8 if one else 7)
    fig.tight_layout()
    return fig, drawn


def _shares(ax: Any) -> None:
    ax.set_ylim(*SHARE_LIMITS)
    ax.set_yticks(SHARE_TICKS)


def _legend(ax: Any, fontsize: int) -> None:
    """The legend beside the plot, never over its points (the last step sits at the right
    edge, often at 1.0, where a legend inside would land)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def lengths_figure(entries: list[Entry]) -> tuple[Any, int]:
    """(the figure, how many series) of response lengths by step: tokens per response (mean,
    p90) above, the share the length cap stopped (and, with think_end, left unterminated)
    below on [0, 1]. One run: a colour per column; several: a colour per run, a group as its
    runs' mean with their sd as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one = len(entries) == 1
    fig, (tokens_ax, share_ax) = plt.subplots(2, 1, figsize=(9, 6.5), dpi=120, sharex=True)
    of_entry = [length_curves(e) for e in entries]
    order = list(dict.fromkeys(col for c in of_entry for col in c))
    drawn = 0
    for e, (entry, series) in enumerate(zip(entries, of_entry, strict=True)):
        for column, points in series.items():
            m = order.index(column)
            xs, ys, sds = zip(*points, strict=True)
            tokens = column.rsplit(" ", 1)[-1].startswith("response_tokens.")
            ax = tokens_ax if tokens else share_ax
            style: dict[str, Any] = {
                "marker": MARKERS[m % len(MARKERS)],
                "markerfacecolor": "none",
                "linestyle": LINESTYLES[m % len(LINESTYLES)],
                "color": None if one else f"C{e % 10}",
                "label": column if one else _label(entry, column),
                "clip_on": False,
            }
            if entry.grouped:  # the runs' mean, their sd as error bars
                ax.errorbar(xs, ys, yerr=sds, capsize=3, **style)
            else:
                ax.plot(xs, ys, **style)
            drawn += 1
    tokens_ax.set_ylim(bottom=0)
    tokens_ax.set_ylabel("tokens per response")
    share_ax.set_ylabel("share of responses")
    _shares(share_ax)
    share_ax.set_xlabel("step")
    tokens_ax.set_title(f"{_title(entries)}: response lengths")
    for ax in (tokens_ax, share_ax):
        ax.grid(True, alpha=0.3)
        _legend(ax, 7)
    fig.tight_layout()
    return fig, drawn


def _title(entries: list[Entry]) -> str:
    """The runs' names, or how many there are where the names would not fit a title."""
    names = ", ".join(e.name for e in entries)
    return names if len(names) <= 70 else f"{len(entries)} runs"


def _label(entry: Entry, column: str) -> str:
    if entry.grouped:
        n = len(entry.runs)
        return f"{entry.name} (mean ± sd of {n} run{'s' if n != 1 else ''}): {column}"
    return f"{entry.name}: {column}"


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
