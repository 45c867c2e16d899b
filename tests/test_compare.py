"""Comparing runs: `watcher results|plot|report -c C RUN [RUN ...]` (seeds and ablations in one
table, one plot, one page; `--mean` groups a pattern's runs), and tables that fit a terminal."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckpt_watcher.cli import main
from ckpt_watcher.ledger import append

from .conftest import WATCHER, write_config

STRICT, FLEX = "exact_match,strict-match", "exact_match,flexible-extract"
COL = f"gsm8k (8-shot) {STRICT}"
# run -> its score offset; lr1_seed3 has no step 300 yet
RUNS = {"lr1_seed1": 0.0, "lr1_seed2": 0.1, "lr1_seed3": 0.05, "lr2_seed1": 0.3}


def score(run: str, step: int) -> float:
    return round(step / 1000 + RUNS[run], 4)


def sweep(tmp_path: Path, baseline: bool = False) -> Path:
    """Four runs under sweep/ (three seeds of lr1, one of lr2), gsm8k 8-shot at steps 100-300."""
    ledgers = tmp_path / "l"
    for run in RUNS:
        for step in (100, 200, 300):
            if run == "lr1_seed3" and step == 300:
                continue
            acc = score(run, step)
            metrics = {STRICT: acc, "exact_match_stderr,strict-match": 0.02, FLEX: acc + 0.01}
            append(ledgers, _line(run, step, metrics))
    data: dict[str, Any] = {
        "state_dir": str(tmp_path / "s"),
        "ledger_dir": str(ledgers),
        "sources": [{"kind": "local", "path": str(tmp_path)}],
        "eval": {"tasks": [{"task": "gsm8k", "num_fewshot": 8}]},
    }
    if baseline:
        data["baseline"] = {
            "name": "base",
            "metrics": [{"task": "gsm8k", "num_fewshot": 8, "metrics": {STRICT: 0.1}}],
        }
    return write_config(tmp_path / "w.yaml", data)


def _line(run: str, step: int, metrics: dict[str, float], **over: Any) -> dict[str, Any]:
    return {
        "run": run,
        "run_path": f"sweep/{run}",
        "step": step,
        "label": f"{run}_step{step}",
        "task": "gsm8k",
        "num_fewshot": 8,
        "status": "ok",
        "metrics": metrics,
    } | over


def results(cfg: Path, *args: str, env: dict[str, str | None] | None = None) -> Any:
    return CliRunner().invoke(main, ["results", "-c", str(cfg), *args], env=env)


def rows(cfg: Path, *args: str) -> list[dict[str, Any]]:
    out = results(cfg, *args, "--format", "json")
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_results_of_several_runs_in_one_table_with_a_run_column(tmp_path: Path) -> None:
    cfg = sweep(tmp_path)
    got = rows(cfg, "lr1_seed1", "sweep/lr2_seed1")
    assert [(r["run"], r["step"], r[COL]) for r in got] == [
        ("sweep/lr1_seed1", 100, 0.1),
        ("sweep/lr1_seed1", 200, 0.2),
        ("sweep/lr1_seed1", 300, 0.3),
        ("sweep/lr2_seed1", 100, 0.4),
        ("sweep/lr2_seed1", 200, 0.5),
        ("sweep/lr2_seed1", 300, 0.6),
    ]
    # a quoted pattern names every run it matches, by path or by name
    assert {r["run"] for r in rows(cfg, "lr1_*")} == {f"sweep/lr1_seed{i}" for i in (1, 2, 3)}
    assert {r["run"] for r in rows(cfg, "sweep/*seed1")} == {"sweep/lr1_seed1", "sweep/lr2_seed1"}
    # one run alone keeps its own table (no run column)
    assert "run" not in rows(cfg, "lr2_seed1")[0]
    for fmt in ("csv", "md", "table"):
        out = results(cfg, "lr1_seed1", "lr2_seed1", "--format", fmt)
        assert out.exit_code == 0 and "sweep/lr2_seed1" in out.output and "0.6" in out.output


def test_an_unknown_run_or_a_pattern_matching_none_exits_1_naming_the_runs(tmp_path: Path) -> None:
    cfg = sweep(tmp_path)
    for args in (["lr1_seed1", "nope"], ["lr9_*"]):
        out = results(cfg, *args)
        assert out.exit_code == 1, out.output
        assert "sweep/lr1_seed1, sweep/lr1_seed2" in out.output
    out = results(cfg, "lr1_seed1", "lr2_seed1", "--all")
    assert out.exit_code == 2 and "one RUN" in out.output


def test_mean_groups_a_patterns_runs_into_mean_sd_and_n_per_step(tmp_path: Path) -> None:
    cfg = sweep(tmp_path, baseline=True)
    got = rows(cfg, "lr1_seed*", "lr2_seed1", "--mean")
    assert got[0]["run"] == "base" and got[0][COL] == 0.1  # the baseline's row first
    by = {(r["run"], r["step"]): r for r in got[1:]}
    assert sorted(by) == [(g, s) for g in ("lr1_seed*", "lr2_seed1") for s in (100, 200, 300)]
    for step, seeds in [(100, (1, 2, 3)), (300, (1, 2))]:  # seed 3 has no step 300
        values = [score(f"lr1_seed{i}", step) for i in seeds]
        row = by[("lr1_seed*", step)]
        assert row["n"] == len(seeds)
        assert row[COL] == pytest.approx(statistics.mean(values))
        assert row[COL + " sd"] == pytest.approx(statistics.stdev(values))
    one = by[("lr2_seed1", 200)]
    assert one["n"] == 1 and one[COL] == 0.5 and one[COL + " sd"] is None
    # Δ to the baseline, marked beyond twice the standard error of the mean: lr2 +0.4 is
    # (a group of one has no spread: no mark); lr1 at 100 is +0.05 with se 0.05/√3: not
    assert by[("lr1_seed*", 100)][f"Δ {COL}"] == "+0.0500"
    assert by[("lr1_seed*", 300)][f"Δ {COL}"] == "+0.2500*"
    assert one[f"Δ {COL}"] == "+0.4000"


def test_mean_with_stats_averages_response_lengths_over_the_seeds(tmp_path: Path) -> None:
    """`--mean --stats`: a group's response lengths are its runs' mean and sd per step, as its
    metrics are; `plot --stats --mean` draws them with the sd as error bars."""
    from ckpt_watcher.report.compare import Entry, length_curves
    from ckpt_watcher.report.plot import lengths_figure

    ledgers = tmp_path / "l"
    tokens = {"lr1_seed1": 100.0, "lr1_seed2": 140.0, "lr1_seed3": 120.0}
    for run, mean in tokens.items():
        stats = {
            "response_tokens": {"mean": mean, "p50": mean, "p90": mean * 2, "max": 512},
            "length_capped_rate": mean / 1000,
        }
        append(ledgers, _line(run, 400, {STRICT: 0.5}, **stats))
    cfg = sweep(tmp_path)  # steps 100-300 of each run, without lengths
    by = {r["step"]: r for r in rows(cfg, "lr1_seed*", "--mean", "--stats")}
    col = "gsm8k (8-shot) response_tokens.mean"
    assert by[400][col] == pytest.approx(statistics.mean(tokens.values()))
    assert by[400][col + " sd"] == pytest.approx(statistics.stdev(tokens.values()))
    capped = "gsm8k (8-shot) length_capped_rate"
    assert by[400][capped] == pytest.approx(0.12) and by[200].get(col) is None
    lines = [
        [ln for ln in (json.loads(x) for x in (ledgers / f"sweep/{run}/ledger.jsonl").open())]
        for run in tokens
    ]
    group = Entry("lr1_seed*", [f"sweep/{r}" for r in tokens], lines, grouped=True)
    ((step, mean, sd),) = length_curves(group)[col]
    assert (step, mean) == (400, pytest.approx(120.0)) and sd == pytest.approx(20.0)
    fig, drawn = lengths_figure([group])
    assert drawn == 3  # mean, p90 and the capped share


def test_a_table_wider_than_the_terminal_is_wrapped_to_fit_with_every_name_whole(
    tmp_path: Path,
) -> None:
    cfg = sweep(tmp_path)
    wide = results(cfg, "lr1_seed*", "--mean", "--stderr", env={"COLUMNS": None})
    assert wide.exit_code == 0
    assert max(len(x) for x in wide.output.splitlines()) > 150  # no terminal: one line per row
    assert len(wide.output.splitlines()) == 2 + 3
    out = results(cfg, "lr1_seed*", "--mean", "--stderr", env={"COLUMNS": "90"})
    assert out.exit_code == 0
    lines = out.output.splitlines()
    assert max(len(x) for x in lines) <= 90
    blocks = out.output.strip().split("\n\n")
    assert len(blocks) >= 2
    for block in blocks:  # each block repeats run, step and n and shows every step
        head = block.splitlines()
        assert head[0].strip().startswith("gsm8k (8-shot)")
        assert head[1].split()[:3] == ["run", "step", "n"]
        assert [x.split()[1] for x in head[3:]] == ["100", "200", "300"]
    for name in (STRICT, f"{STRICT} sd", FLEX, f"{FLEX} sd"):  # every column, its name whole
        assert any(x.strip().endswith(name) or f"  {name}  " in x for x in lines), name
    # a one-run table that fits stays as it was
    narrow = results(cfg, "lr2_seed1", env={"COLUMNS": "120"})
    assert narrow.output.splitlines()[0].split()[:3] == ["step", "gsm8k", "(8-shot)"]


def test_plot_of_several_runs_a_colour_per_run_and_a_groups_sd_as_its_bars(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    from ckpt_watcher.ledger import ledger_path, read_lines
    from ckpt_watcher.report.compare import Entry
    from ckpt_watcher.report.plot import figure_of

    sweep(tmp_path)
    runs = [f"sweep/lr1_seed{i}" for i in (1, 2, 3)]
    lines = [read_lines(ledger_path(tmp_path / "l", r)).lines for r in runs]
    other = read_lines(ledger_path(tmp_path / "l", "sweep/lr2_seed1")).lines
    entries = [Entry("lr1_seed*", runs, lines, grouped=True), Entry("lr2", ["lr2"], [other])]
    fig, drawn = figure_of(entries)
    assert drawn == 4  # 2 entries x 2 metrics
    series = {c.get_label(): c for c in fig.axes[0].containers}
    group = series[f"lr1_seed* (mean ± sd of 3 runs): {COL}"]
    alone = series[f"lr2: {COL}"]
    line = group.lines[0]
    assert list(line.get_ydata()) == pytest.approx([0.15, 0.25, 0.35])
    (segments,) = group.lines[2]
    low, high = segments.get_segments()[0][:, 1]
    assert high - low == pytest.approx(2 * statistics.stdev([0.1, 0.2, 0.15]))
    assert line.get_color() != alone.lines[0].get_color()  # a colour per run
    flex = series[f"lr2: gsm8k (8-shot) {FLEX}"].lines[0]
    assert flex.get_color() == alone.lines[0].get_color() and flex.get_marker() != line.get_marker()
    plt.close(fig)
    out = CliRunner().invoke(
        main,
        [
            "plot",
            "-c",
            str(tmp_path / "w.yaml"),
            "lr1_*",
            "lr2_seed1",
            "-o",
            str(tmp_path / "p.png"),
        ],
    )
    assert out.exit_code == 0 and "(8 series)" in out.output, out.output
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_report_of_several_runs_is_one_page_with_a_curve_per_run(tmp_path: Path) -> None:
    cfg = sweep(tmp_path)
    append(
        tmp_path / "l",
        _line("lr2_seed1", 400, {}, status="failed", error="CUDA out of memory"),
    )
    runner = CliRunner()
    no_output = runner.invoke(main, ["report", "-c", str(cfg), "lr1_seed1", "lr2_seed1"])
    assert no_output.exit_code == 2 and "-o FILE.html" in no_output.output
    out = tmp_path / "cmp.html"
    r = runner.invoke(
        main, ["report", "-c", str(cfg), "lr1_seed*", "lr2_seed1", "--mean", "-o", str(out)]
    )
    assert r.exit_code == 0, r.output
    page = out.read_text()
    assert page.count('class="chart"') == 2 and page.count('data-runs="2"') == 2
    assert page.count('data-run="lr1_seed*"') == 6  # 3 steps x 2 charts
    assert "mean ± sd of 3 runs: sweep/lr1_seed1, sweep/lr1_seed2, sweep/lr1_seed3" in page
    assert "sweep/lr2_seed1 <b>step 400</b>" in page and "CUDA out of memory" in page
    assert "<script" not in page


def test_watcher_compares_runs_as_printed_from_a_shell(tmp_path: Path) -> None:
    """The installed command, a pattern quoted as the README shows, through a real shell."""
    cfg = sweep(tmp_path)
    env = os.environ | {"COLUMNS": "80"}
    command = f"{' '.join(WATCHER)} results -c {cfg} 'lr1_seed*' lr2_seed1 --mean"
    r = subprocess.run(command, shell=True, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "lr1_seed*" in r.stdout and max(len(x) for x in r.stdout.splitlines()) <= 80
