"""The `watcher` command line: thin commands over the modules that do the work.

Exit codes: 0 ok, 1 runtime failure, 2 bad config or usage (one line naming the field);
`watcher status` also returns 3 when the daemon is down and 4 when it is stale.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click

from ckpt_watcher import __version__, logs
from ckpt_watcher.config import LocalSource, WatcherConfig, load_config
from ckpt_watcher.errors import ConfigError, StateError, WatcherError

F = TypeVar("F", bound=Callable[..., Any])

config_option = click.option(
    "-c",
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The watcher's YAML config file.",
)
set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config key by dotted path (repeatable), e.g. --set eval.seed=1.",
)


def _fail(code: int, message: str) -> None:
    click.echo(f"watcher: {message}", err=True)
    sys.exit(code)


def handle_errors(fn: F) -> F:
    """Turn expected failures into one line on stderr and the contract's exit code."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            _fail(2, str(e))
        except WatcherError as e:
            _fail(1, str(e))

    return wrapper  # type: ignore[return-value]


def _load(config_path: Path, overrides: tuple[str, ...] = ()) -> WatcherConfig:
    return load_config(config_path, list(overrides))


def _baseline(cfg: WatcherConfig, run_path: str) -> Any:
    """What the run is compared with (`sources.baseline.RunBaseline`); says so on stderr while
    the baseline checkpoint has no results yet."""
    from ckpt_watcher.sources.baseline import run_baseline

    base = run_baseline(cfg, run_path)
    if base.waiting is not None:
        click.echo(
            f"watcher: the baseline ({cfg.baseline.checkpoint if cfg.baseline else ''}) has no "
            f"results yet (`watcher status` shows its progress); {base.waiting}",
            err=True,
        )
    return base


def _run_ledger(config_path: Path, run_name: str) -> tuple[str, list[dict[str, Any]]]:
    """(run path, its ledger lines) for a run path or run name; exit 1 naming the runs that do
    have results if it has none, 2 if the run name is ambiguous."""
    from ckpt_watcher.runs import resolve_run

    cfg = _load(config_path)
    run_path = resolve_run(cfg, run_name)
    return run_path, _read_ledger(cfg, run_path)


def _read_ledger(cfg: WatcherConfig, run_path: str) -> list[dict[str, Any]]:
    """A run path's ledger lines; exit 1 naming the runs that do have results if it has none."""
    from ckpt_watcher import ledger as ledger_mod

    path = ledger_mod.ledger_path(cfg.ledger_dir, run_path)
    if not path.exists():
        runs = ", ".join(ledger_mod.iter_runs(cfg.ledger_dir)) or "none"
        _fail(1, f"no ledger for run {run_path!r} at {path}; runs with results: {runs}")
    report = ledger_mod.read_lines(path)
    if report.skipped:
        click.echo(f"watcher: skipped {report.skipped} torn or unreadable ledger line(s)", err=True)
    return report.lines


def _compared(cfg: WatcherConfig, names: tuple[str, ...], mean: bool) -> list[Any] | None:
    """The `report.compare.Entry`s that RUN arguments name, or None where they name one run
    and no `--mean` (the one-run output). A pattern's runs without results are left out, said
    on stderr; a run named alone without results exits 1 as for one run."""
    from ckpt_watcher import ledger as ledger_mod
    from ckpt_watcher.report.compare import Entry
    from ckpt_watcher.runs import is_pattern, resolve_runs

    if len(names) == 1 and not mean and not is_pattern(names[0]):
        return None
    entries: list[Entry] = []
    for name in names:
        runs = resolve_runs(cfg, name)
        if is_pattern(name):
            kept = [r for r in runs if ledger_mod.ledger_path(cfg.ledger_dir, r).exists()]
            if not kept:
                have = ", ".join(ledger_mod.iter_runs(cfg.ledger_dir)) or "none"
                _fail(1, f"no run matching {name!r} has results yet; runs with results: {have}")
            if len(kept) < len(runs):
                left = ", ".join(r for r in runs if r not in kept)
                click.echo(f"watcher: {name!r}: no results yet for {left}", err=True)
            runs = kept
        each = [_read_ledger(cfg, r) for r in runs]  # one without results: exit 1
        if mean:
            entries.append(Entry(name, runs, each, grouped=True))
        else:
            shown = {e.name for e in entries}
            entries += [
                Entry(r, [r], [ln]) for r, ln in zip(runs, each, strict=True) if r not in shown
            ]
    return entries


