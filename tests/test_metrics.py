"""Prometheus /metrics (`metrics_port`): scraped over loopback from a real `watcher run` while a
real eval runs, and after its ledger line is written."""

from __future__ import annotations

import os
import signal
import socket
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckpt_watcher.sinks.prometheus import DaemonMetrics

from .conftest import WATCHER, base_config, idle_config, read_ledger, write_config
from .helpers import running_job, status_json, wait_for, watcher_run

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_metrics_report_jobs_devices_sources_lines_and_latencies() -> None:
    m = DaemonMetrics()
    port = m.serve(0, "127.0.0.1")
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        import time

        m.loop_pass(
            {"running": 1, "queued": 2},
            ["cpu:0", "cpu:1", "cpu:2"],
            {"cpu:1"},
            [("local:/ckpts", time.time() - 30), ("s3://b/p/", None)],
        )
        m.ledger_line({"status": "ok", "task": "gsm8k", "duration_s": 42.0})
        m.ledger_line({"status": "ok", "task": "gsm8k", "duration_s": 7.0, "reused_from": "x"})
        m.ledger_line({"status": "failed", "task": "gsm8k", "duration_s": None})
        m.checkpoint_ready(0.3)
        s = scrape(url)
        assert value(s, "ckpt_watcher_jobs", state="running") == 1
        assert value(s, "ckpt_watcher_jobs", state="queued") == 2
        assert value(s, "ckpt_watcher_jobs", state="ok") == 0
        assert value(s, "ckpt_watcher_devices", state="busy") == 1
        assert value(s, "ckpt_watcher_devices", state="free") == 2
        assert value(s, "ckpt_watcher_device_busy", device="cpu:1") == 1
        assert value(s, "ckpt_watcher_device_busy", device="cpu:0") == 0
        age = value(s, "ckpt_watcher_source_last_scan_age_seconds", source="local:/ckpts")
        assert age is not None and 29 < age < 60
        never = value(s, "ckpt_watcher_source_last_scan_age_seconds", source="s3://b/p/")
        assert never is not None and never != never  # NaN: never scanned successfully
        assert value(s, "ckpt_watcher_ledger_lines_total", status="ok") == 2
        assert value(s, "ckpt_watcher_ledger_lines_total", status="failed") == 1
        # a reused result took no eval time: only the real eval is in the histogram
        assert value(s, "ckpt_watcher_eval_seconds_count", task="gsm8k") == 1
        assert value(s, "ckpt_watcher_eval_seconds_sum", task="gsm8k") == 42.0
        assert value(s, "ckpt_watcher_eval_seconds_bucket", task="gsm8k", le="60.0") == 1
        assert value(s, "ckpt_watcher_eval_seconds_bucket", task="gsm8k", le="30.0") == 0
        assert value(s, "ckpt_watcher_detection_latency_seconds_count") == 1
        assert value(s, "ckpt_watcher_detection_latency_seconds_bucket", le="0.5") == 1
        # the device goes free, the job count moves on
        m.loop_pass({"ok": 1}, ["cpu:0", "cpu:1", "cpu:2"], set(), [])
        s = scrape(url)
        assert value(s, "ckpt_watcher_jobs", state="running") == 0
        assert value(s, "ckpt_watcher_jobs", state="ok") == 1
        assert value(s, "ckpt_watcher_devices", state="free") == 3
    finally:
        m.close()


def busy_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_metrics_port_in_use_is_refused_with_what_to_do(tmp_path: Path) -> None:
    import subprocess

    sock = busy_port()
    try:
        port = sock.getsockname()[1]
        cfg = idle_config(tmp_path, metrics_port=port, metrics_addr="127.0.0.1")
        r = subprocess.run(
            [*WATCHER, "run", "-c", str(cfg)], capture_output=True, text=True, timeout=120
        )
    finally:
        sock.close()
    assert r.returncode != 0
    assert f"cannot serve /metrics on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert "choose a free port" in r.stderr


