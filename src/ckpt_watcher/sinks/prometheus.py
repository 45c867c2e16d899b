"""Prometheus metrics of one daemon, served at /metrics when `metrics_port` is set.

The loop updates gauges once per pass (jobs by state, devices busy or free); the ledger reports
each line it writes (lines by status, eval seconds per task); discovery reports how long after
its last write each checkpoint was judged ready. Source scan ages are computed at scrape time.
The HTTP server is prometheus-client's own, on a daemon thread: a slow scraper never holds up
the loop, and the loop never waits on it.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterable
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ckpt_watcher.ledger import is_result
from ckpt_watcher.report.table import entry_name, length_stats

log = structlog.get_logger("ckpt_watcher.sinks.prometheus")

JOB_STATES = ("queued", "running", "ok", "failed", "skipped")
# An eval takes seconds (a smoke task) to hours (pass@16 over AIME at 32k tokens).
EVAL_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800)
# inotify sees a closed file at once; polling waits up to poll_seconds; S3 listings take longer.
DETECTION_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class DaemonMetrics:
    """The daemon's metrics, in a registry of their own (two daemons in one process stay apart)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.jobs = Gauge("ckpt_watcher_jobs", "Eval jobs by state", ["state"], registry=r)
        self.devices = Gauge(
            "ckpt_watcher_devices",
            "Eval devices busy (running our job) or free",
            ["state"],
            registry=r,
        )
        self.device_busy = Gauge(
            "ckpt_watcher_device_busy",
            "1 while the device runs one of our jobs",
            ["device"],
            registry=r,
        )
        self.skipped = Counter(
            "watcher_checkpoints_skipped_total",
            "Checkpoints skipped by policy (reason: backlog, pin budget), each with skipped lines",
            ["reason"],
            registry=r,
        )
        self.yielded = Counter(
            "ckpt_watcher_evals_yielded_total",
            "Evals stopped to give their GPU back to another process (devices.yield_to_others)",
            ["device"],
            registry=r,
        )
        self.eval_seconds = Histogram(
            "ckpt_watcher_eval_seconds",
            "Seconds one task took on one checkpoint (ok results)",
            ["task"],
            buckets=EVAL_BUCKETS,
            registry=r,
        )
        self.detection = Histogram(
            "ckpt_watcher_detection_latency_seconds",
            "Seconds from a checkpoint's last file write to the watcher judging it ready",
            buckets=DETECTION_BUCKETS,
            registry=r,
        )
        self.source_age = Gauge(
            "ckpt_watcher_source_last_scan_age_seconds",
            "Seconds since the source's last successful scan",
            ["source"],
            registry=r,
        )
        self.ledger_unwritable = Gauge(
            "ckpt_watcher_ledger_unwritable_seconds",
            "Seconds since ledger_dir could not be written (0: it can); no eval starts meanwhile",
            registry=r,
        )
        self.ledger_lines = Counter(
            "ckpt_watcher_ledger_lines", "Ledger lines written, by status", ["status"], registry=r
        )
        self.progress = Gauge(
            "watcher_job_progress_ratio",
            "Share of the running job's current task done (units from its journal count)",
            ["job_id", "task"],
            registry=r,
        )
        self.response_tokens = Gauge(
            "ckpt_watcher_response_tokens",
            "Response length in tokens of a generation task's newest evaluated step, by stat "
            "(mean, p90)",
            ["run_path", "task", "stat"],
            registry=r,
        )
        self.length_capped = Gauge(
            "ckpt_watcher_length_capped_ratio",
            "Share of a generation task's responses stopped by the length cap, newest step",
            ["run_path", "task"],
            registry=r,
        )
        self._newest_step: dict[tuple[str, str], int] = {}
        self._progress_labels: set[tuple[str, str]] = set()
        for s in JOB_STATES:
            self.jobs.labels(s).set(0)
        for s in ("busy", "free"):
            self.devices.labels(s).set(0)
        for s in ("ok", "failed"):
            self.ledger_lines.labels(s)
        self._lock = threading.Lock()
        self._last_ok: dict[str, float] = {}
        self._server: Any = None

    def serve(self, port: int, addr: str) -> int:
        """Start the /metrics server; returns the port it listens on."""
        self._server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        bound = int(self._server.server_port)
        log.info("metrics.serving", url=f"http://{addr}:{bound}/metrics")
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # --- called by the loop, the ledger and discovery -------------------------------------------
    def loop_pass(
        self,
        job_counts: dict[str, int],
        devices: Iterable[str],
        busy: set[str],
        sources: Iterable[tuple[str, float | None]],
    ) -> None:
        """Once per loop pass: job counts by state, each device's label (busy: those running
        our jobs), and each source's name with the time of its last successful scan."""
        for state in set(JOB_STATES) | job_counts.keys():
            self.jobs.labels(state).set(job_counts.get(state, 0))
        labels = list(devices)
        for label in labels:
            self.device_busy.labels(label).set(1 if label in busy else 0)
        n_busy = sum(1 for label in labels if label in busy)
        self.devices.labels("busy").set(n_busy)
        self.devices.labels("free").set(len(labels) - n_busy)
        with self._lock:
            for name, last_ok in sources:
                if name not in self._last_ok:
                    self.source_age.labels(name).set_function(functools.partial(self._age, name))
                self._last_ok[name] = last_ok if last_ok is not None else float("nan")

    def job_progress(self, ratios: dict[tuple[str, str], float]) -> None:
        """Each running job's (job id, task) -> share done; series of jobs gone are removed."""
        for labels in self._progress_labels - ratios.keys():
            self.progress.remove(*labels)
        for labels, ratio in ratios.items():
            self.progress.labels(*labels).set(ratio)
        self._progress_labels = set(ratios)

    def _age(self, name: str) -> float:
        with self._lock:
            last_ok = self._last_ok.get(name, float("nan"))
        return time.time() - last_ok  # NaN until the first successful scan

    def ledger_line(self, line: dict[str, Any]) -> None:
        status = str(line.get("status"))
        self.ledger_lines.labels(status).inc()
        duration = line.get("duration_s")
        if status == "ok" and isinstance(duration, int | float) and not line.get("reused_from"):
            self.eval_seconds.labels(entry_name(line)).observe(float(duration))
        self._lengths(line)

    def _lengths(self, line: dict[str, Any]) -> None:
        """The newest step's response lengths per (run, task): steps may be evaluated out of
        order, so an older step's line leaves the gauges alone."""
        stats, step = length_stats(line), line.get("step")
        if not is_result(line) or not stats or not isinstance(step, int):
            return
        key = (str(line.get("run_path") or line.get("run")), entry_name(line))
        if step < self._newest_step.get(key, step):
            return
        self._newest_step[key] = step
        for stat in ("mean", "p90"):
            if f"response_tokens.{stat}" in stats:
                self.response_tokens.labels(*key, stat).set(stats[f"response_tokens.{stat}"])
        if "length_capped_rate" in stats:
            self.length_capped.labels(*key).set(stats["length_capped_rate"])

    def checkpoint_ready(self, latency_s: float) -> None:
        self.detection.observe(latency_s)