def _terminal_width() -> int | None:
    """$COLUMNS, else the width of the terminal stdout is; None where stdout is no terminal (a
    pipe or a file keeps each row on one line)."""
    import os

    try:
        return int(os.environ["COLUMNS"]) or None
    except (KeyError, ValueError):
        pass
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else None
    except (AttributeError, OSError, ValueError):
        return None


LOG_LEVEL_HELP = (
    "DEBUG, INFO, WARNING or ERROR (default INFO; WARNING for `demo` and `doctor`, which print "
    "their own progress)."
)
LOG_FORMAT_HELP = "Log format (default: JSON unless stderr is a terminal)."


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="watcher")
@click.option("--log-level", default=None, help=LOG_LEVEL_HELP)
@click.option("--log-json/--log-pretty", default=None, help=LOG_FORMAT_HELP)
@click.pass_context
def main(ctx: click.Context, log_level: str | None, log_json: bool | None) -> None:
    """ckpt-watcher: evaluate LLM checkpoints while they train."""
    # the demo and doctor print for a person: only warnings are logged, and never as JSON
    quiet = ctx.invoked_subcommand in ("demo", "doctor")
    if log_json is None and quiet:
        log_json = False
    level = log_level or ("WARNING" if quiet else "INFO")
    ctx.meta["logs"] = {"log_level": level, "log_json": log_json}  # `_log_option` may change them
    logs.configure(level, log_json)