@pytest.mark.e2e
def test_watcher_run_serves_metrics_while_a_job_runs(
    tmp_path: Path, copy_checkpoint: Callable[..., Path]
) -> None:
    from ckpt_watcher.demo.tiny import write_task

    watch = tmp_path / "ckpts"
    watch.mkdir()
    data: dict[str, Any] = base_config(tmp_path, watch, write_task(tmp_path / "tasks"))
    data |= {"metrics_port": 0, "metrics_addr": "127.0.0.1"}
    cfg = write_config(tmp_path / "w.yaml", data)
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        up = wait_for(
            lambda: (st := status_json(cfg)[1]) and st["daemon"].get("metrics_url") and st,
            60,
            "the daemon to serve /metrics",
            daemon,
            log,
        )
        url = up["daemon"]["metrics_url"]
        s = scrape(url)
        assert value(s, "ckpt_watcher_devices", state="free") == 1
        assert value(s, "ckpt_watcher_jobs", state="running") == 0
        copy_checkpoint(watch / "run_step100")

        def scraped_running() -> Samples | None:
            s = scrape(url)
            return s if value(s, "ckpt_watcher_jobs", state="running") == 1 else None

        # the eval takes a second or two: frozen while it runs, for the scrapes to see it
        job = wait_for(lambda: running_job(tmp_path / "state"), 120, "the job", daemon, log)
        assert job.pid is not None
        os.killpg(job.pid, signal.SIGSTOP)
        try:
            during = wait_for(scraped_running, 60, "a scrape while the job runs", daemon, log)
        finally:
            os.killpg(job.pid, signal.SIGCONT)
        assert value(during, "ckpt_watcher_devices", state="busy") == 1
        assert value(during, "ckpt_watcher_device_busy", device="cpu:0") == 1
        assert value(during, "ckpt_watcher_ledger_lines_total", status="ok") == 0
        # judged ready within a scan or two of the copy appearing (poll_seconds 1)
        assert value(during, "ckpt_watcher_detection_latency_seconds_count") == 1
        assert value(during, "ckpt_watcher_detection_latency_seconds_bucket", le="10.0") == 1
        age = value(during, "ckpt_watcher_source_last_scan_age_seconds", source=f"local:{watch}")
        assert age is not None and 0 <= age < 10, during

        def scraped_done() -> Samples | None:
            s = scrape(url)
            return s if value(s, "ckpt_watcher_ledger_lines_total", status="ok") == 1 else None

        after = wait_for(scraped_done, 180, "the ledger line in /metrics", daemon, log)
        (line,) = read_ledger(tmp_path / "ledgers", "run")
        assert line["status"] == "ok"
        assert value(after, "ckpt_watcher_eval_seconds_count", task="addition") == 1
        assert value(after, "ckpt_watcher_eval_seconds_sum", task="addition") == pytest.approx(
            line["duration_s"]
        )
        wait_for(
            lambda: value(scrape(url), "ckpt_watcher_devices", state="free") == 1,
            30,
            "the device to show free again",
            daemon,
            log,
        )


def test_response_lengths_of_the_newest_step_reach_prometheus_and_wandb() -> None:
    from ckpt_watcher.sinks.wandb import logged_values

    def line(step: int, mean: float, capped: float) -> dict[str, Any]:
        tokens = {"mean": mean, "p50": mean, "p90": mean * 2, "max": int(mean * 3)}
        return {"status": "ok", "run_path": "job/r", "task": "aime", "num_fewshot": 0} | {
            "step": step,
            "metrics": {"acc,none": 0.5},
            "response_tokens": tokens,
            "length_capped_rate": capped,
            "unterminated_rate": None,
        }

    m = DaemonMetrics()
    port = m.serve(0, "127.0.0.1")
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        m.ledger_line(line(200, 900.0, 0.25))
        m.ledger_line(line(100, 500.0, 0.0))  # an older step, evaluated later: not the newest
        s = scrape(url)
        labels = {"run_path": "job/r", "task": "aime"}
        assert value(s, "ckpt_watcher_response_tokens", stat="mean", **labels) == 900.0
        assert value(s, "ckpt_watcher_response_tokens", stat="p90", **labels) == 1800.0
        assert value(s, "ckpt_watcher_length_capped_ratio", **labels) == 0.25
        m.ledger_line(line(300, 1200.0, 0.5))
        s = scrape(url)
        assert value(s, "ckpt_watcher_response_tokens", stat="mean", **labels) == 1200.0
        assert value(s, "ckpt_watcher_length_capped_ratio", **labels) == 0.5
    finally:
        m.close()
    logged = logged_values(line(300, 1200.0, 0.5))
    assert logged is not None and logged["train/step"] == 300
    assert logged["eval/aime/0shot/response_tokens.mean"] == 1200.0
    assert logged["eval/aime/0shot/response_tokens.p90"] == 2400.0
    assert logged["eval/aime/0shot/length_capped_rate"] == 0.5
    assert "eval/aime/0shot/unterminated_rate" not in logged  # null: not judged
