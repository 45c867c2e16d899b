"""Where results and the daemon's health go besides the ledger: the run's HTML page, W&B,
regression alerts and webhooks (`Sinks`, told of every ledger line), and Prometheus metrics.

Each sink does its I/O on a thread of its own: the daemon's loop only hands them lines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import structlog

from ckpt_watcher.config import WandbSink, WatcherConfig, WebhookSink
from ckpt_watcher.sinks.alerts import RegressionWatch, failure_text, no_op_text, standing
from ckpt_watcher.sinks.page import ReportWriter
from ckpt_watcher.sinks.prometheus import DaemonMetrics
from ckpt_watcher.sinks.wandb import WandbSinkWorker
from ckpt_watcher.sinks.webhook import Webhook
from ckpt_watcher.sources.baseline import run_baseline
from ckpt_watcher.state import State

log = structlog.get_logger("ckpt_watcher.sinks")

REGRESSIONS_KEPT = 20  # the newest regressions `watcher status` shows
NO_OPS_KEPT = 20  # the newest checkpoints that changed nothing, which it shows too
REPORT_FLUSH_SECONDS = 10.0  # on stop, for HTML pages still to be written
WEBHOOK_FLUSH_SECONDS = 5.0  # on stop, per webhook, for messages still queued
WANDB_FLUSH_SECONDS = 30.0  # on stop, per W&B sink, to log what is queued and finish its runs


class Sinks:
    """Told of each ledger line written (on the loop's thread): counts it in the metrics,
    rewrites the run's page, hands it to W&B, and judges it for regressions, which, with
    failed lines, go to the log, `watcher status` and the webhooks."""

    def __init__(
        self,
        cfg: WatcherConfig,
        state: State,
        metrics: DaemonMetrics,
        page_written: Callable[[str], None] | None,
        clock: Callable[[], float],
    ) -> None:
        self.state = state
        self.metrics = metrics
        self.clock = clock
        self.regressions = RegressionWatch.of(cfg)
        self.pages = ReportWriter(
            cfg.ledger_dir,
            baseline=lambda run_path: run_baseline(cfg, run_path),
            written=page_written,
            judge=lambda lines: standing(cfg, lines),
        )
        self.webhooks = [
            Webhook(s.url, s.timeout_seconds) for s in cfg.sinks if isinstance(s, WebhookSink)
        ]
        self.wandb = [
            WandbSinkWorker(s, cfg.ledger_dir, cfg.state_dir)
            for s in cfg.sinks
            if isinstance(s, WandbSink)
        ]

    def start(self, runs: list[str], history: Iterable[dict[str, Any]]) -> None:
        """At start: the ledger's lines so far are history (no alerts); W&B catches up on every
        run (lines written while the daemon was down, or W&B unreachable)."""
        self.regressions.load(history)
        for sink in self.wandb:
            for run in runs:
                sink.request(run)

    def ledger_line(self, line: dict[str, Any]) -> None:
        run_path = line.get("run_path") or line["run"]
        self.metrics.ledger_line(line)
        self.pages.request(run_path)
        for sink in self.wandb:
            sink.request(run_path)
        if line.get("status") == "failed":
            self._notify(failure_text(line))
        if line.get("status") == "ok" and line.get("no_op"):
            self._no_op(line)
        for r in self.regressions.observe(line):
            log.warning("eval.regression", **r.as_dict())
            recent = (self.state.get_meta("regressions") or []) + [
                r.as_dict() | {"at": self.clock()}
            ]
            self.state.set_meta(regressions=recent[-REGRESSIONS_KEPT:])
            self._notify(r.text())

    def _no_op(self, line: dict[str, Any]) -> None:
        """A step that changes nothing: said once per checkpoint (not per task), and kept for
        `watcher status`."""
        seen = self.state.get_meta("no_ops") or []
        at = {"run_path": line.get("run_path") or line["run"], "step": line.get("step")}
        at |= {"label": line.get("label"), "fingerprint": line.get("fingerprint")}
        if any(all(s.get(k) == v for k, v in at.items()) for s in seen):
            return
        log.warning("eval.no_op", **at, why=line["no_op"])
        self.state.set_meta(no_ops=(seen + [at | {"why": line["no_op"]}])[-NO_OPS_KEPT:])
        self._notify(no_op_text(line))

    def _notify(self, text: str) -> None:
        for hook in self.webhooks:
            hook.send(text)

    def flush_pages(self) -> None:
        """Before the mirror's last upload: the pages still due, within REPORT_FLUSH_SECONDS."""
        if not self.pages.flush(REPORT_FLUSH_SECONDS):
            log.warning("report.behind", hint="`watcher report` writes a run's page now")
        self.pages.close()

    def close(self) -> None:
        """At stop: each sink gets its own bounded time to send what is queued."""
        for hook in self.webhooks:
            hook.close(WEBHOOK_FLUSH_SECONDS)
        for sink in self.wandb:
            sink.close(WANDB_FLUSH_SECONDS)