def _log_option(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """The log options given after the subcommand (`watcher run --log-pretty`) win."""
    if value is None or ctx.resilient_parsing or param.name is None:
        return
    settings = ctx.meta.setdefault("logs", {"log_level": "INFO", "log_json": None})
    settings[param.name] = value
    logs.configure(settings["log_level"], settings["log_json"])


@main.command()
@config_option
@set_option
@handle_errors
def run(config_path: Path, overrides: tuple[str, ...]) -> None:
    """Run the daemon in the foreground until SIGTERM/SIGINT.

    The first signal stops dispatching and lets running evals finish for up to
    shutdown_grace_seconds; a second signal kills them (their jobs are re-queued).
    """
    from ckpt_watcher.daemon import run_daemon
    from ckpt_watcher.preflight import require_known_tasks

    cfg = _load(config_path, overrides)
    require_known_tasks(cfg)
    sys.exit(run_daemon(cfg, once=False))


@main.command()
@config_option
@set_option
@handle_errors
def once(config_path: Path, overrides: tuple[str, ...]) -> None:
    """One pass: discover, evaluate everything due, wait for it, exit (1 if any eval failed)."""
    from ckpt_watcher.daemon import run_daemon
    from ckpt_watcher.preflight import require_known_tasks

    cfg = _load(config_path, overrides)
    missing = [
        f"sources[{i}].path {s.path}"
        for i, s in enumerate(cfg.sources)
        if isinstance(s, LocalSource) and not s.path.exists()
    ]
    if missing:  # `run` waits for such a folder (training may not have started); `once` cannot
        raise ConfigError(
            f"{'; '.join(missing)} does not exist: nothing there to evaluate; check the path "
            "(`watcher run` would wait for it to appear)"
        )
    require_known_tasks(cfg)
    sys.exit(run_daemon(cfg, once=True))


@main.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def status(config_path: Path, as_json: bool) -> None:
    """Is the daemon alive; sources, checkpoints by state, queue, running evals, failures, results.

    Exit code 0 when the daemon is running, 3 when it is down, 4 when its heartbeat is stale,
    5 when it runs degraded (a source unreachable for 3 of its polls, at least 30 s; a warm
    engine whose jobs keep crashing; a ledger folder that cannot be written).
    """
    from ckpt_watcher import status as status_mod
    from ckpt_watcher.redact import Redactor

    cfg = _load(config_path)
    try:
        data = status_mod.gather(cfg)
    except StateError as e:
        _fail(status_mod.EXIT_DOWN, str(e))
    shown = json.dumps(data, indent=2) if as_json else status_mod.render(data)
    click.echo(Redactor.of(cfg)(shown))
    sys.exit(status_mod.exit_code(data))


runs_argument = click.argument("run_names", metavar="RUN [RUN ...]", nargs=-1, required=True)
mean_option = click.option(
    "--mean",
    is_flag=True,
    help="Each RUN (a pattern such as 'lr3e-4_seed*', quoted) as one group: its runs' mean "
    "and sd across them, step by step.",
)


@main.command()
@config_option
@runs_argument
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "md", "csv", "json"]),
    default="table",
    show_default=True,
)
@click.option("--stderr", "with_stderr", is_flag=True, help="Include lm-eval's stderr columns.")
@click.option(
    "--stats",
    "with_stats",
    is_flag=True,
    help="Include each generation task's response lengths: response_tokens mean and p90, "
    "length_capped_rate.",
)
@click.option(
    "--all",
    "all_versions",
    is_flag=True,
    help="Every version of a rewritten checkpoint (default: the newest per step).",
)
@click.option(
    "--suite",
    "suite_name",
    default=None,
    help="Only this suite's headline metrics, one column each (`watcher suites`).",
)
@click.option(
    "--step",
    type=int,
    default=None,
    help="One step's sampled results: a row per dataset with its problems and pass@1..K, "
    "and an AGGREGATE row weighted by problems.",
)
@click.option(
    "--vs",
    "vs_step",
    type=int,
    default=None,
    help="Each other step's change from this one, per task and metric, with its 95% interval "
    "paired over documents.",
)
@mean_option
@handle_errors
def results(
    config_path: Path,
    run_names: tuple[str, ...],
    fmt: str,
    with_stderr: bool,
    with_stats: bool,
    all_versions: bool,
    suite_name: str | None,
    step: int | None,
    vs_step: int | None,
    mean: bool,
) -> None:
    """The metric-by-step table of a run (a run path, or a run name only one run has), from
    its ledger. With a `baseline` in the config: its row first and a Δ column per metric.
    Several runs (or a quoted pattern): one table with a `run` column."""
    from ckpt_watcher.report.compare import compare_table
    from ckpt_watcher.report.table import (
        STAT_KEYS,
        column,
        metric_table,
        render,
        stderr_column,
    )
    from ckpt_watcher.suites import get_suite

    cfg = _load(config_path)
    compared = _compared(cfg, run_names, mean)
    if compared is not None and all_versions:
        raise ConfigError("--all shows one run's versions; give one RUN")
    only = None
    suite = None
    if suite_name is not None:
        try:
            suite = get_suite(suite_name, cfg.eval.suite_path)
        except ValueError as e:
            raise ConfigError(f"--suite: {e}") from e
        only = [column(t, shots, key) for t, shots, key in suite.headline]
        if with_stderr:
            only = [c for col in only for c in (col, stderr_column(col))]
        if with_stats:  # each suite task's lengths after its headline columns
            tasks = dict.fromkeys((t, shots) for t, shots, _ in suite.headline)
            only += [column(t, s, k) for t, s in tasks for k in STAT_KEYS[:3]]
    if vs_step is not None:
        from ckpt_watcher.report.steps import step_changes

        if compared is not None:
            raise ConfigError("--vs compares one run's steps; give one RUN")
        run_path, lines = _run_ledger(config_path, run_names[0])
        changes = step_changes(cfg.ledger_dir, run_path, lines, vs_step)
        click.echo(render(changes, fmt, _terminal_width()))
        return
    if step is not None:
        if compared is not None:
            raise ConfigError("--step shows one run's step; give one RUN")
        _, lines = _run_ledger(config_path, run_names[0])
        click.echo(render(_datasets(lines, step, suite), fmt, _terminal_width()))
        return
    if compared is not None:
        base = _baseline(cfg, compared[0].runs[0])
        table = compare_table(
            compared, with_stderr, only, base.values, base.name, with_stats, base.pairing
        )
        click.echo(render(table, fmt, _terminal_width()))
        return
    run_path, lines = _run_ledger(config_path, run_names[0])
    base = _baseline(cfg, run_path)
    table = metric_table(
        lines,
        include_stderr=with_stderr,
        all_versions=all_versions,
        only=only,
        baseline=base.values,
        baseline_name=base.name,
        include_stats=with_stats,
        pairing=base.pairing,
    )
    click.echo(render(table, fmt, _terminal_width()))


