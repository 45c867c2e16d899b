"""A result belongs to the checkpoint it was computed on, end to end with real evals: an upgrade
from main re-runs nothing, a rewrite in place is a new version, run names reused by two training
jobs keep both results, and an EFS folder with its S3 copy is evaluated once."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckpt_watcher.cli import main
from ckpt_watcher.config import load_config
from ckpt_watcher.s3client import make_client

from .conftest import (
    REPO,
    WATCHER,
    base_config,
    read_ledger,
    s3_source,
    upload_dir,
    write_config,
)
from .helpers import status_json

pytestmark = pytest.mark.e2e

OLD_MAIN = REPO / "tests" / "data" / "main-853a66a"


def once(cfg: Path) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [*WATCHER, "--log-json", "once", "-c", str(cfg)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def jobs_run(tmp_path: Path) -> int:
    with sqlite3.connect(tmp_path / "state" / "state.sqlite") as db:
        return int(db.execute("SELECT COUNT(*) FROM jobs WHERE state = 'ok'").fetchone()[0])


def checkpoint_row(cfg: Path, label: str) -> dict[str, Any]:
    """The checkpoint's row in the state, with `rewritten` as `watcher status --json` says it
    (status lists a done checkpoint only once it was rewritten)."""
    state = load_config(cfg).state_dir / "state.sqlite"
    with sqlite3.connect(state) as db:
        db.row_factory = sqlite3.Row
        row = dict(db.execute("SELECT * FROM checkpoints WHERE label = ?", (label,)).fetchone())
    _, st = status_json(cfg)
    assert st is not None
    listed = [c for c in st["checkpoints"] if c["label"] == label]
    row["rewritten"] = bool(listed and listed[0]["rewritten"])
    return row


def results(cfg: Path, run: str, *extra: str) -> list[dict[str, Any]]:
    out = CliRunner().invoke(main, ["results", "-c", str(cfg), run, "--format", "json", *extra])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_an_upgrade_from_main_runs_nothing_again_and_a_later_rewrite_is_a_new_version(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    # what a user of main has: a ledger and a state database, and the checkpoint they name
    shutil.copytree(OLD_MAIN / "ledgers", tmp_path / "ledgers")
    for f in (tmp_path / "ledgers").rglob("*.json*"):
        f.write_text(f.read_text().replace("@ROOT@", str(tmp_path)))
    (tmp_path / "state").mkdir()
    dump = (OLD_MAIN / "state.sql").read_text().replace("@ROOT@", str(tmp_path))
    with sqlite3.connect(tmp_path / "state" / "state.sqlite") as db:
        db.executescript(dump)
    ckpt = copy_checkpoint(tmp_path / "ckpts" / "jobA" / "old_step300")
    cfg = write_config(
        tmp_path / "w.yaml", base_config(tmp_path, tmp_path / "ckpts", addition_tasks)
    )
    assert load_config(cfg).eval.settings_hash() == "72be147fa16e"  # main's settings, unchanged
    old_ledger = tmp_path / "ledgers" / "old" / "ledger.jsonl"
    written_by_main = old_ledger.read_bytes()

    once(cfg)  # upgraded, with main's state
    assert old_ledger.read_bytes() == written_by_main and jobs_run(tmp_path) == 1
    row = checkpoint_row(cfg, "old_step300")
    assert row["run_path"] == "jobA/old" and row["fingerprint"].startswith("sampled:")

    shutil.rmtree(tmp_path / "state")
    once(cfg)  # upgraded, state lost: the ledger alone says it is done
    assert old_ledger.read_bytes() == written_by_main and jobs_run(tmp_path) == 0
    first = checkpoint_row(cfg, "old_step300")["fingerprint"]
    assert first

    # the run resumes from an earlier step and saves old_step300 again, with other weights
    shutil.rmtree(ckpt)
    copy_checkpoint(tmp_path / "ckpts" / "jobA" / "elsewhere").rename(ckpt)
    once(cfg)
    assert old_ledger.read_bytes() == written_by_main and jobs_run(tmp_path) == 1
    row = checkpoint_row(cfg, "old_step300")
    assert row["rewritten"] and row["previous_fingerprint"] == first and row["state"] == "done"
    assert row["fingerprint"] != first
    (line,) = read_ledger(tmp_path / "ledgers", "jobA/old")
    assert line["status"] == "ok" and line["fingerprint"] == row["fingerprint"]
    assert line["run"] == "old" and line["run_path"] == "jobA/old"
    assert "rewritten" in status_text(cfg)
    # rewritten once more, with untrained weights: `results` shows the newest version per step
    shutil.rmtree(ckpt)
    untrained(copy_checkpoint(tmp_path / "spare" / "old_step300"), ckpt)
    once(cfg)
    versions = results(cfg, "jobA/old", "--all")
    assert [(v["step"], v["checkpoint"]) for v in versions] == [(300, str(ckpt))] * 2
    assert versions[0]["fingerprint"] == line["fingerprint"] != versions[1]["fingerprint"]
    metric = "addition (0-shot) exact_match,none"
    assert versions[1][metric] == 0.0 < versions[0][metric]  # zero weights answer nothing right
    # main's ledger still reads, under its own run path (`old`: an exact run path wins)
    (by_main,) = [json.loads(x) for x in written_by_main.splitlines()]
    assert results(cfg, "old")[0][metric] == by_main["metrics"][metric.split(" ", 2)[-1]]
    # a later pass finds nothing to do
    once(cfg)
    assert len(read_ledger(tmp_path / "ledgers", "jobA/old")) == 2


def status_text(cfg: Path) -> str:
    r = subprocess.run([*WATCHER, "status", "-c", str(cfg)], capture_output=True, text=True)
    return r.stdout


def untrained(src: Path, dest: Path) -> None:
    """`src` with every weight set to zero, saved at `dest`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    for f in dest.glob("*.safetensors"):
        if not f.is_symlink() and f.stat().st_nlink == 1:
            tensors = {k: v * 0 for k, v in load_file(f).items()}
            save_file(tensors, f, metadata={"format": "pt"})
    for link in dest.glob("model-*-of-*.safetensors"):
        link.unlink()  # the naming fix links it again to the new file


