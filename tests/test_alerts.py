"""Regression alerts (`alerts.drop_stderr`) and webhooks (`sinks: [{kind: webhook}]`): the rule on
ledger lines, a loopback HTTP server that answers, fails or hangs, and a real `watcher once`
with a webhook and W&B (offline) side by side."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.sinks.alerts import RegressionWatch
from ckpt_watcher.sinks.wandb import own_run_id
from ckpt_watcher.sinks.webhook import Webhook

from .conftest import WATCHER, base_config, read_ledger, write_config
from .helpers import wandb_history, wandb_rows, watcher_once

ACC = "exact_match,none"
SE = "exact_match_stderr,none"


def line(step: Any, value: float, se: float | None = 0.05, **over: Any) -> dict[str, Any]:
    metrics = {ACC: value} | ({SE: se} if se is not None else {})
    return {
        "run": "r",
        "run_path": "r",
        "step": step,
        "task": "gsm8k",
        "num_fewshot": 8,
        "status": "ok",
        "metrics": metrics,
    } | over


def watch(k: float = 2.0, fixed: list[Any] | None = None) -> RegressionWatch:
    return RegressionWatch(k, fixed or [], "Qwen3-1.7B-Base")


def test_a_drop_beyond_k_stderr_below_the_best_earlier_step_is_a_regression() -> None:
    w = watch()
    assert w.observe(line(100, 0.50)) == []
    assert w.observe(line(200, 0.60)) == []
    # 0.05 below the best (0.60): 0.7 stderr of the difference, noise
    assert w.observe(line(300, 0.55)) == []
    (r,) = w.observe(line(400, 0.40))  # 0.20 below: 2.8 stderr
    assert (r.step, r.against, r.reference, r.value) == (400, "step 200", 0.60, 0.40)
    assert r.sigmas == pytest.approx(0.20 / (2 * 0.05**2) ** 0.5)
    assert "r step 400 gsm8k (8-shot) exact_match,none = 0.4000, 2.8 stderr below step 200" in (
        r.text()
    )
    # another run's numbers are its own; the stderr columns are never judged themselves
    assert w.observe(line(500, 0.10, run_path="other")) == []


def test_evals_that_run_newest_first_still_find_the_regression_once() -> None:
    w = watch()
    assert w.observe(line(400, 0.40)) == []  # nothing earlier yet
    (r,) = w.observe(line(200, 0.60))  # now step 400 has a better step before it
    assert (r.step, r.against) == (400, "step 200")
    assert w.observe(line(300, 0.62)) == []  # 400 was reported already: once
    assert w.observe(line(100, 0.10)) == []


def test_no_stderr_no_verdict_and_lower_is_better_metrics_turn_around() -> None:
    w = watch()
    w.observe(line(100, 0.9, se=None))
    assert w.observe(line(200, 0.1, se=None)) == []
    ppl = {
        "task": "wikitext",
        "metrics": {"word_perplexity,none": 10.0, "word_perplexity_stderr,none": 0.5},
    }
    w.observe(line(100, 0, **ppl))
    worse = {
        "task": "wikitext",
        "metrics": {"word_perplexity,none": 14.0, "word_perplexity_stderr,none": 0.5},
    }
    (r,) = w.observe(line(200, 0, **worse))
    assert (r.metric, r.reference, r.value) == ("word_perplexity,none", 10.0, 14.0)
    better = {
        "task": "wikitext",
        "metrics": {"word_perplexity,none": 6.0, "word_perplexity_stderr,none": 0.5},
    }
    assert w.observe(line(300, 0, **better)) == []


def test_below_the_baseline_fixed_or_evaluated() -> None:
    w = watch(fixed=[("gsm8k", 8, {ACC: 0.70, SE: 0.01})])
    (r,) = w.observe(line(100, 0.50))
    assert r.against == "the baseline (Qwen3-1.7B-Base)" and r.reference == 0.70
    assert w.observe(line(200, 0.69)) == []
    # a baseline checkpoint's own results, once in the ledger, count as the baseline
    w = watch()
    assert w.observe(line(100, 0.50)) == []
    assert w.observe(line(None, 0.80, run_path="baseline", run="baseline", label="base")) == []
    (r,) = w.observe(line(200, 0.55))
    assert r.against == "the baseline (Qwen3-1.7B-Base)" and r.reference == 0.80


def test_results_already_in_the_ledger_are_history_not_news() -> None:
    w = watch()
    w.load([line(100, 0.6), line(200, 0.3), {**line(250, 0.0), "status": "failed"}])
    assert w.observe(line(300, 0.58)) == []
    (r,) = w.observe(line(400, 0.2))
    assert r.step == 400 and r.against == "step 100"


# --- the paired test, where both results kept per-document records ----------------------------
def _with_records(
    ledger_dir: Path, step: Any, correct: list[int], k: int = 16, **over: Any
) -> dict[str, Any]:
    """A line whose records give document i `correct[i]` right answers of `k`; its ledger
    figures are their mean and an (unpaired) stderr of 0.07."""
    import gzip

    run_path = over.get("run_path", "r")
    name = f"samples_{step}.jsonl.gz"
    (ledger_dir / run_path).mkdir(parents=True, exist_ok=True)
    with gzip.open(ledger_dir / run_path / name, "wt") as f:
        for i, c in enumerate(correct):
            scores = [1.0] * c + [0.0] * (k - c)
            f.write(json.dumps({"task": "gsm8k", "doc_id": i, "scores": {ACC: scores}}) + "\n")
    value = sum(correct) / (k * len(correct))
    return line(step, value, se=0.07, samples_file=name, **over)


# 30 problems of very different difficulty (AIME-like), K=16; a later step loses 1 or 3 right
# answers on every problem (-0.125 on average): consistent, so real, but small beside the
# spread between problems that the unpaired stderrs carry
BEFORE = [3 + (i * 7) % 13 for i in range(30)]  # 3..15 right of 16
AFTER = [c - (1 if i % 2 else 3) for i, c in enumerate(BEFORE)]


def test_with_records_on_both_sides_the_paired_test_decides(tmp_path: Path) -> None:
    w = RegressionWatch(2.0, [], "base", ledger_dir=tmp_path)
    assert w.observe(_with_records(tmp_path, 100, BEFORE)) == []
    (r,) = w.observe(_with_records(tmp_path, 200, AFTER))
    assert (r.step, r.against, r.documents) == (200, "step 100", 30)
    assert r.ci95 is not None and r.ci95[0] < -0.125 < r.ci95[1] < 0
    assert "-0.1250 [95% CI " in r.text() and "over 30 paired documents from step 100" in r.text()
    # the same ledger figures without records: the unpaired stderr rule calls it noise
    # (0.125 < 2 * sqrt(2) * 0.07)
    plain = RegressionWatch(2.0, [], "base")
    plain.observe(line(100, sum(BEFORE) / 480, se=0.07))
    assert plain.observe(line(200, sum(AFTER) / 480, se=0.07)) == []
    # a change within the noise: half the problems lose one answer, half gain one
    w = RegressionWatch(2.0, [], "base", ledger_dir=tmp_path / "noise")
    w.observe(_with_records(tmp_path / "noise", 100, BEFORE))
    mixed = [c + (1 if i % 2 else -1) for i, c in enumerate(BEFORE)]
    assert w.observe(_with_records(tmp_path / "noise", 200, mixed)) == []


def test_min_drop_keeps_small_sure_drops_quiet_and_an_evaluated_baseline_pairs_too(
    tmp_path: Path,
) -> None:
    from ckpt_watcher.config import load_config

    # the daemon's watch, from a config: its ledgers' records and alerts.min_drop
    data = base_config(tmp_path, tmp_path / "ckpts", tmp_path / "tasks")
    data["alerts"] = {"min_drop": 0.2}
    w = RegressionWatch.of(load_config(write_config(tmp_path / "w.yaml", data)))
    ledgers = tmp_path / "ledgers"
    w.observe(_with_records(ledgers, 100, BEFORE))
    assert w.observe(_with_records(ledgers, 200, AFTER)) == []  # sure, but under 0.2
    worse = [c // 2 for c in AFTER]  # about 0.3 lower: beyond min_drop too
    (r,) = w.observe(_with_records(ledgers, 300, worse))
    assert r.documents == 30 and r.against == "step 100"
    # against the evaluated baseline's own records
    w = RegressionWatch(2.0, [], "base", ledger_dir=tmp_path)
    base = {"run_path": "baseline", "run": "baseline", "label": "baseline"}
    assert w.observe(_with_records(tmp_path, None, BEFORE, **base)) == []
    (r,) = w.observe(_with_records(tmp_path, 300, AFTER))
    assert r.against == "the baseline (base)" and r.documents == 30


def test_the_results_tables_baseline_delta_is_marked_by_the_paired_test_where_it_can_be(
    tmp_path: Path,
) -> None:
    """`watcher results` beside an evaluated baseline: a Δ whose both sides kept records is
    marked `*` by the paired test (here a consistent drop the stderrs call noise); one without
    records keeps the stderr rule."""
    from ckpt_watcher.report.samples import baseline_pairing
    from ckpt_watcher.report.table import baseline_values, metric_table

    base = {"run_path": "baseline", "run": "baseline", "label": "baseline"}
    baseline = [_with_records(tmp_path, 0, BEFORE, **base)]
    lines = [
        _with_records(tmp_path, 100, AFTER),
        line(200, sum(AFTER) / 480, se=0.07),  # no records: the stderr rule
    ]
    pairing = baseline_pairing(tmp_path, baseline)
    assert pairing is not None
    table = metric_table(
        lines, baseline=baseline_values([], baseline), baseline_name="base", pairing=pairing
    )
    delta = table.columns.index(f"Δ gsm8k (8-shot) {ACC}")
    assert [row[delta] for row in table.rows] == [None, "-0.1250*", "-0.1250"]
    assert baseline_pairing(tmp_path, [line(0, 0.5, **base)]) is None  # nothing to pair with


# --- the webhook -------------------------------------------------------------------------------
class Hook:
    """A loopback HTTP endpoint: records JSON bodies; `fail` answers 500 that many times first;
    `hang` holds every request until released."""

    def __init__(self, fail: int = 0, hang: bool = False) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.fail = fail
        self.release = threading.Event()
        if not hang:
            self.release.set()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.release.wait()
                if hook.fail > 0:
                    hook.fail -= 1
                    self.send_response(500)
                    self.end_headers()
                    return
                hook.bodies.append(json.loads(body))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def hook_server(**kw: Any) -> Iterator[Hook]:
    h = Hook(**kw)
    try:
        yield h
    finally:
        h.close()


def test_webhook_posts_slack_json_and_retries_a_failing_endpoint() -> None:
    with hook_server(fail=2) as h:
        hook = Webhook(h.url, timeout_seconds=5)
        hook.send("first")
        hook.send("second")
        hook.close(budget_seconds=30)
        # the first message got its third attempt after two 500s; nothing lost, nothing twice
        assert h.bodies == [{"text": "first"}, {"text": "second"}]
        assert (hook.sent, hook.dropped) == (2, 0)


def test_a_hanging_webhook_never_blocks_the_caller_and_stop_is_bounded() -> None:
    with hook_server(hang=True) as h:
        hook = Webhook(h.url, timeout_seconds=30)
        for i in range(150):  # more than the queue holds: the oldest are dropped, never waited on
            hook.send(f"message {i}")
        assert hook.dropped >= 150 - 100 - 1
        hook.close(budget_seconds=0.5)  # returns with the post still hanging
        assert hook._thread.is_alive() and h.bodies == []


def test_a_webhook_that_refuses_connections_drops_after_three_attempts_and_logs_no_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The URL is a credential (Slack's path is its key): the log says where, never all of it."""
    import socket

    from structlog.testing import CapturingLogger

    from ckpt_watcher.sinks import webhook

    logs = CapturingLogger()
    monkeypatch.setattr(webhook, "log", logs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    secret = "services/T0AAA/B0BBB/XyZsEcReT42"
    hook = Webhook(f"http://127.0.0.1:{port}/{secret}", timeout_seconds=1)
    hook.send("lost")
    hook.close(budget_seconds=30)
    assert (hook.sent, hook.dropped) == (0, 1)
    # (another test's hanging webhook may log meanwhile, from its own thread)
    (call,) = [c for c in logs.calls if f":{port}/" in c.kwargs.get("url", "")]
    assert call.args[0] == "webhook.failed" and call.kwargs["url"].startswith("http://127.0.0.1")
    assert "XyZsEcReT42" not in repr(call), call


# --- end to end ----------------------------------------------------------------------------------
@pytest.mark.e2e
def test_watcher_once_reports_regressions_and_failures_to_log_status_and_webhook(
    tmp_path: Path, copy_checkpoint: Callable[..., Path]
) -> None:
    import subprocess

    from ckpt_watcher.demo.tiny import write_task

    watch_dir = tmp_path / "ckpts"
    copy_checkpoint(watch_dir / "run_step100")
    copy_checkpoint(watch_dir / "run_step200")
    copy_checkpoint(watch_dir / "run_step300", edit_config=lambda c: c.pop("model_type"))
    data = base_config(tmp_path, watch_dir, write_task(tmp_path / "tasks"))
    data["eval"]["max_attempts"] = 1
    # far above what the tiny model scores, on any machine
    data["baseline"] = {
        "name": "teacher",
        "metrics": [{"task": "addition", "num_fewshot": 0, "metrics": {ACC: 0.9, SE: 0.01}}],
    }
    wandb_sink = {"kind": "wandb", "project": "p", "mode": "offline", "dir": str(tmp_path / "wb")}
    with hook_server() as h:
        data["sinks"] = [{"kind": "webhook", "url": h.url}, wandb_sink]
        cfg = write_config(tmp_path / "w.yaml", data)
        lines = watcher_once(cfg, tmp_path / "ledgers", "run", expect=1)
        texts = [b["text"] for b in h.bodies]
    ok = {ln["step"]: ln for ln in lines if ln["status"] == "ok"}
    assert sorted(ok) == [100, 200] and [
        ln["step"] for ln in lines if ln["status"] == "failed"
    ] == [300]
    regressions = sorted(t for t in texts if t.startswith("regression:"))
    assert len(regressions) == 2, texts
    for step, t in zip((100, 200), regressions, strict=True):
        value = ok[step]["metrics"][ACC]
        assert f"run step {step} addition (0-shot) exact_match,none = {value:.4f}" in t
        assert "below the baseline (teacher) (0.9000)" in t
    # the daemon rewrote the run's HTML report after the appends: both steps are on its chart
    page = (tmp_path / "ledgers" / "run" / "report.html").read_text()
    assert 'data-points="2"' in page and "teacher 0.9" in page
    # and lists the regressions the webhook was told of
    listed = page.split("<h2>Regressions</h2>")[1].split("<h2>")[0]
    assert listed.count('class="regression"') == 2 and "the baseline (teacher): 0.9000" in listed
    # W&B (offline) got each ok result at its training step
    rows = wandb_rows(tmp_path / "wb", own_run_id("p", "run"), 2)
    assert sorted((r["train/step"], r["eval/addition/0shot/exact_match,none"]) for r in rows) == [
        (step, ok[step]["metrics"][ACC]) for step in (100, 200)
    ]
    (failure,) = [t for t in texts if t.startswith("eval failed:")]
    assert failure.startswith("eval failed: run step 300 addition (0-shot): ")
    # `watcher status` lists them, oldest first
    st = subprocess.run([*WATCHER, "status", "-c", str(cfg)], capture_output=True, text=True)
    assert "regressions (the newest 2, oldest first):" in st.stdout, st.stdout
    assert sum("below the baseline (teacher)" in ln for ln in st.stdout.splitlines()) == 2
    st_json = json.loads(
        subprocess.run(
            [*WATCHER, "status", "-c", str(cfg), "--json"], capture_output=True, text=True
        ).stdout
    )
    assert {r["step"] for r in st_json["regressions"]} == {100, 200}
    # a second pass finds nothing new: no alert is sent twice
    with hook_server() as h:
        data["sinks"] = [{"kind": "webhook", "url": h.url}, wandb_sink]
        write_config(cfg, data)
        watcher_once(cfg, tmp_path / "ledgers", "run", expect=0)
        assert h.bodies == []
    time.sleep(2)  # W&B writes on its own time: give a second send the chance to show
    assert len(wandb_history(tmp_path / "wb", own_run_id("p", "run"))) == 2
    assert len(read_ledger(tmp_path / "ledgers", "run")) == 3


def test_sinks_the_version_lacks_and_bad_urls_are_refused_by_name(tmp_path: Path) -> None:
    from ckpt_watcher.config import parse_config
    from ckpt_watcher.errors import ConfigError

    base: dict[str, Any] = {
        "sources": [{"kind": "local", "path": str(tmp_path)}],
        "eval": {"tasks": [{"task": "gsm8k"}]},
    }
    with pytest.raises(ConfigError, match=r"kind 'mlflow' is not a sink this version has"):
        parse_config(base | {"sinks": [{"kind": "mlflow", "uri": "p"}]})
    with pytest.raises(ConfigError, match=r"sinks\[0\]\.url: must be an http:// or https:// URL"):
        parse_config(base | {"sinks": [{"kind": "webhook", "url": "hooks.example/x"}]})
    cfg = parse_config(base | {"sinks": [{"kind": "webhook", "url": "http://127.0.0.1:9/x"}]})
    assert cfg.alerts.drop_stderr == 2 and cfg.sinks[0].timeout_seconds == 5