def _datasets(lines: list[dict[str, Any]], step: int, suite: Any) -> Any:
    """`results --step`: the step's table by dataset (`report.by_dataset`); exit 1 naming the
    steps that have sampled results where this one has none."""
    from ckpt_watcher.ledger import is_result
    from ckpt_watcher.report.by_dataset import dataset_table

    tasks = None
    if suite is not None:  # each task once, with its first headline key
        firsts: dict[tuple[str, int | None], str] = {}
        for task, shots, key in suite.headline:
            firsts.setdefault((task, shots), key)
        tasks = [
            (t, s, firsts.get((t, s)))
            for t, s in ((e.get("name") or e["task"], e.get("num_fewshot")) for e in suite.entries)
        ]
    table = dataset_table(lines, step, tasks)
    if not table.rows:
        sampled = sorted(
            {ln["step"] for ln in lines if ln.get("pass_at") and is_result(ln)} - {None}
        )
        where = (
            f"steps with sampled results: {', '.join(map(str, sampled))}"
            if sampled
            else ("this run has none (tasks with samples > 1)")
        )
        _fail(1, f"no sampled results at step {step}{' for that suite' if suite else ''}; {where}")
    return table


@main.command("suites")
@click.option(
    "-c",
    "--config",
    "config_path",
    default=None,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also the suites under this config's eval.suite_path.",
)
@handle_errors
def suites_cmd(config_path: Path | None) -> None:
    """The suites `{suite: NAME}` can name, with their tasks and headline metrics."""
    from ckpt_watcher.suites import load_suites

    suite_path = _load(config_path).eval.suite_path if config_path else None
    try:
        found = load_suites(suite_path)
    except ValueError as e:
        raise ConfigError(f"eval.suite_path: {e}") from e
    for i, suite in enumerate(found.values()):
        click.echo(("\n" if i else "") + f"{suite.name}  ({suite.path})")
        if suite.description:
            click.echo(f"  {suite.description}")
        for entry in suite.entries:
            shots = entry.get("num_fewshot")
            extra = [f"{shots if shots is not None else 'default'}-shot"]
            if entry.get("samples"):
                extra.append(f"K={entry['samples']}")
            if entry.get("gen_kwargs"):
                extra.append(", ".join(f"{k} {v}" for k, v in entry["gen_kwargs"].items()))
            if entry.get("allow_code_execution"):
                extra.append("runs code")
            label = entry.get("name") or entry["task"]
            heads = [k for t, s, k in suite.headline if t == label and s == shots]
            click.echo(
                f"  - {entry['task']} ({'; '.join(extra)})"
                + (f": {', '.join(heads)}" if heads else "")
            )


def _with_steps(entry: Any, step: int, vs_step: int | None) -> dict[str, Any]:
    """`samples --json`: a record with its step, or a flip as `{task, doc_id, before, after}`."""
    if vs_step is None:
        return {"step": step, **entry}
    then, now = entry
    return {
        "task": now.get("task"),
        "doc_id": now.get("doc_id"),
        "before": {"step": vs_step, **then},
        "after": {"step": step, **now},
    }


