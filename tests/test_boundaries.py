"""Process boundaries: the daemon never imports the heavy ML stack; code execution is opt-in
per task; a failing task ends as a `failed` ledger line and `watcher once` exits 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_watcher.evaluators.harness import _code_execution

from .conftest import WATCHER, base_config, read_ledger, write_config


def test_daemon_side_never_imports_torch_vllm_or_lm_eval() -> None:
    code = (
        "import sys, ckpt_watcher.cli, ckpt_watcher.daemon, ckpt_watcher.status, ckpt_watcher.demo.runner;"
        "bad = [m for m in ('torch', 'vllm', 'lm_eval', 'transformers') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_model_code_runs_only_for_an_allowed_entry_in_the_sandbox_and_hf_code_eval_never(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`evaluate.load("code_eval")` is the sandbox's judge in a worker: it runs programs only
    while an entry with `allow_code_execution: true` is evaluated; Hugging Face's own metric is
    never enabled, whatever the user's shell says."""
    import evaluate

    from ckpt_watcher.evaluators import code_eval
    from ckpt_watcher.jobfolder import TaskRun

    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")  # set by the user's shell: not for our tasks
    allowed = TaskRun("t", 0, allow_code_execution=True, sandbox={"cpu_seconds": 2})
    with _code_execution(allowed):
        assert "HF_ALLOW_CODE_EVAL" not in os.environ
        metric = evaluate.load("code_eval")
        assert metric is code_eval.JUDGE and metric.allowed
        passed, results = metric.compute(
            references=["assert add(2, 3) == 5"] * 2,
            predictions=[["def add(a, b): return a + b"], ["def add(a, b): return a * b"]],
            k=[1],
        )
        assert passed == {"pass@1": 0.5}
        assert results[1][0][1]["result"] == "failed: AssertionError"
    assert not code_eval.JUDGE.allowed and not code_eval.JUDGE.verdicts
    with _code_execution(TaskRun("t", 0)):
        with pytest.raises(ValueError, match="set allow_code_execution: true"):
            evaluate.load("code_eval").compute(references=["assert 1"], predictions=[["x"]])


@pytest.mark.e2e
def test_a_task_failing_at_run_time_keeps_the_others_then_requeue_runs_only_it(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    watch = tmp_path / "ckpts"
    copy_checkpoint(watch / "f_step1")
    good = (addition_tasks / "addition.yaml").read_text()
    # known to lm-eval (so the start-up check passes), but its target names a field the data
    # does not have: it fails only when it runs
    broken = tmp_path / "broken_tasks"
    broken.mkdir()
    (broken / "addition.yaml").write_text(good)
    (broken / "broken.yaml").write_text(
        good.replace("task: addition", "task: broken").replace("{{answer}}", "{{nope}}")
    )
    tasks = [{"task": "addition", "num_fewshot": 0}, {"task": "broken", "num_fewshot": 0}]
    cfg = write_config(
        tmp_path / "w.yaml",
        base_config(tmp_path, watch, broken, tasks=tasks, max_attempts=1),
    )
    r = subprocess.run(
        [*WATCHER, "--log-json", "once", "-c", str(cfg)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1
    lines = {ln["task"]: ln for ln in read_ledger(tmp_path / "ledgers", "f")}
    assert lines["addition"]["status"] == "ok"  # the good task keeps its result
    bad = lines["broken"]
    assert bad["status"] == "failed" and bad["metrics"] == {}
    assert "UndefinedError: 'nope' is undefined (fix the task's YAML" in bad["error"]
    assert bad["error"].endswith("(not retried: it would fail the same way)")
    # the one-line error is the ledger's; the whole traceback is in the job's worker.log
    (log,) = (tmp_path / "state" / "jobs").glob("*/attempt-1/worker.log")
    assert "task.failed" in log.read_text() and "Traceback (most recent call" in log.read_text()
    st = subprocess.run([*WATCHER, "status", "-c", str(cfg)], capture_output=True, text=True)
    assert st.returncode == 3 and "failures: 1" in st.stdout

    # the user fixes the task, then asks for another try: only the failed task runs
    (broken / "broken.yaml").write_text(good.replace("task: addition", "task: broken"))
    rq = subprocess.run([*WATCHER, "requeue", "-c", str(cfg), "f"], capture_output=True, text=True)
    assert rq.returncode == 0 and "requeued f_step1: broken (0-shot)" in rq.stdout
    assert "addition (0-shot)" not in rq.stdout
    r = subprocess.run(
        [*WATCHER, "once", "-c", str(cfg)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    final = [(ln["task"], ln["status"]) for ln in read_ledger(tmp_path / "ledgers", "f")]
    assert sorted(final) == [("addition", "ok"), ("broken", "failed"), ("broken", "ok")]
    st = subprocess.run([*WATCHER, "status", "-c", str(cfg)], capture_output=True, text=True)
    assert "failures: 0" in st.stdout  # the later ok covers it
    js = subprocess.run(
        [*WATCHER, "status", "-c", str(cfg), "--json"], capture_output=True, text=True
    )
    history = json.loads(js.stdout)["failure_history"]
    assert [(f["label"], f["resolved"]) for f in history] == [("f_step1", True)]
    again = subprocess.run(
        [*WATCHER, "requeue", "-c", str(cfg), "f"], capture_output=True, text=True
    )
    assert again.returncode == 0 and "every task already ok" in again.stdout
    assert "nothing to requeue for run 'f'" in again.stdout
    unknown = subprocess.run(
        [*WATCHER, "requeue", "-c", str(cfg), "nope"], capture_output=True, text=True
    )
    assert unknown.returncode == 1
    assert "no run 'nope' in the state or the ledgers; runs: f" in unknown.stderr


def nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return True
    except Exception:
        return False


@pytest.mark.e2e
@pytest.mark.skipif(nvml_works(), reason="this machine has a working NVIDIA driver")
def test_without_nvml_gpus_are_skipped_with_a_message_and_cpu_slots_still_work(
    tmp_path: Path,
) -> None:
    from ckpt_watcher.config import DevicesConfig
    from ckpt_watcher.devices import build_inventory

    inv, warnings = build_inventory(DevicesConfig(gpus="all", cpu_slots=2))
    assert [d.label for d in inv.devices()] == ["cpu:0", "cpu:1"]
    assert len(warnings) == 1 and "NVML unavailable" in warnings[0] and "cpu_slots" in warnings[0]

    cfg = write_config(
        tmp_path / "w.yaml",
        {
            "state_dir": str(tmp_path / "s"),
            "sources": [{"kind": "local", "path": str(tmp_path)}],
            "eval": {"tasks": [{"task": "gsm8k"}]},
        },
    )
    r = subprocess.run([*WATCHER, "once", "-c", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "config field devices: no device to run evals on" in r.stderr
