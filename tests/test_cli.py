"""CLI ergonomics: every command has help text and is documented in the getting-started guide; results output."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from ckpt_watcher.cli import main
from ckpt_watcher.errors import StateError
from ckpt_watcher.ledger import append
from ckpt_watcher.state import DB_NAME, State

from .conftest import REPO, idle_config, write_config

COMMANDS = sorted(main.commands)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help_and_is_in_the_getting_started_guide(name: str) -> None:
    cmd = main.commands[name]
    assert isinstance(cmd, click.Command) and cmd.help and len(cmd.help) > 20
    result = CliRunner().invoke(main, [name, "--help"])
    assert result.exit_code == 0 and "Usage:" in result.output
    assert f"watcher {name}" in (REPO / "docs" / "getting-started.md").read_text()


def _ledger(tmp_path: Path) -> Path:
    cfg = write_config(
        tmp_path / "w.yaml",
        {
            "state_dir": str(tmp_path / "s"),
            "ledger_dir": str(tmp_path / "l"),
            "sources": [{"kind": "local", "path": str(tmp_path)}],
            "eval": {"tasks": [{"task": "gsm8k", "num_fewshot": 8}]},
        },
    )
    for step, acc, status in [(200, 0.5, "ok"), (100, 0.25, "ok"), (300, 0.0, "failed")]:
        metrics = {"exact_match,strict-match": acc, "exact_match_stderr,strict-match": 0.1}
        append(tmp_path / "l", _gsm8k_line(step, metrics if status == "ok" else {}, status))
    return cfg


def _gsm8k_line(step: int, metrics: dict[str, float], status: str = "ok", **extra: Any) -> dict:
    """A ledger line of run `r`: gsm8k 8-shot at `step`."""
    return {
        "run": "r",
        "step": step,
        "label": f"r_step{step}",
        "task": "gsm8k",
        "num_fewshot": 8,
        "status": status,
        "metrics": metrics,
    } | extra


@pytest.mark.parametrize("fmt", ["table", "md", "csv", "json"])
def test_results_formats(tmp_path: Path, fmt: str) -> None:
    cfg = _ledger(tmp_path)
    result = CliRunner().invoke(main, ["results", "-c", str(cfg), "r", "--format", fmt])
    assert result.exit_code == 0, result.output
    out = result.output
    if fmt == "json":
        rows = json.loads(out)
        assert [r["step"] for r in rows] == [100, 200, 300]
        assert rows[1]["gsm8k (8-shot) exact_match,strict-match"] == 0.5
    else:
        assert out.index("100") < out.index("200") < out.index("300")
        assert "0.5" in out and "stderr" not in out


def test_results_for_an_unknown_run_lists_the_known_ones(tmp_path: Path) -> None:
    cfg = _ledger(tmp_path)
    result = CliRunner().invoke(main, ["results", "-c", str(cfg), "nope"])
    assert result.exit_code == 1 and "runs: r" in result.output


def _two_jobs_reusing_a_run_name(tmp_path: Path) -> Path:
    cfg = _ledger(tmp_path)
    for job, acc in [("jobA", 0.25), ("jobB", 0.75)]:
        append(
            tmp_path / "l",
            {
                "run": "mix",
                "run_path": f"{job}/mix",
                "step": 100,
                "label": "mix_step100",
                "task": "gsm8k",
                "num_fewshot": 8,
                "status": "ok",
                "metrics": {"exact_match,strict-match": acc},
                "fingerprint": f"sampled:{job}",
            },
        )
    return cfg


def test_a_run_is_named_by_its_run_path_or_by_a_run_name_only_one_path_has(tmp_path: Path) -> None:
    cfg = _two_jobs_reusing_a_run_name(tmp_path)
    runner = CliRunner()
    out = runner.invoke(main, ["results", "-c", str(cfg), "jobB/mix", "--format", "json"])
    assert (
        out.exit_code == 0
        and json.loads(out.output)[0]["gsm8k (8-shot) exact_match,strict-match"] == 0.75
    )
    ambiguous = runner.invoke(main, ["results", "-c", str(cfg), "mix"])
    assert ambiguous.exit_code == 2
    assert (
        "run name 'mix' is used by 2 runs: jobA/mix, jobB/mix; give the run path"
        in ambiguous.output
    )
    assert runner.invoke(main, ["results", "-c", str(cfg), "r"]).exit_code == 0  # one path: r


def test_results_show_the_newest_version_of_a_rewritten_step_and_all_with_all(
    tmp_path: Path,
) -> None:
    cfg = _ledger(tmp_path)
    for fp, acc in [("sampled:aaa", 0.1), ("sampled:bbb", 0.9)]:
        append(
            tmp_path / "l",
            {
                "run": "r",
                "run_path": "r",
                "step": 400,
                "label": "r_step400",
                "checkpoint": "/c/r_step400",
                "task": "gsm8k",
                "num_fewshot": 8,
                "status": "ok",
                "metrics": {"exact_match,strict-match": acc},
                "fingerprint": fp,
            },
        )
    runner = CliRunner()
    rows = json.loads(
        runner.invoke(main, ["results", "-c", str(cfg), "r", "--format", "json"]).output
    )
    assert [(r["step"], r["gsm8k (8-shot) exact_match,strict-match"]) for r in rows][-1] == (
        400,
        0.9,
    )
    assert [r["step"] for r in rows] == [100, 200, 300, 400]
    every = json.loads(
        runner.invoke(main, ["results", "-c", str(cfg), "r", "--all", "--format", "json"]).output
    )
    assert [(r["step"], r["fingerprint"]) for r in every if r["step"] == 400] == [
        (400, "sampled:aaa"),
        (400, "sampled:bbb"),
    ]


def test_status_without_state_says_so(tmp_path: Path) -> None:
    cfg = _ledger(tmp_path)
    result = CliRunner().invoke(main, ["status", "-c", str(cfg)])
    assert result.exit_code == 3 and "daemon has not run" in result.output


def test_status_while_the_daemon_creates_its_state_says_so_and_never_crashes(
    tmp_path: Path,
) -> None:
    """The daemon's first open creates the database file, then its tables: `watcher status`
    (and every reader) between the two used to die on `no such table: meta` (seen in CI)."""
    cfg = _ledger(tmp_path)
    state_dir = tmp_path / "s"  # _ledger's state_dir
    state_dir.mkdir()
    sqlite3.connect(state_dir / DB_NAME).execute("PRAGMA journal_mode=WAL").fetchone()
    result = CliRunner().invoke(main, ["status", "-c", str(cfg)])
    assert result.exit_code == 3 and "no tables yet" in result.output, result.output

    # a reader racing the writer sees no state, or all of it (the schema is one transaction)
    for attempt in range(30):
        where = tmp_path / f"race{attempt}"
        writer = threading.Thread(target=lambda w=where: State(w).close())
        writer.start()
        while True:
            try:
                reader = State(where, readonly=True)
            except StateError:
                if not writer.is_alive():
                    writer.join()
                    reader = State(where, readonly=True)
                else:
                    continue
            assert reader.get_meta("daemon_pid") is None and reader.jobs("running") == []
            reader.close()
            break
        writer.join()


def test_doctor_reports_each_check_and_fails_on_a_missing_source(tmp_path: Path) -> None:
    import subprocess

    from ckpt_watcher.demo.tiny import write_task

    from .conftest import WATCHER

    # a task of an include_path: lm-eval's own thousands of task YAMLs are never indexed for it
    tasks = {"tasks": [{"task": "addition"}], "include_path": str(write_task(tmp_path / "t"))}
    cfg = idle_config(
        tmp_path,
        eval={"backend": "hf", **tasks},
        sinks=[
            {"kind": "webhook", "url": "http://hooks.example:8080/x"},
            {"kind": "wandb", "project": "p", "mode": "offline"},
        ],
    )
    r = subprocess.run(
        [*WATCHER, "doctor", "-c", str(cfg)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout
    names = [line.split()[1].rstrip(":") for line in r.stdout.splitlines()]
    assert names == [
        "config",
        "devices",
        "lm-eval",
        "tasks",
        "sandbox",
        "sources[0]",
        "sinks[0]",
        "sinks[1]",
        "state_dir",
        "ledger_dir",
    ]
    assert "ok    sinks[0]: webhook to hooks.example:8080" in r.stdout
    assert "ok    sinks[1]: wandb installed; project p, mode offline" in r.stdout
    assert "tasks.checked" not in r.stderr and '{"' not in r.stderr  # no log lines amid it
    r = subprocess.run(
        [*WATCHER, "doctor", "-c", str(cfg), "--set", f"sources.0.path={tmp_path / 'gone'}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1 and "FAIL  sources[0]:" in r.stdout and "does not exist" in r.stdout


def test_plot_writes_a_png_of_metrics_by_step(tmp_path: Path) -> None:
    cfg = _ledger(tmp_path)
    out = tmp_path / "plots" / "r.png"
    result = CliRunner().invoke(main, ["plot", "-c", str(cfg), "r", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "(1 series)" in result.output
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    result = CliRunner().invoke(main, ["plot", "-c", str(cfg), "nope", "-o", str(out)])
    assert result.exit_code == 1 and "runs: r" in result.output


def test_plot_draws_stderr_bars_the_baseline_and_an_accuracy_axis_from_0_to_1() -> None:
    import matplotlib.pyplot as plt

    from ckpt_watcher.report.plot import figure

    def line(step: int, task: str, metrics: dict[str, float]) -> dict[str, Any]:
        return {"run": "r", "step": step, "label": f"r_step{step}", "task": task} | {
            "num_fewshot": 0,
            "status": "ok",
            "metrics": metrics,
        }

    acc = [(100, 0.2, 0.04), (200, 0.5, 0.05)]
    lines = [line(s, "a", {"acc,none": v, "acc_stderr,none": e}) for s, v, e in acc]
    fig, drawn = figure(lines, "r", {"a (0-shot) acc,none": 0.3}, "base")
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    assert drawn == 1 and low < 0 and 1 < high <= 1.1  # 0 to 1, and a marker at 1 drawn whole
    assert [t for t in ax.get_yticks() if low <= t <= high] == pytest.approx(
        [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    )
    (bars,) = ax.containers  # one errorbar series: its points and its stderr
    data_line, _, (segments,) = bars.lines
    assert list(data_line.get_xdata()) == [100, 200] and list(data_line.get_ydata()) == [0.2, 0.5]
    spans = [tuple(seg[:, 1]) for seg in segments.get_segments()]
    assert spans == [pytest.approx((0.16, 0.24)), pytest.approx((0.45, 0.55))]
    (dashed,) = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert list(dashed.get_ydata()) == [0.3, 0.3] and dashed.get_color() == data_line.get_color()
    assert [t.get_text() for t in ax.get_legend().get_texts()][0].startswith("base (dashed")
    plt.close(fig)
    # two series with the same values (and points at 0 and 1) both stay visible
    same = [(100, 0.0), (200, 1.0)]
    lines = [line(s, t, {"acc,none": v}) for s, v in same for t in ("a", "b")]
    fig, drawn = figure(lines, "r")
    first, second = (c.lines[0] for c in fig.axes[0].containers)
    assert drawn == 2 and list(first.get_ydata()) == list(second.get_ydata()) == [0.0, 1.0]
    assert first.get_marker() != second.get_marker()
    assert first.get_markersize() > second.get_markersize()  # the later one, on top, smaller
    assert not first.get_clip_on() and not second.get_clip_on()  # not cut in half at 0 and 1
    # the legend stands clear of every point (the last, at the right edge at 1.0, too)
    fig.canvas.draw()
    box = fig.axes[0].get_legend().get_window_extent()
    for points in (first, second):
        for x, y in points.get_xydata():
            px, py = fig.axes[0].transData.transform((x, y))
            room = points.get_markersize() * fig.dpi / 72
            assert not (box.x0 - room < px < box.x1 + room and box.y0 - room < py < box.y1 + room)
    inside = fig.axes[0].get_window_extent()
    assert box.x0 >= inside.x1 and box.x1 <= fig.bbox.x1  # beside the plot, within the figure
    plt.close(fig)
    # a metric beyond [0, 1] (perplexity, say) keeps matplotlib's own limits
    fig, _ = figure([line(100, "b", {"ppl,none": 12.0}), line(200, "b", {"ppl,none": 9.0})], "r")
    assert fig.axes[0].get_ylim()[1] > 12
    plt.close(fig)


def test_results_of_a_run_with_only_failures_shows_them(tmp_path: Path) -> None:
    from ckpt_watcher.ledger import append

    cfg = idle_config(tmp_path)
    for step in (100, 200):
        append(
            tmp_path / "l",
            {
                "run": "bad",
                "step": step,
                "label": f"bad_step{step}",
                "task": "gsm8k",
                "num_fewshot": 8,
                "status": "failed",
                "metrics": {},
                "error": "boom",
            },
        )
    result = CliRunner().invoke(main, ["results", "-c", str(cfg), "bad"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.strip().splitlines()]
    assert rows[0] == ["step", "gsm8k", "(8-shot)"]
    assert rows[2:] == [["100", "FAILED"], ["200", "FAILED"]]


def test_doctor_fails_a_wandb_sink_without_the_wandb_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon would refuse to start; doctor says so first (a None in sys.modules is
    Python's own way to make a package unimportable)."""
    import sys

    from ckpt_watcher.config import load_config
    from ckpt_watcher.doctor import check_sinks

    cfg = load_config(idle_config(tmp_path, sinks=[{"kind": "wandb", "project": "p"}]))
    monkeypatch.setitem(sys.modules, "wandb", None)
    (check,) = check_sinks(cfg)
    assert not check.ok
    assert check.line() == (
        "FAIL  sinks[0]: config field sinks: kind wandb needs the wandb package: "
        "pip install -e '.[wandb]' (or pip install wandb)"
    )