@main.command()
@config_option
@click.argument("run_name", metavar="RUN")
@click.option("--step", type=int, required=True, help="The step whose documents to show.")
@click.option("--task", required=True, help="The task (as in eval.tasks).")
@click.option("--shots", type=int, default=None, help="Its num_fewshot, if it ran with several.")
@click.option("--vs", "vs_step", type=int, default=None, help="Compare with this step.")
@click.option(
    "--only",
    type=click.Choice(["wrong", "flipped"]),
    default=None,
    help="wrong: documents wrong at --step (with --vs: right at --vs, wrong at --step); "
    "flipped: right at one step and wrong at the other (the default with --vs).",
)
@click.option("--metric", default=None, help="Judge documents by this metric (default: the first).")
@click.option("--max", "max_docs", type=int, default=20, show_default=True, help="0: all.")
@click.option("--json", "as_json", is_flag=True, help="The records as JSON lines.")
@handle_errors
def samples(
    config_path: Path,
    run_name: str,
    step: int,
    task: str,
    shots: int | None,
    vs_step: int | None,
    only: str | None,
    metric: str | None,
    max_docs: int,
    as_json: bool,
) -> None:
    """One result's documents: prompt, target, every response, its extracted answer and score.
    With --vs, the documents whose correctness flipped between the two steps."""
    from ckpt_watcher.report import samples as sv

    if only == "flipped" and vs_step is None:
        raise ConfigError("--only flipped compares two steps: add --vs STEP")
    run_path, lines = _run_ledger(config_path, run_name)
    ledger_dir = _load(config_path).ledger_dir
    at = sv.read_records(ledger_dir, run_path, sv.find_line(lines, step, task, shots))
    key = sv.headline_metric(at, metric)
    shown: list[Any]
    render: Callable[[list[Any]], list[str]]
    if vs_step is None:
        docs = list(at.by_doc.values())
        if only == "wrong":
            docs = [r for r in docs if not sv.is_right(r, key)]
        shown = docs

        def render(items: list[Any]) -> list[str]:
            return sv.render_docs(items, key)

        head = f"{run_path} step {step} {task}: {len(docs)} documents, judged by {key}"
    else:
        before = sv.read_records(ledger_dir, run_path, sv.find_line(lines, vs_step, task, shots))
        shown = sv.flips(before, at, key, only_wrong=only == "wrong")
        what = "right at step {} and wrong at step {}" if only == "wrong" else "flipped ({} -> {})"
        head = f"{run_path} {task}: {len(shown)} documents {what.format(vs_step, step)}, by {key}"
        change = sv.paired_change(before, at, key)
        if change is not None:  # is the step's change beyond the noise between steps?
            head += f"\nstep {vs_step} -> {step}: {change.text()}"

        def render(items: list[Any]) -> list[str]:
            return sv.render_flips(items, key, vs_step or 0, step)

    for which, line in ((step, at.line), (vs_step, before.line if vs_step is not None else {})):
        if line.get("no_op"):  # shown for a look, never counted as the step's result
            head += (
                f"\nnote: step {which} changes nothing ({line['no_op']}): its base model's answers"
            )
    total = len(shown)
    if max_docs:
        shown = shown[:max_docs]
    if as_json:  # one JSON object a line, each response's record with its step
        for entry in shown:
            click.echo(
                json.dumps(_with_steps(entry, step, vs_step), default=str, ensure_ascii=False)
            )
        return
    click.echo(head)
    click.echo("\n".join(render(shown)))
    if total > len(shown):
        click.echo(f"... {total - len(shown)} more (--max 0 shows all)")


@main.command()
@config_option
@runs_argument
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The PNG file to write.",
)
@mean_option
@click.option(
    "--stats",
    "with_stats",
    is_flag=True,
    help="Plot response lengths instead: tokens per response (mean, p90), the share the cap stopped.",
)
@handle_errors
def plot(
    config_path: Path, run_names: tuple[str, ...], output: Path, mean: bool, with_stats: bool
) -> None:
    """Plot a run's metrics against the step, from its ledger, as a PNG. Several runs (or a
    quoted pattern): one plot, a colour per run."""
    from ckpt_watcher.report.compare import Entry
    from ckpt_watcher.report.plot import plot_entries

    cfg = _load(config_path)
    compared = _compared(cfg, run_names, mean)
    if compared is None:
        run_path, lines = _run_ledger(config_path, run_names[0])
        entries = [Entry(run_path, [run_path], [lines])]
    else:
        entries = compared
    base = _baseline(cfg, entries[0].runs[0])
    drawn = plot_entries(entries, output, base.values, base.name, stats=with_stats)
    if not drawn and with_stats:
        _fail(1, "no response lengths to plot (generation results evaluated by this version)")
    if not drawn:
        what = "run" if len(entries) == 1 else "runs"
        _fail(
            1, f"{what} {' '.join(run_names)} have no ok results with a step yet; nothing to plot"
        )
    click.echo(f"wrote {output} ({drawn} series)")


