"""Baselines: `baseline.checkpoint` (the base model, a folder or an S3 prefix, evaluated once as
run `baseline`, before the runs' checkpoints) and what `watcher results` shows beside it."""

from __future__ import annotations

import csv
import gzip
import io
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ckpt_watcher.cli import main
from ckpt_watcher.config import BASELINE_RUN, parse_config
from ckpt_watcher.errors import ConfigError
from ckpt_watcher.s3client import make_client
from ckpt_watcher.scheduler import order_jobs
from ckpt_watcher.sources import build_sources
from ckpt_watcher.state import Job

from .conftest import base_config, read_ledger, upload_dir, write_config, write_fake_checkpoint
from .helpers import status_json, watcher_once


def _raw(tmp: Path, baseline: dict) -> dict:
    return {
        "state_dir": str(tmp / "state"),
        "sources": [{"kind": "local", "path": str(tmp / "ckpts")}],
        "eval": {"tasks": [{"task": "addition"}]},
        "baseline": baseline,
    }


def test_a_baseline_is_a_checkpoint_or_fixed_numbers_and_lies_outside_the_sources(
    tmp_path: Path,
) -> None:
    fixed = [{"task": "addition", "metrics": {"exact_match,none": 0.5}}]
    with pytest.raises(ConfigError, match="either `checkpoint`.*or `metrics`.*not both"):
        parse_config(_raw(tmp_path, {"checkpoint": str(tmp_path / "base"), "metrics": fixed}))
    with pytest.raises(ConfigError, match="give `checkpoint`"):
        parse_config(_raw(tmp_path, {"name": "Qwen3-1.7B-Base"}))
    with pytest.raises(ConfigError, match="is inside the source local:.*outside the watched"):
        parse_config(_raw(tmp_path, {"checkpoint": str(tmp_path / "ckpts" / "base")}))
    s3 = parse_config(_raw(tmp_path, {"checkpoint": "s3://b/models/base"}))
    assert s3.baseline is not None and s3.baseline.checkpoint == "s3://b/models/base/"


def test_the_baseline_source_finds_exactly_its_checkpoint_as_run_baseline_step_0(
    tmp_path: Path,
) -> None:
    base = tmp_path / "models" / "Qwen3-1.7B-Base"
    write_fake_checkpoint(tmp_path / "models" / "other_step5")  # a sibling: never listed
    cfg = parse_config(_raw(tmp_path, {"checkpoint": str(base)}))
    source = build_sources(cfg)[-1]
    assert source.name == f"baseline:{base}"
    with pytest.raises(FileNotFoundError, match="baseline.checkpoint .* does not exist"):
        source.scan()
    write_fake_checkpoint(base)
    (found,) = source.scan()
    assert found.location == str(base) and found.path == base and found.ident is not None
    assert (found.ident.run, found.ident.run_path, found.ident.step) == (
        BASELINE_RUN,
        "baseline",
        0,
    )
    assert source.owns(str(base)) and not source.owns(str(tmp_path / "models" / "other_step5"))
    assert "config.json" in source.view(str(base)).files


def test_doctor_says_whether_the_baseline_checkpoint_is_there(tmp_path: Path) -> None:
    from ckpt_watcher.doctor import check_baseline

    base = tmp_path / "models" / "base"
    cfg = parse_config(_raw(tmp_path, {"checkpoint": str(base)}))
    (missing,) = check_baseline(cfg)
    assert not missing.ok and "does not exist (yet)" in missing.line()
    write_fake_checkpoint(base)
    (found,) = check_baseline(cfg)
    assert found.ok and found.line().endswith("evaluated once as run `baseline`")
    assert check_baseline(parse_config({**_raw(tmp_path, {}), "baseline": None})) == []


def test_the_baseline_job_goes_first_whatever_the_order() -> None:
    def job(jid: str, run: str, step: int) -> Job:
        return Job(
            id=jid,
            location=f"/c/{jid}",
            run=run,
            step=step,
            label=str(step),
            tasks=[],
            settings_hash="h",
            created_at=float(step),
            order_key=float(step),
        )

    jobs = [job("a", "mix", 100), job("base", BASELINE_RUN, 0), job("b", "mix", 200)]
    assert [j.id for j in order_jobs(jobs, "newest_first")] == ["base", "b", "a"]
    assert [j.id for j in order_jobs(jobs, "oldest_first")] == ["base", "a", "b"]