def test_once_on_a_source_folder_that_does_not_exist_says_so_and_exits_2(tmp_path: Path) -> None:
    cfg = idle_config(tmp_path)
    gone = tmp_path / "no-such-run"
    result = CliRunner().invoke(main, ["once", "-c", str(cfg), "--set", f"sources.0.path={gone}"])
    assert result.exit_code == 2, result.output
    assert f"sources[0].path {gone} does not exist: nothing there to evaluate" in result.output


@pytest.mark.e2e
def test_log_options_work_after_the_subcommand_too(tmp_path: Path) -> None:
    import subprocess

    from .conftest import WATCHER

    cfg = idle_config(tmp_path)

    def stderr(*args: str) -> list[str]:
        r = subprocess.run([*WATCHER, *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stderr.splitlines()

    for args in (
        ["--log-pretty", "once", "-c", str(cfg)],
        ["once", "-c", str(cfg), "--log-pretty"],
    ):
        lines = stderr(*args)
        assert not [line for line in lines if line.startswith('{"')], lines
        assert any("[info" in line and "daemon.started" in line for line in lines), lines
    lines = stderr("once", "-c", str(cfg), "--log-json")
    events = [json.loads(line)["event"] for line in lines if line.startswith('{"')]
    assert "daemon.started" in events, lines
    lines = stderr("once", "-c", str(cfg), "--log-json", "--log-level", "WARNING")
    assert not [line for line in lines if "daemon.started" in line], lines


def test_samples_json_gives_each_response_its_step_and_flips_as_before_and_after(
    tmp_path: Path,
) -> None:
    import gzip

    cfg = _ledger(tmp_path)
    scores = {400: [1.0, 0.0, 1.0], 500: [0.0, 0.0, 1.0]}  # document 0 flips from right to wrong
    for step, by_doc in scores.items():
        name = f"step_{step}/samples_gsm8k.jsonl.gz"
        (tmp_path / "l" / "r" / f"step_{step}").mkdir(parents=True)
        with gzip.open(tmp_path / "l" / "r" / name, "wt") as f:
            for doc_id, score in enumerate(by_doc):
                rec = {"task": "gsm8k", "doc_id": doc_id, "resps": [f"r{step}"], "prompt": "q"}
                rec |= {"target": "a", "responses": [f"r{step}"], "extracted": {}}
                f.write(json.dumps(rec | {"scores": {"exact_match,strict-match": [score]}}) + "\n")
        metrics = {"exact_match,strict-match": sum(by_doc) / 3}
        append(tmp_path / "l", _gsm8k_line(step, metrics, samples_file=name))
    args = ["samples", "-c", str(cfg), "r", "--task", "gsm8k", "--step", "500", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    docs = [json.loads(line) for line in result.output.splitlines()]
    assert [(d["step"], d["doc_id"], d["resps"]) for d in docs] == [
        (500, i, ["r500"]) for i in range(3)
    ]
    result = CliRunner().invoke(main, [*args, "--vs", "400"])
    assert result.exit_code == 0, result.output
    (flip,) = [json.loads(line) for line in result.output.splitlines()]
    assert (flip["task"], flip["doc_id"]) == ("gsm8k", 0)
    # as text, the header says whether the change is beyond the noise: paired over documents
    text = CliRunner().invoke(main, [*args[:-1], "--vs", "400"])
    assert text.exit_code == 0, text.output
    assert "step 400 -> 500: Δ -0.3333 [95% CI " in text.output
    assert "over 3 paired documents, within noise" in text.output
    assert (flip["before"]["step"], flip["before"]["resps"]) == (400, ["r400"])
    assert (flip["after"]["step"], flip["after"]["resps"]) == (500, ["r500"])


def test_commands_the_demo_prints_name_a_watcher_the_shell_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where `.venv/bin/watcher demo` runs without activating the venv, the commands
    the demo then prints must not say a bare `watcher` that the shell cannot find."""
    import shutil
    import sys

    from ckpt_watcher.demo.runner import watcher_command

    ours = Path(sys.executable).parent / "watcher"
    assert ours.exists()
    monkeypatch.setenv("PATH", str(tmp_path))  # no watcher on PATH
    assert watcher_command() == str(ours.absolute())
    other = tmp_path / "watcher"  # another install's watcher first on PATH
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    assert watcher_command() == str(ours.absolute())
    monkeypatch.setenv("PATH", f"{ours.parent}{os.pathsep}{tmp_path}")  # an activated venv
    assert shutil.which("watcher") == str(ours) and watcher_command() == "watcher"


def test_status_exits_5_while_a_source_has_been_unreachable_for_3_polls(tmp_path: Path) -> None:
    """Running but degraded: only Prometheus used to tell that a source had been down for
    minutes. A failed scan or two is a blip (exit 0); 3 polls and 30 s of them is an outage."""
    import time

    from ckpt_watcher import status as status_mod
    from ckpt_watcher.config import load_config

    cfg = load_config(idle_config(tmp_path, sources=[{"kind": "local", "path": str(tmp_path)}]))
    name = cfg.sources[0].name  # polled every 30 s (the default)
    now = time.time()
    state = State(cfg.state_dir)
    state.record_scan(name, now - 60, "PermissionError: [Errno 13] denied", None)
    state.close()
    alive = {"alive": True, "stale": False}
    data = status_mod.gather(cfg, now=now)
    assert data["degraded"] == [] and status_mod.exit_code(data | {"daemon": alive}) == 0
    data = status_mod.gather(cfg, now=now + 31)  # 91 s: 3 polls
    assert data["degraded"] == [
        f"source {name} unreachable for 91s: PermissionError: [Errno 13] denied"
    ]
    assert status_mod.exit_code(data | {"daemon": alive}) == status_mod.EXIT_DEGRADED == 5
    assert status_mod.exit_code(data) == 3  # not running at all: down, whatever its sources
    page = status_mod.render(data | {"daemon": data["daemon"] | alive | _RUNNING})
    assert f"DEGRADED: source {name} unreachable for 91s" in page


_RUNNING = {"pid": 1, "started_at": "t", "heartbeat_age_s": 1.0, "stopping": False}


def test_results_stats_show_each_generation_tasks_response_lengths(tmp_path: Path) -> None:
    """`--stats`: response_tokens mean and p90 and length_capped_rate after a task's metrics
    (what RL researchers watch step by step); a line without them (older, or a likelihood
    task) leaves them empty."""
    cfg = _ledger(tmp_path)
    stats = {"mean": 812.5, "p50": 700.0, "p90": 1500.0, "max": 2048}
    metrics = {"exact_match,strict-match": 0.75, "exact_match_stderr,strict-match": 0.1}
    line = _gsm8k_line(400, metrics, response_tokens=stats, length_capped_rate=0.125)
    append(tmp_path / "l", line | {"unterminated_rate": None})
    out = CliRunner().invoke(main, ["results", "-c", str(cfg), "r", "--stats", "--format", "json"])
    assert out.exit_code == 0, out.output
    rows = {r["step"]: r for r in json.loads(out.output)}
    label = "gsm8k (8-shot)"
    assert rows[400][f"{label} response_tokens.mean"] == 812.5
    assert rows[400][f"{label} response_tokens.p90"] == 1500.0
    assert rows[400][f"{label} length_capped_rate"] == 0.125
    assert f"{label} unterminated_rate" not in rows[400]  # judged only with think_end
    assert rows[100][f"{label} response_tokens.mean"] is None  # an older line: no lengths
    plain = CliRunner().invoke(main, ["results", "-c", str(cfg), "r", "--format", "json"])
    assert "response_tokens" not in plain.output  # only on request


def test_plot_stats_draws_response_lengths_by_step(tmp_path: Path) -> None:
    """`plot --stats`: tokens per response (mean, p90) above, the share the cap stopped below."""
    import matplotlib.pyplot as plt

    from ckpt_watcher.report.compare import Entry
    from ckpt_watcher.report.plot import lengths_figure

    cfg = _ledger(tmp_path)
    out = tmp_path / "len.png"
    none = CliRunner().invoke(main, ["plot", "-c", str(cfg), "r", "-o", str(out), "--stats"])
    assert none.exit_code == 1 and "no response lengths" in none.output  # older lines only
    metrics = {"exact_match,strict-match": 0.5}
    for step, mean, capped in [(400, 300.0, 0.1), (500, 600.0, 0.4)]:
        tokens = {"mean": mean, "p50": mean, "p90": mean * 1.5, "max": 2048}
        extra = {"response_tokens": tokens, "length_capped_rate": capped}
        append(tmp_path / "l", _gsm8k_line(step, metrics, **extra))
    r = CliRunner().invoke(main, ["plot", "-c", str(cfg), "r", "-o", str(out), "--stats"])
    assert r.exit_code == 0 and "(3 series)" in r.output, r.output
    assert out.read_bytes()[:4] == b"\x89PNG"
    from ckpt_watcher.ledger import ledger_path, read_lines

    lines = read_lines(ledger_path(tmp_path / "l", "r")).lines
    fig, drawn = lengths_figure([Entry("r", ["r"], [lines])])
    tokens_ax, share_ax = fig.axes
    by_label = {ln.get_label(): ln for ax in fig.axes for ln in ax.get_lines()}
    mean = by_label["gsm8k (8-shot) response_tokens.mean"]
    assert list(mean.get_xdata()) == [400, 500] and list(mean.get_ydata()) == [300.0, 600.0]
    assert list(by_label["gsm8k (8-shot) response_tokens.p90"].get_ydata()) == [450.0, 900.0]
    assert by_label["gsm8k (8-shot) length_capped_rate"] in share_ax.get_lines()
    assert share_ax.get_ylim() == (-0.05, 1.05) and tokens_ax.get_ylim()[0] == 0
    plt.close(fig)


def test_results_vs_a_step_gives_each_change_its_paired_interval(tmp_path: Path) -> None:
    """`results RUN --vs STEP`: every other step's change from STEP, paired over documents
    where both sides kept records (the ledger's difference, with no interval, where not)."""
    import gzip

    cfg = _ledger(tmp_path)  # steps 100, 200 (no records) and a failed 300
    key = "exact_match,strict-match"
    rng = __import__("random").Random(7)
    base = [rng.choice([0.0, 0.25, 0.5, 0.75, 1.0]) for _ in range(30)]
    by_step = {
        400: base,
        500: [max(0.0, s - 0.25) for s in base],  # every document worse, or already at 0
        600: [base[(i + 1) % 30] for i in range(30)],  # the same scores on other documents
    }
    for step, scores in by_step.items():
        name = f"step_{step}/samples_gsm8k.jsonl.gz"
        (tmp_path / "l" / "r" / f"step_{step}").mkdir(parents=True)
        with gzip.open(tmp_path / "l" / "r" / name, "wt") as f:
            for doc_id, score in enumerate(scores):
                f.write(json.dumps({"task": "gsm8k", "doc_id": doc_id, "scores": {key: [score]}}))
                f.write("\n")
        metrics = {key: sum(scores) / 30, "exact_match_stderr,strict-match": 0.05}
        append(tmp_path / "l", _gsm8k_line(step, metrics, samples_file=name))
    out = CliRunner().invoke(
        main, ["results", "-c", str(cfg), "r", "--vs", "400", "--format", "json"]
    )
    assert out.exit_code == 0, out.output
    rows = {r["step"]: r for r in json.loads(out.output)}
    assert sorted(rows) == [100, 200, 500, 600] and all(r["metric"] == key for r in rows.values())
    drop, shuffled, old = rows[500], rows[600], rows[100]
    assert drop["Δ vs 400"] == pytest.approx(-sum(min(s, 0.25) for s in base) / 30)
    assert drop["ci95_high"] < 0 and drop["documents"] == 30 and drop["beyond noise"] == "yes"
    assert shuffled["Δ vs 400"] == pytest.approx(0) and shuffled["beyond noise"] == "no"
    assert shuffled["ci95_low"] < 0 < shuffled["ci95_high"]
    # step 100 has no records: the ledger's difference, no interval
    assert old["Δ vs 400"] == pytest.approx(0.25 - sum(base) / 30) and old["ci95_low"] is None
    missing = CliRunner().invoke(main, ["results", "-c", str(cfg), "r", "--vs", "350"])
    assert (
        missing.exit_code == 1 and "steps with results: [100, 200, 400, 500, 600]" in missing.output
    )