@main.command()
@config_option
@runs_argument
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The HTML file to write (default: report.html beside the run's ledger; "
    "needed when comparing runs).",
)
@mean_option
@handle_errors
def report(config_path: Path, run_names: tuple[str, ...], output: Path | None, mean: bool) -> None:
    """Write a run's HTML report: curves by step, results, failures, documents that flipped.
    Several runs (or a quoted pattern): one page, a curve per run in each chart."""
    from ckpt_watcher.report.page import write_comparison, write_report
    from ckpt_watcher.sinks.alerts import standing

    cfg = _load(config_path)

    def judge(lines: list[dict[str, Any]]) -> list[Any]:
        return standing(cfg, lines)

    compared = _compared(cfg, run_names, mean)
    if compared is None:
        run_path, _lines = _run_ledger(config_path, run_names[0])
        base = _baseline(cfg, run_path)
        out = write_report(
            cfg.ledger_dir, run_path, output, base.values, base.name, judge, base.pairing
        )
    else:
        if output is None:
            raise ConfigError("comparing runs: name the page to write with -o FILE.html")
        base = _baseline(cfg, compared[0].runs[0])
        out = write_comparison(
            compared, cfg.ledger_dir, output, base.values, base.name, judge, base.pairing
        )
    click.echo(f"wrote {out} (one self-contained page: open it in any browser)")


@main.command("fix-names")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--dry-run", is_flag=True, help="Only say what would be linked.")
@handle_errors
def fix_names(path: Path, dry_run: bool) -> None:
    """Add the shard file names a safetensors index expects (hard link, else symlink).

    Never renames, rewrites or deletes the trainer's files; running it twice does nothing more.
    """
    from ckpt_watcher.checkpoints.namefix import apply_fix

    actions = apply_fix(path, dry_run=dry_run)
    if not actions:
        click.echo(f"{path}: nothing to fix")
    for a in actions:
        click.echo(f"{path}: {a.describe()}")


@main.command()
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("watcher-demo"),
    show_default=True,
    help="Folder for the demo's checkpoints, state and ledger.",
)
@click.option("--steps", default=600, show_default=True, help="Training steps.")
@click.option("--save-every", default=150, show_default=True, help="Steps between checkpoints.")
@set_option
@handle_errors
def demo(workdir: Path, steps: int, save_every: int, overrides: tuple[str, ...]) -> None:
    """Train a tiny model on CPU that writes checkpoints while the watcher evaluates each one;
    print the results table."""
    from ckpt_watcher.demo.runner import run_demo

    sys.exit(
        run_demo(workdir, click.echo, steps=steps, save_every=save_every, overrides=list(overrides))
    )


@main.command("requeue")
@config_option
@click.argument("run_name", metavar="RUN")
@click.option("--step", type=int, default=None, help="Only this step.")
@click.option("--task", default=None, help="Only checkpoints where this task is due.")
@handle_errors
def requeue_cmd(config_path: Path, run_name: str, step: int | None, task: str | None) -> None:
    """Evaluate a run's checkpoints again where results failed or are stale (other settings).

    Results already ok with the current settings are never run twice. A running daemon picks
    the checkpoints up within seconds; otherwise the next `watcher run` or `once` does.
    """
    from ckpt_watcher.requeue import requeue
    from ckpt_watcher.runs import resolve_run

    cfg = _load(config_path)
    run_path = resolve_run(cfg, run_name)
    done, left = requeue(cfg, run_path, step, task)
    for r in done:
        click.echo(f"requeued {r.label}: {', '.join(r.due)}")
    for why in left:
        click.echo(f"left alone {why}")
    if not done:
        where = f"run {run_path!r}" + (f" step {step}" if step is not None else "")
        click.echo(f"nothing to requeue for {where}")


@main.command()
@config_option
@set_option
@handle_errors
def doctor(config_path: Path, overrides: tuple[str, ...]) -> None:
    """Check GPUs (NVML), lm-eval and vLLM, sources, disk space and the config; one line each.

    Exit code 0 when every check passes, 1 otherwise.
    """
    from ckpt_watcher.doctor import run_checks
    from ckpt_watcher.redact import Redactor

    cfg = _load(config_path, overrides)
    checks = run_checks(cfg)
    redact = Redactor.of(cfg)
    for c in checks:
        click.echo(redact(c.line()))
    sys.exit(0 if all(c.ok for c in checks) else 1)


# every subcommand takes the log options too, where users put them
for _command in main.commands.values():
    _command.params += [
        click.Option(decls, default=None, expose_value=False, callback=_log_option, help=text)
        for decls, text in (
            (["--log-level"], LOG_LEVEL_HELP),
            (["--log-json/--log-pretty"], LOG_FORMAT_HELP),
        )
    ]