def test_two_training_jobs_reusing_a_run_name_keep_every_result(
    tmp_path: Path, s3_endpoint: str, bucket: str, addition_tasks: Path, copy_checkpoint
) -> None:
    watch = tmp_path / "efs"
    client = make_client(s3_endpoint)
    for job in ("jobA", "jobB"):  # resubmitted under a new job name: the same run name
        copy_checkpoint(watch / job / "mix_step100")
    # and an S3 prefix whose layout gives one of those run paths, with other content
    upload = copy_checkpoint(tmp_path / "up" / "jobA" / "mix_step100")
    upload_dir(client, upload, bucket, "sm/jobA/mix_step100/")
    raw = base_config(tmp_path, watch, addition_tasks)
    raw["sources"].append(s3_source(f"s3://{bucket}/sm/", tmp_path / "cache"))
    raw["devices"]["cpu_slots"] = 2
    cfg = write_config(tmp_path / "w.yaml", raw)
    r = once(cfg)
    assert "duplicate_skipped" not in r.stderr and jobs_run(tmp_path) == 3
    (b,) = read_ledger(tmp_path / "ledgers", "jobB/mix")
    assert b["checkpoint"] == str(watch / "jobB" / "mix_step100") and b["status"] == "ok"
    # a local folder and an S3 prefix map to the same run path: told apart by fingerprint
    lines = read_ledger(tmp_path / "ledgers", "jobA/mix")
    assert sorted(ln["checkpoint"] for ln in lines) == [
        str(watch / "jobA" / "mix_step100"),
        f"s3://{bucket}/sm/jobA/mix_step100/",
    ]
    assert all(ln["status"] == "ok" and ln["run"] == "mix" for ln in lines)
    assert len({ln["fingerprint"] for ln in lines} | {b["fingerprint"]}) == 3
    assert len(results(cfg, "jobA/mix", "--all")) == 2
    out = CliRunner().invoke(main, ["results", "-c", str(cfg), "mix"])
    assert out.exit_code == 2 and "jobA/mix, jobB/mix" in out.output


def test_an_efs_folder_and_its_s3_copy_are_evaluated_once(
    tmp_path: Path, s3_endpoint: str, bucket: str, addition_tasks: Path, trained_checkpoint: Path
) -> None:
    watch = tmp_path / "efs"
    shutil.copytree(trained_checkpoint, watch / "mix_step300")  # the trainer's folder
    upload_dir(make_client(s3_endpoint), trained_checkpoint, bucket, "sync/backup/mix_step300/")
    raw = base_config(tmp_path, watch, addition_tasks)
    raw["sources"].append(s3_source(f"s3://{bucket}/sync/", tmp_path / "cache"))
    cfg = write_config(tmp_path / "w.yaml", raw)
    r = once(cfg)
    assert jobs_run(tmp_path) == 1 and '"event": "eval.reused"' in r.stderr
    (efs,) = read_ledger(tmp_path / "ledgers", "mix")
    (s3,) = read_ledger(tmp_path / "ledgers", "backup/mix")
    evaluated, reused = (efs, s3) if "reused_from" in s3 else (s3, efs)
    assert "reused_from" not in evaluated and reused["reused_from"] == evaluated["checkpoint"]
    assert (
        reused["fingerprint"] == evaluated["fingerprint"]
        and reused["job_id"] == evaluated["job_id"]
    )
    assert reused["metrics"] == evaluated["metrics"] and evaluated["status"] == "ok"
    once(cfg)  # and never again
    assert jobs_run(tmp_path) == 1
    assert len(read_ledger(tmp_path / "ledgers", "mix")) == 1
    assert len(read_ledger(tmp_path / "ledgers", "backup/mix")) == 1