@pytest.mark.e2e
def test_a_suite_on_a_local_run_beside_an_s3_baseline_evaluated_once(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint, s3_endpoint: str, bucket: str
) -> None:
    """The deployment: training writes to a local folder, the base model sits in S3; a user's
    suite (the demo task and a pass@k math set on a fixture file) runs on both, the baseline
    once, and `results --suite` shows each step beside it with a Δ."""
    from ckpt_watcher.demo.tiny import build_model, build_tokenizer, save_checkpoint

    from .test_math_tasks import OLYMPIAD_DOCS, _fixture_task

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "addition.yaml").write_text((addition_tasks / "addition.yaml").read_text())
    _fixture_task(tasks, "passk_olympiadbench", "olympiad_fixture", OLYMPIAD_DOCS)
    suite = tmp_path / "daily.yaml"
    headline_math = ["math_verify,final-answer", "math_verify_pass@2,final-answer"]
    suite.write_text(
        yaml.safe_dump(
            {
                "name": "daily",
                "tasks": [
                    {"task": "addition", "num_fewshot": 0, "headline": ["exact_match,none"]},
                    {
                        "task": "olympiad_fixture",
                        "num_fewshot": 0,
                        "samples": 2,
                        "gen_kwargs": {"temperature": 0.6, "top_p": 0.95},
                        "headline": headline_math,
                    },
                ],
            }
        )
    )
    tok = build_tokenizer()  # the base model: untrained
    save_checkpoint(build_model(len(tok), seed=0), tok, tmp_path / "base")
    upload_dir(make_client(s3_endpoint), tmp_path / "base", bucket, "models/base/")
    copy_checkpoint(tmp_path / "ckpts" / "s_step300")
    data = base_config(tmp_path, tmp_path / "ckpts", tasks, suite_path=str(suite))
    data["eval"]["tasks"] = [{"suite": "daily"}]
    data["baseline"] = {
        "name": "untrained",
        "checkpoint": f"s3://{bucket}/models/base/",
        "endpoint_url": s3_endpoint,
    }
    cfg = write_config(tmp_path / "w.yaml", data)
    lines = {ln["task"]: ln for ln in watcher_once(cfg, tmp_path / "ledgers", "s")}
    assert {ln["status"] for ln in lines.values()} == {"ok"}
    base = {ln["task"]: ln for ln in read_ledger(tmp_path / "ledgers", BASELINE_RUN)}
    assert {ln["status"] for ln in base.values()} == {"ok"} and len(base) == 2
    assert base["addition"]["checkpoint"] == f"s3://{bucket}/models/base/"
    assert (base["addition"]["run"], base["addition"]["step"]) == (BASELINE_RUN, 0)
    math = lines["olympiad_fixture"]
    assert math["samples"] == 2 and "math_verify_pass@2,final-answer" in math["metrics"]
    with gzip.open(tmp_path / "ledgers" / "s" / math["samples_file"], "rt") as f:
        recs = [json.loads(x) for x in f]
    assert [r["target"] for r in recs] == ["\\frac{1}{2}", "-1, 1"]
    assert all(len(r["responses"]) == 2 and len(r["extracted"]["final-answer"]) == 2 for r in recs)

    out = CliRunner().invoke(
        main, ["results", "-c", str(cfg), "s", "--suite", "daily", "--format", "csv"]
    )
    assert out.exit_code == 0, out.output
    rows = list(csv.reader(io.StringIO(out.output)))
    assert rows[0] == [
        "step",
        "addition (0-shot) exact_match,none",
        "Δ addition (0-shot) exact_match,none",
        *[
            c
            for h in headline_math
            for c in (f"olympiad_fixture (0-shot) {h}", f"Δ olympiad_fixture (0-shot) {h}")
        ],
    ]
    first = dict(zip(rows[0], rows[1], strict=True))
    got = dict(zip(rows[0], rows[2], strict=True))
    assert first["step"] == "untrained" and got["step"] == "300"
    add, add0 = (ln["addition"]["metrics"]["exact_match,none"] for ln in (lines, base))
    assert float(first["addition (0-shot) exact_match,none"]) == pytest.approx(add0)
    assert float(got["addition (0-shot) exact_match,none"]) == pytest.approx(add)
    assert add > add0  # the trained checkpoint learned something the base model cannot
    # both kept per-document records: the paired test over the 100 sums marks the Δ
    assert got["Δ addition (0-shot) exact_match,none"] == f"{add - add0:+.4f}*"
    pass2 = "olympiad_fixture (0-shot) math_verify_pass@2,final-answer"
    assert float(got[pass2]) == pytest.approx(math["metrics"]["math_verify_pass@2,final-answer"])

    code, status = status_json(cfg)  # the baseline is a source of its own in status
    assert status is not None and code == 3
    names = [src["name"] for src in status["sources"]]
    assert names == [f"local:{tmp_path / 'ckpts'}", f"baseline:s3://{bucket}/models/base/"]
    # a second pass finds nothing to do: the baseline was evaluated once
    watcher_once(cfg, tmp_path / "ledgers", "s")
    assert len(read_ledger(tmp_path / "ledgers", BASELINE_RUN)) == 2
