"""The ledger: durable appends, torn lines tolerated, one ok line per result identity."""

from __future__ import annotations

import json
from pathlib import Path

from ckpt_watcher.ledger import LedgerIndex, Subject, append, iter_runs, ledger_path, read_lines


def line(step: int, task: str = "gsm8k", status: str = "ok", settings: str = "h1") -> dict:
    return {
        "schema": 1,
        "run": "r",
        "step": step,
        "label": f"r_step{step}",
        "task": task,
        "num_fewshot": 8,
        "status": status,
        "metrics": {"acc,none": 0.5},
        "settings_hash": settings,
    }


def test_append_then_read_back(tmp_path: Path) -> None:
    append(tmp_path, line(1))
    append(tmp_path, line(2))
    rep = read_lines(ledger_path(tmp_path, "r"))
    assert [x["step"] for x in rep.lines] == [1, 2] and rep.skipped == 0


def test_torn_last_line_is_skipped_and_next_append_starts_clean(tmp_path: Path) -> None:
    append(tmp_path, line(1))
    path = ledger_path(tmp_path, "r")
    with open(path, "ab") as f:
        f.write(json.dumps(line(2)).encode()[:30])  # a crash in the middle of an append
    rep = read_lines(path)
    assert [x["step"] for x in rep.lines] == [1] and rep.skipped == 1
    append(tmp_path, line(3))
    rep = read_lines(path)
    assert [x["step"] for x in rep.lines] == [1, 3] and rep.skipped == 1


def test_index_refuses_a_second_ok_line_for_the_same_identity(tmp_path: Path) -> None:
    idx = LedgerIndex(tmp_path).load()
    assert idx.append(line(1))
    assert idx.append(line(1, status="failed"))  # failures are history, always appended
    assert not idx.append(line(1))
    assert idx.append(line(1, settings="h2"))  # other settings: another result
    reloaded = LedgerIndex(tmp_path).load()
    subject = Subject("/c/r_step1", "r", "r", 1, "r_step1", None)
    assert reloaded.done(subject, {"task": "gsm8k", "num_fewshot": 8}, "h1")
    assert sum(1 for x in read_lines(ledger_path(tmp_path, "r")).lines if x["status"] == "ok") == 2


GSM = {"task": "gsm8k", "num_fewshot": 8}


def versioned(step: int, fp: str | None, where: str, run_path: str = "r", **extra) -> dict:
    out = line(step) | {"run_path": run_path, "fingerprint": fp, "checkpoint": where}
    return out | extra


def test_other_content_at_the_same_step_is_another_result_and_both_are_kept(tmp_path: Path) -> None:
    idx = LedgerIndex(tmp_path).load()
    assert idx.append(versioned(100, "sampled:old", "/c/r_step100"))
    assert idx.append(versioned(100, "sampled:new", "/c/r_step100"))  # rewritten in place
    assert not idx.append(versioned(100, "sampled:new", "/c/r_step100"))
    assert idx.append(versioned(100, "sampled:new", "/c/jobB/r_step100", run_path="jobB/r"))
    kept = [x["fingerprint"] for x in read_lines(ledger_path(tmp_path, "r")).lines]
    assert kept == ["sampled:old", "sampled:new"]
    assert list(iter_runs(tmp_path)) == ["jobB/r", "r"]


def test_plan_says_done_reuse_or_due(tmp_path: Path) -> None:
    idx = LedgerIndex(tmp_path).load()
    idx.append(versioned(100, "F", "/efs/r_step100", results_file="step_100/results.json"))
    efs = Subject("/efs/r_step100", "r", "r", 100, "r_step100", "F")
    assert idx.plan(efs, [GSM], "h1").due == [] and idx.plan(efs, [GSM], "h1").reuse == []
    # its S3 copy under another run path: the result is copied, not computed again
    s3 = Subject("s3://b/x/r_step100/", "r", "x/r", 100, "r_step100", "F")
    plan = idx.plan(s3, [GSM], "h1")
    assert plan.due == [] and len(plan.reuse) == 1
    copy = plan.reuse[0]
    assert copy["reused_from"] == "/efs/r_step100" and copy["run_path"] == "x/r"
    assert copy["checkpoint"] == "s3://b/x/r_step100/" and copy["metrics"] == {"acc,none": 0.5}
    assert copy["results_file"] == "../../r/step_100/results.json"
    # other settings, or other content: due
    assert idx.plan(s3, [GSM], "h2").due == [GSM]
    other = Subject("/efs/r_step100", "r", "r", 100, "r_step100", "G")
    assert idx.plan(other, [GSM], "h1").due == [GSM]


def test_lines_from_before_fingerprints_count_for_their_location_until_a_rewrite(
    tmp_path: Path,
) -> None:
    append(tmp_path, line(100) | {"checkpoint": "/efs/r_step100"})  # as main wrote them
    idx = LedgerIndex(tmp_path).load()
    same = Subject("/efs/r_step100", "r", "r", 100, "r_step100", "F", legacy_ok=True)
    assert idx.due(same, [GSM], "h1") == []
    elsewhere = Subject("/efs/other/r_step100", "r", "other/r", 100, "r_step100", "F", True)
    assert idx.due(elsewhere, [GSM], "h1") == [GSM]
    rewritten = Subject("/efs/r_step100", "r", "r", 100, "r_step100", "G", legacy_ok=False)
    assert idx.due(rewritten, [GSM], "h1") == [GSM]
