"""Regression alerts: an `ok` result below the best earlier step of its run, or below the
baseline, for the same task, shots and metric, by more than the noise and by more than
`alerts.min_drop`.

The noise: where both results kept per-document records (a generation task's scores per
response), the paired test over documents (`report.paired`, as `watcher results --vs`): the
drop is real when its 95% interval excludes zero. Otherwise (a likelihood task, a pass@k
estimate, a baseline given as numbers) the rule of the results table's `*`: a drop of more than
`alerts.drop_stderr` · sqrt(se² + se_ref²), with the stderrs lm-eval reports (a metric with no
stderr is then never judged). "Earlier" is by training step, not by when the eval ran: evals
may run newest first, so a result that arrives for an earlier step can make a later step's
result a regression then. Each (run, step, task, shots, metric) is reported once per daemon;
results already in the ledger at start-up are history, never reported.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_watcher.config import BASELINE_RUN
from ckpt_watcher.ledger import is_result
from ckpt_watcher.report.paired import PairedDelta, t_quantile
from ckpt_watcher.report.samples import baseline_records, paired_files, records_path
from ckpt_watcher.report.table import (
    baseline_values,
    column,
    entry_name,
    is_stderr_metric,
    stderr_column,
    stderr_metric,
    task_label,
)

# lm-eval metrics where lower is better; every other metric is taken as higher-is-better.
LOWER_IS_BETTER = frozenset({"perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte"})

Key = tuple[str, str, Any, str]  # run path, task, shots, metric
SURE = 1e6  # standard errors a drop with no spread at all counts as


@dataclass(frozen=True)
class Regression:
    run_path: str
    step: int
    task: str
    num_fewshot: int | None
    metric: str
    value: float
    reference: float
    against: str  # "step 300" or "baseline Qwen3-1.7B-Base"
    sigmas: float  # the drop in standard errors of the difference (paired, where paired)
    ci95: tuple[float, float] | None = None  # the paired change's 95% interval
    documents: int | None = None  # how many documents the paired test paired

    def beyond_noise(self) -> str:
        """How far beyond the noise: the paired change and its interval, or the stderrs."""
        if self.ci95 is not None:
            low, high = self.ci95
            return (
                f"{self.value - self.reference:+.4f} [95% CI {low:+.4f}, {high:+.4f}] over "
                f"{self.documents} paired documents"
            )
        return f"{self.sigmas:.1f} stderr"

    def text(self) -> str:
        label = task_label({"task": self.task, "num_fewshot": self.num_fewshot})
        where = "from" if self.ci95 is not None else "below"
        return (
            f"regression: {self.run_path} step {self.step} {label} "
            f"{self.metric} = {self.value:.4f}, {self.beyond_noise()} {where} {self.against} "
            f"({self.reference:.4f})"
        )

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class _Point:
    step: int
    value: float
    se: float | None
    records: Path | None = None  # the result's per-document records


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def _judged_metrics(line: dict[str, Any]) -> Iterable[tuple[str, float, float | None]]:
    metrics = line.get("metrics") or {}
    for metric, raw in metrics.items():
        if is_stderr_metric(metric):
            continue
        value = _number(raw)
        if value is not None:
            yield metric, value, _number(metrics.get(stderr_metric(metric)))


class RegressionWatch:
    """Remembers every ok result by (run, task, shots, metric) and step; `observe` returns the
    regressions a new ledger line reveals."""

    def __init__(
        self,
        drop_stderr: float,
        fixed_baseline: list[tuple[str, int | None, dict[str, float]]],
        baseline_name: str,
        ledger_dir: Path | None = None,
        min_drop: float = 0.0,
    ) -> None:
        self.k = drop_stderr
        self.min_drop = min_drop
        self.ledger_dir = ledger_dir  # where records are (None: judge by stderr only)
        self.fixed = fixed_baseline
        self.baseline_name = baseline_name
        self.points: dict[Key, list[_Point]] = {}
        self.baseline_lines: list[dict[str, Any]] = []
        self.reported: set[tuple[str, int, str, Any, str]] = set()

    @classmethod
    def of(cls, cfg: Any) -> RegressionWatch:
        """The watch a WatcherConfig asks for: its alerts settings, baseline and ledgers."""
        fixed = (
            [(e.task, e.num_fewshot, e.metrics) for e in cfg.baseline.metrics]
            if cfg.baseline
            else []
        )
        return cls(
            cfg.alerts.drop_stderr,
            fixed,
            cfg.baseline.name if cfg.baseline else "baseline",
            Path(cfg.ledger_dir),
            cfg.alerts.min_drop,
        )

    def standing(self, lines: Iterable[dict[str, Any]]) -> list[Regression]:
        """Every regression the ledger shows now (after `lines`, baseline lines among them):
        each step's result against its run's best earlier step and the baseline, by step. What
        the report lists; the daemon's alerts (`observe`) tell each one once, as it appears."""
        for line in lines:
            self._remember(line)
        found = [
            r for key, points in self.points.items() for p in points if (r := self._worst(key, p))
        ]
        return sorted(
            found, key=lambda r: (r.run_path, r.step, r.task, str(r.num_fewshot), r.metric)
        )

    def load(self, lines: Iterable[dict[str, Any]]) -> None:
        """Ledger lines already written: history, never reported (and not judged here: that
        would read every result's records at start-up)."""
        for line in lines:
            self._remember(line)
        for key, points in self.points.items():
            for p in points:
                self.reported.add((key[0], p.step, key[1], key[2], key[3]))

    def observe(self, line: dict[str, Any]) -> list[Regression]:
        if not self._remember(line) or line.get("run_path") == BASELINE_RUN:
            return []
        found = []
        run_path, step = line.get("run_path") or line["run"], line["step"]
        for metric, _value, _se in _judged_metrics(line):
            key = (run_path, entry_name(line), line.get("num_fewshot"), metric)
            # this result, and every later step's (this one may be their new best earlier step)
            for p in sorted(self.points.get(key, []), key=lambda p: p.step):
                if p.step < step:
                    continue
                ident = (run_path, p.step, key[1], key[2], metric)
                if ident in self.reported:
                    continue
                regression = self._worst(key, p)
                if regression is not None:
                    self.reported.add(ident)
                    found.append(regression)
        return found

    def _remember(self, line: dict[str, Any]) -> bool:
        if line.get("status") == "ok" and line.get("no_op"):
            self._forget(line)  # a step rewritten into its base model: its old numbers go
            return False
        if not is_result(line):
            return False
        if line.get("run_path") == BASELINE_RUN:
            self.baseline_lines.append(line)
            return True
        step = line.get("step")
        if not isinstance(step, int):
            return False  # a labelled checkpoint (`final`) has no place on the step axis
        run_path = line.get("run_path") or line["run"]
        records = self._records_path(line)
        for metric, value, se in _judged_metrics(line):
            key = (run_path, entry_name(line), line.get("num_fewshot"), metric)
            points = self.points.setdefault(key, [])
            points[:] = [p for p in points if p.step != step]  # a rewritten checkpoint: newest
            points.append(_Point(step, value, se, records))
        return True

    def _forget(self, line: dict[str, Any]) -> None:
        """Drop the points of `line`'s step and task (every metric): it is its base model now."""
        run_path, step = line.get("run_path") or line["run"], line.get("step")
        for key, points in self.points.items():
            if key[:3] == (run_path, entry_name(line), line.get("num_fewshot")):
                points[:] = [p for p in points if p.step != step]

    def _records_path(self, line: dict[str, Any]) -> Path | None:
        return None if self.ledger_dir is None else records_path(self.ledger_dir, line)

    def _worst(self, key: Key, p: _Point) -> Regression | None:
        """The larger regression of `p` against its run's best earlier step and the baseline."""
        _, task, shots, metric = key
        sign = -1.0 if metric.partition(",")[0] in LOWER_IS_BETTER else 1.0
        refs: list[tuple[float, float | None, str, Path | None]] = []
        earlier = [q for q in self.points.get(key, []) if q.step < p.step]
        if earlier:
            best = max(earlier, key=lambda q: sign * q.value)
            refs.append((best.value, best.se, f"step {best.step}", best.records))
        base = baseline_values(self.fixed, self.baseline_lines)
        col = column(task, shots, metric)
        if _number(base.get(col)) is not None:
            ref_se = _number(base.get(stderr_column(col)))
            refs.append((float(base[col]), ref_se, self._baseline_label(), self._baseline(key)))
        worst: Regression | None = None
        for ref, ref_se, against, ref_records in refs:
            drop = sign * (ref - p.value)
            if drop <= self.min_drop:
                continue
            found = self._judge(p, ref, ref_se, ref_records, metric, sign)
            if found is None:
                continue
            sigmas, paired = found
            if worst is None or sigmas > worst.sigmas:
                ci = (paired.low, paired.high) if paired else None
                worst = Regression(
                    key[0],
                    p.step,
                    task,
                    shots,
                    metric,
                    p.value,
                    ref,
                    against,
                    sigmas,
                    ci,
                    paired.documents if paired else None,
                )
        return worst

    def _judge(
        self,
        p: _Point,
        ref: float,
        ref_se: float | None,
        ref_records: Path | None,
        metric: str,
        sign: float,
    ) -> tuple[float, PairedDelta | None] | None:
        """Whether `p`'s drop from `ref` is beyond the noise: by the paired test where both
        have records, else by the stderr rule. Returns (the drop in standard errors, the paired
        change where paired), or None."""
        change = paired_files(ref_records, p.records, metric)
        if change is not None:
            if not change.real or sign * change.delta >= 0:
                return None
            se = (change.high - change.low) / (2 * t_quantile(0.975, change.documents - 1))
            # every document moved by the same amount: no spread, as sure as it gets
            return (-sign * change.delta / se if se > 0 else SURE), change
        if p.se is None:
            return None
        bound = math.sqrt(p.se**2 + (ref_se or 0.0) ** 2)
        drop = sign * (ref - p.value)
        if bound > 0 and drop > self.k * bound:
            return drop / bound, None
        return None

    def _baseline(self, key: Key) -> Path | None:
        """The evaluated baseline's records for `key`'s task and shots (None: numbers only)."""
        if self.ledger_dir is None:
            return None
        return baseline_records(self.ledger_dir, self.baseline_lines).get((key[1], key[2]))

    def _baseline_label(self) -> str:
        return f"the baseline ({self.baseline_name})"


def standing(cfg: Any, lines: list[dict[str, Any]]) -> list[Regression]:
    """The regressions a run's ledger lines show now (against its own earlier steps and the
    config's baseline): what `watcher report` lists."""
    from ckpt_watcher.sources.baseline import baseline_lines

    return RegressionWatch.of(cfg).standing([*baseline_lines(cfg), *lines])


def no_op_text(line: dict[str, Any]) -> str:
    return (
        f"checkpoint changes nothing: {line.get('run_path') or line['run']} step "
        f"{line.get('step')} ({line.get('label')}): {line.get('no_op')}; its results are its "
        "base model's, left out of the run's results"
    )


def failure_text(line: dict[str, Any]) -> str:
    return (
        f"eval failed: {line.get('run_path') or line['run']} step {line.get('step')} "
        f"{task_label(line)}: {line.get('error')}"
    )
