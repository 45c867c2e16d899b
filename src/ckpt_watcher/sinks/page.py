"""The run's HTML page as a sink: rewritten after each ledger append, on a lane of its own
(coalesced per run), then handed to the ledger mirror. The page itself is `report/page.py`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import structlog

from ckpt_watcher.lane import Coalescing
from ckpt_watcher.report.page import Judge, write_report
from ckpt_watcher.sources.baseline import RunBaseline

log = structlog.get_logger("ckpt_watcher.sinks.page")


class ReportWriter:
    """Rewrites runs' pages on a lane of its own after appends (coalesced per run), then calls
    `written(run_path)` (the ledger mirror uploads it)."""

    def __init__(
        self,
        ledger_dir: Path,
        baseline: Callable[[str], RunBaseline],
        written: Callable[[str], None] | None = None,
        judge: Judge | None = None,
    ) -> None:
        self.ledger_dir = ledger_dir
        self.baseline = baseline
        self.judge = judge
        self.written = written
        self.pages = Coalescing("html-report", self._write)

    def request(self, run_path: str) -> None:
        self.pages.request(run_path)

    def _write(self, run_path: str) -> bool:
        try:
            base = self.baseline(run_path)
            write_report(
                self.ledger_dir,
                run_path,
                baseline=base.values,
                baseline_name=base.name,
                judge=self.judge,
                pairing=base.pairing,
            )
        except Exception as e:  # a page is a view: never worth more than a log line
            log.error("report.write_failed", run_path=run_path, error=str(e))
            return True  # the next append tries again; nothing to retry on a timer
        if self.written is not None:
            self.written(run_path)
        return True

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for pages due; True when none is left."""
        return self.pages.flush(timeout)

    def close(self) -> None:
        self.pages.close()
