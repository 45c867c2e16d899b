"""`watcher report`: one self-contained HTML page, opened in a real headless Chromium (Debian's
`chromium`, driven by Playwright): the charts render with one point per evaluated step, the
stderr band and the baseline line are drawn, the results table, failures and flipped documents
are there, and opening it asks the network for nothing."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.ledger import append
from ckpt_watcher.report.page import open_failures, render_page

from .conftest import WATCHER, write_config

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ACC, SE = "exact_match,none", "exact_match_stderr,none"


def write_run(ledgers: Path) -> None:
    """Run `r`: addition (0-shot) at steps 100-400 with per-document records for 200-400,
    gsm8k (8-shot) at 100-300, and one failure at step 400 that stays open."""
    scores = {100: 0.1, 200: 0.3, 300: 0.5, 400: 0.8}
    for step, acc in scores.items():
        name = f"step_{step}/samples_addition.jsonl.gz"
        if step >= 200:
            path = ledgers / "r" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            right = int(acc * 10)
            recs = [
                {
                    "task": "addition",
                    "doc_id": i,
                    "prompt": f"{i}+{i}=",
                    "target": str(2 * i),
                    "responses": [str(2 * i) if i < right else "0"],
                    "extracted": {},
                    "scores": {ACC: [1.0 if i < right else 0.0]},
                }
                for i in range(10)
            ]
            path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in recs).encode()))
        append(ledgers, line(step, "addition", 0, acc, samples_file=name if step >= 200 else None))
        if step <= 300:
            append(ledgers, line(step, "gsm8k", 8, acc / 2))
    append(ledgers, line(400, "gsm8k", 8, 0, status="failed", error="CUDA out of memory\nmore"))


def line(step: int, task: str, shots: int, acc: float, **over: Any) -> dict[str, Any]:
    return {
        "run": "r",
        "run_path": "r",
        "step": step,
        "task": task,
        "num_fewshot": shots,
        "status": "ok",
        "metrics": {ACC: acc, SE: 0.05},
        "checkpoint": f"/ckpts/r_step{step}",
        "finished_at": "2026-11-22T10:00:00Z",
    } | over


def test_the_page_holds_every_part_and_failures_close_when_a_later_result_is_ok(
    tmp_path: Path,
) -> None:
    write_run(tmp_path)
    from ckpt_watcher.ledger import ledger_path, read_lines

    lines = read_lines(ledger_path(tmp_path, "r")).lines
    page = render_page(lines, "r", tmp_path, {"addition (0-shot) exact_match,none": 0.9}, "teacher")
    assert page.count('class="chart"') == 2
    assert 'data-points="4"' in page and 'data-points="3"' in page
    assert page.count('class="baseline"') == 1 and "teacher 0.9" in page
    assert "CUDA out of memory" in page and "more" not in page.split("CUDA out of memory")[1][:20]
    # first and last steps with records (200 -> 400), not the last two (300 -> 400: 3 learned)
    assert "step 200 → step 400: 5 learned, 0 forgot" in page and "3 learned" not in page
    assert "<script" not in page and "http" not in page.replace("http-equiv", "")
    # the failure closes once the same checkpoint's task has an ok line after it
    later = line(400, "gsm8k", 8, 0.4)
    assert len(open_failures(lines)) == 1 and open_failures([*lines, later]) == []


def test_watcher_report_renders_in_chromium(tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    ledgers = tmp_path / "ledgers"
    write_run(ledgers)
    (tmp_path / "ckpts").mkdir()
    cfg = write_config(
        tmp_path / "w.yaml",
        {
            "state_dir": str(tmp_path / "state"),
            "ledger_dir": str(ledgers),
            "sources": [{"kind": "local", "path": str(tmp_path / "ckpts")}],
            "eval": {"tasks": [{"task": "addition"}]},
            "baseline": {
                "name": "teacher",
                "metrics": [
                    {"task": "addition", "num_fewshot": 0, "metrics": {ACC: 0.9, SE: 0.01}}
                ],
            },
        },
    )
    out = tmp_path / "report.html"
    r = subprocess.run(
        [*WATCHER, "report", "-c", str(cfg), "r", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}" in r.stdout
    requests: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900}, java_script_enabled=False)
        page.on("request", lambda req: requests.append(req.url))
        page.goto(out.as_uri())
        charts = page.locator("svg.chart")
        assert charts.count() == 2
        by_column = {
            charts.nth(i).get_attribute("data-column"): charts.nth(i).locator("circle.point")
            for i in range(charts.count())
        }
        addition = by_column["addition (0-shot) exact_match,none"]
        gsm8k = by_column["gsm8k (8-shot) exact_match,none"]
        assert addition.count() == 4 and gsm8k.count() == 3
        steps = [addition.nth(i).get_attribute("data-step") for i in range(4)]
        assert steps == ["100", "200", "300", "400"]
        # drawn, not only present: each point has a size on screen, rising with the score
        boxes = [addition.nth(i).bounding_box() for i in range(4)]
        assert all(b is not None and b["width"] > 0 for b in boxes)
        ys = [b["y"] for b in boxes if b is not None]
        assert ys == sorted(ys, reverse=True)  # higher score, higher on the page
        assert page.locator("svg.chart polygon.band").count() == 2
        assert page.locator("svg.chart line.baseline").count() == 1  # addition has a baseline
        table = page.locator("table.results")
        assert table.locator("tbody tr").count() == 5  # teacher + 4 steps
        assert "0.8000" in table.inner_text()
        assert "CUDA out of memory" in page.locator("ul.failures").inner_text()
        flips = page.locator("table.flips tbody tr")
        assert flips.count() == 5  # docs 3 to 7 learned between steps 200 and 400
        assert "5 learned, 0 forgot" in page.inner_text("body")
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        browser.close()
    assert (tmp_path / "report.png").stat().st_size > 10_000
    assert requests == [out.as_uri()]  # self-contained: nothing else fetched


def test_a_failure_without_a_finish_time_or_shots_reads_cleanly(tmp_path: Path) -> None:
    failed = line(100, "addition", 0, 0, status="failed", error="SafetensorError: truncated")
    del failed["finished_at"]
    failed["num_fewshot"] = None
    page = render_page([failed], "r", tmp_path)
    assert "addition: <code>SafetensorError: truncated</code>" in page  # no shots set
    assert ", :" not in page and "None-shot" not in page


def test_the_report_lists_the_regressions_its_results_show(tmp_path: Path) -> None:
    """A drop beyond alerts.drop_stderr against the run's best earlier step or the baseline is
    on the page (before, only status and webhooks told of it)."""
    from click.testing import CliRunner

    from ckpt_watcher.cli import main

    ledgers = tmp_path / "ledgers"
    for step, acc in [(100, 0.5), (200, 0.8), (300, 0.79), (400, 0.6)]:
        append(ledgers, line(step, "addition", 0, acc))  # stderr 0.05 each
    cfg = write_config(
        tmp_path / "w.yaml",
        {
            "state_dir": str(tmp_path / "state"),
            "ledger_dir": str(ledgers),
            "sources": [{"kind": "local", "path": str(tmp_path)}],
            "eval": {"tasks": [{"task": "addition", "num_fewshot": 0}]},
            "baseline": {
                "name": "teacher",
                "metrics": [{"task": "addition", "num_fewshot": 0, "metrics": {ACC: 0.7}}],
            },
        },
    )
    out = tmp_path / "r.html"
    r = CliRunner().invoke(main, ["report", "-c", str(cfg), "r", "-o", str(out)])
    assert r.exit_code == 0, r.output
    page = out.read_text()
    section = page.split("<h2>Regressions</h2>")[1].split("<h2>")[0]
    # 100: 0.2 below the baseline (no stderr of its own: 0.2 / 0.05 = 4 stderrs); 400: 0.2
    # below step 200 (0.2 / sqrt(2 x 0.05²) = 2.8); 300 is 0.01 below 200: noise
    assert section.count('class="regression"') == 2
    assert (
        "<td>100</td><td>addition (0-shot)</td><td>exact_match,none</td><td>0.5000</td>" in section
    )
    assert "the baseline (teacher): 0.7000</td><td>4.0 stderr</td>" in section
    assert (
        "<td>400</td><td>addition (0-shot)</td><td>exact_match,none</td><td>0.6000</td>" in section
    )
    assert "step 200: 0.8000</td><td>2.8 stderr</td>" in section
    assert "<td>300</td>" not in section


def test_the_report_charts_response_lengths_by_step_beside_the_metrics(tmp_path: Path) -> None:
    lines = [
        line(step, "addition", 0, 0.5)
        | {
            "response_tokens": {"mean": mean, "p50": mean, "p90": mean + 10, "max": mean + 20},
            "length_capped_rate": capped,
            "unterminated_rate": None,
        }
        for step, mean, capped in [(100, 40.0, 0.0), (200, 80.0, 0.1), (300, 160.0, 0.3)]
    ]
    page = render_page(lines, "r", tmp_path)
    section = page.split("<h2>Response lengths by step</h2>")[1].split("<h2>")[0]
    assert section.count('class="chart"') == 3  # tokens mean, p90, capped share
    mean_chart = section.split('data-column="addition (0-shot) response_tokens.mean"')[1]
    points = mean_chart.split("</svg>")[0]
    assert all(f'data-value="{v}"' in points for v in (40.0, 80.0, 160.0))
    table = page.split('<table class="results">')[1].split("</table>")[0]
    assert "addition (0-shot) length_capped_rate" in table and "0.3000" in table
    older = [line(100, "addition", 0, 0.5)]  # no lengths measured: no such section
    assert "Response lengths" not in render_page(older, "r", tmp_path)
