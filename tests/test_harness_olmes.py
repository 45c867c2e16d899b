"""`harness: olmes` against a stand-in OLMES in a virtualenv of its own (OLMES itself cannot be
installed in CI; docs/benchmarks.md records the real one run from its source).

The stand-in (`standins/olmes_run_eval.py`) keeps OLMES's CLI, its files and its hazard: its
"vLLM" sets CUDA_VISIBLE_DEVICES="0" when one GPU is visible, and its engine process reports
what it sees. Like the real `olmes`, its `olmes` script runs `python -m oe_eval.run_eval` with
whatever `python` leads PATH.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import venv
import zlib
from pathlib import Path

import pytest

from .conftest import WATCHER, read_ledger, write_config, write_fake_checkpoint

OLMES_SCRIPT = """#!/bin/sh
# as OLMES's own: the first python on PATH runs oe_eval
exec python -m oe_eval.run_eval "$@"
"""


@pytest.fixture(scope="module")
def olmes_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("olmes") / "venv"
    venv.create(root, with_pip=False, symlinks=True)
    (site,) = root.glob("lib/python*/site-packages")
    (site / "oe_eval").mkdir()
    (site / "oe_eval" / "__init__.py").write_text("")
    shutil.copy(
        Path(__file__).parent / "standins" / "olmes_run_eval.py", site / "oe_eval" / "run_eval.py"
    )
    meta = site / "ai2_olmes-0.1.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: ai2-olmes\nVersion: 0.1.0\n")
    script = root / "bin" / "olmes"
    script.write_text(OLMES_SCRIPT)
    script.chmod(0o755)
    return root


def nvml_file(tmp: Path) -> Path:
    path = tmp / "nvml.json"
    path.write_text(json.dumps({"gpus": [{"index": 6, "uuid": "GPU-6-aaaa", "foreign": []}]}))
    return path


def config(tmp: Path, watch: Path, olmes: Path, **entry_over: object) -> Path:
    entry = {
        "harness": "olmes",
        "name": "tulu_dev",
        "venv": str(olmes),
        "task": ["tiny_suite"],
        "model_type": "vllm",
        "model_args": {"max_length": 64},
        "limit": 4,
    } | entry_over
    return write_config(
        tmp / "w.yaml",
        {
            "state_dir": str(tmp / "state"),
            "ledger_dir": str(tmp / "ledgers"),
            "settle_seconds": 0,
            "sources": [{"kind": "local", "path": str(watch), "poll_seconds": 1}],
            "devices": {"gpus": "all", "cpu_slots": 0},
            "eval": {"tasks": [entry], "max_attempts": 1},
        },
    )


def expected(ckpt: Path, task: str, n: int) -> float:
    seed = zlib.crc32((ckpt / "config.json").read_bytes())
    return sum((seed + zlib.crc32(f"{task}:{d}".encode())) % 3 != 0 for d in range(n)) / n


def test_a_suite_is_one_line_per_olmes_task_on_exactly_the_chosen_gpu(
    tmp_path: Path, olmes_venv: Path
) -> None:
    watch = tmp_path / "ckpts"
    a = write_fake_checkpoint(watch / "run1" / "step_100")
    b = write_fake_checkpoint(watch / "run1" / "step_200")
    # saved by transformers 5: a tokenizer class OLMES's transformers 4 does not have
    (b / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    cfg = config(tmp_path, watch, olmes_venv)
    env = dict(__import__("os").environ, CKPT_WATCHER_FAKE_NVML=str(nvml_file(tmp_path)))
    r = subprocess.run(
        [*WATCHER, "once", "-c", str(cfg)], capture_output=True, text=True, timeout=300, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = read_ledger(tmp_path / "ledgers", "run1")
    assert sorted((ln["step"], ln["task"]) for ln in lines) == [
        (100, "tulu_dev/digits::tiny"),
        (100, "tulu_dev/sums::tiny"),
        (200, "tulu_dev/digits::tiny"),
        (200, "tulu_dev/sums::tiny"),
    ]
    run_dir = tmp_path / "ledgers" / "run1"
    for ln in lines:
        ckpt = {100: a, 200: b}[ln["step"]]
        task = ln["task"].split("/", 1)[1]
        assert (
            ln["status"] == "ok" and ln["harness"] == "olmes" and ln["harness_version"] == "0.1.0"
        )
        assert ln["metrics"]["primary_score"] == expected(ckpt, task, 4)  # its own checkpoint's
        assert ln["n_samples"] == 4 and ln["device"] == "cuda:6"
        seen = json.loads(
            next((run_dir / Path(ln["results_file"]).parent).glob("engine-seen.json")).read_text()
        )
        assert seen["CUDA_VISIBLE_DEVICES"] == "GPU-6-aaaa"  # not "0": physical GPU 0 is training's
    # per-instance records for `watcher samples`
    s = subprocess.run(
        [
            *WATCHER,
            "samples",
            "run1",
            "-c",
            str(cfg),
            "--task",
            "tulu_dev/sums::tiny",
            "--step",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert s.returncode == 0, s.stderr
    assert "sums::tiny-0" in s.stdout
    # done means done: a second pass runs nothing
    again = subprocess.run(
        [*WATCHER, "once", "-c", str(cfg)], capture_output=True, text=True, timeout=300, env=env
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(read_ledger(tmp_path / "ledgers", "run1")) == 4
    # requeue reads OLMES's version as the daemon does: the results are of it, nothing is due
    rq = subprocess.run(
        [*WATCHER, "requeue", "run1", "-c", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert rq.stdout.count("every task already ok with the current settings") == 2, (
        rq.stdout + rq.stderr
    )


def test_a_misspelt_olmes_task_stops_the_start_with_exit_2(
    tmp_path: Path, olmes_venv: Path
) -> None:
    watch = tmp_path / "ckpts"
    write_fake_checkpoint(watch / "run1" / "step_100")
    cfg = config(tmp_path, watch, olmes_venv, task=["tiny_suit"])
    r = subprocess.run(
        [*WATCHER, "once", "-c", str(cfg)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    assert "entry 'tulu_dev' (olmes): olmes --dry-run of ['tiny_suit'] failed" in r.stderr
    assert "No config found for task: tiny_suit" in r.stderr
    assert not (tmp_path / "state" / "jobs").exists()
    doctor = subprocess.run(
        [*WATCHER, "doctor", "-c", str(cfg)], capture_output=True, text=True, timeout=120
    )
    assert doctor.returncode == 1
    assert (
        "FAIL  harness tulu_dev (olmes): olmes --dry-run of ['tiny_suit'] failed" in doctor.stdout
    )
    fixed = config(tmp_path, watch, olmes_venv)
    doctor = subprocess.run(
        [*WATCHER, "doctor", "-c", str(fixed)], capture_output=True, text=True, timeout=120
    )
    assert "ok    harness tulu_dev (olmes): olmes 0.1.0 in " in doctor.stdout, doctor.stdout


def test_one_olmes_task_is_one_line_under_the_entrys_name(tmp_path: Path, olmes_venv: Path) -> None:
    watch = tmp_path / "ckpts"
    a = write_fake_checkpoint(watch / "run1" / "step_100")
    cfg = config(tmp_path, watch, olmes_venv, task="sums::tiny", model_type="hf")
    env = dict(__import__("os").environ, CKPT_WATCHER_FAKE_NVML=str(nvml_file(tmp_path)))
    r = subprocess.run(
        [*WATCHER, "once", "-c", str(cfg)], capture_output=True, text=True, timeout=300, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (ln,) = read_ledger(tmp_path / "ledgers", "run1")
    assert ln["task"] == "tulu_dev" and ln["metrics"]["primary_score"] == expected(
        a, "sums::tiny", 4
    )


def test_the_pin_keeps_the_jobs_gpu_through_writes_deletes_and_a_cleared_environment() -> None:
    """accelerate clears the environment and restores it (os.environ.clear pops until empty):
    that must end, and leave the job's device."""
    import os
    import sys

    from ckpt_watcher.harnesses.olmes import PIN_DIR, PIN_VAR

    code = (
        "import os, subprocess, sys\n"
        "saved = os.environ.copy(); os.environ.clear(); cleared = dict(os.environ); os.environ.update(saved)\n"
        "os.environ['CUDA_VISIBLE_DEVICES'] = '0'\n"
        "del os.environ['CUDA_VISIBLE_DEVICES']\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"CUDA_VISIBLE_DEVICES\"])'], capture_output=True, text=True).stdout.strip()\n"
        "print(cleared, os.environ['CUDA_VISIBLE_DEVICES'], child)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(PIN_DIR), CUDA_VISIBLE_DEVICES="GPU-6-aaaa")
    env[PIN_VAR] = "GPU-6-aaaa"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [
        "{'CUDA_VISIBLE_DEVICES':",
        "'GPU-6-aaaa'}",
        "GPU-6-aaaa",
        "GPU-6-aaaa",
    ]
    assert (
        "kept CUDA_VISIBLE_DEVICES='GPU-6-aaaa' (the job's device) where '0' was asked" in r.stderr
    )
