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
from .standins import olmes_run_eval as standin

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


def config(
    tmp: Path, watch: Path, olmes: Path, eval_over: dict | None = None, **entry_over: object
) -> Path:
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
            "eval": {"tasks": [entry], "max_attempts": 1} | (eval_over or {}),
        },
    )


def expected(ckpt: Path, spec: str, n: int) -> float:
    """The stand-in's score for task spec `spec` (its variant) on `ckpt`, over `n` instances."""
    seed = zlib.crc32((ckpt / "config.json").read_bytes())
    (config,) = standin.resolve([spec])
    variant = standin.variant_key(config)
    return sum((seed + zlib.crc32(f"{variant}:{d}".encode())) % 3 != 0 for d in range(n)) / n


@pytest.mark.e2e
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
    assert "sums-0" in s.stdout
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


VARIANTS = [
    "gsm8k::tulu",
    "gsm8k::olmes",
    json.dumps({"task_name": "gsm8k", "num_shots": 2}),
    json.dumps({"task_name": "gsm8k", "num_shots": 4}),
]


@pytest.mark.e2e
def test_variants_of_one_task_each_file_their_own_numbers_and_samples(
    tmp_path: Path, olmes_venv: Path
) -> None:
    """Four variants of one base task: OLMES names their files by index and base task
    (`task-002-gsm8k-...`), the last two share an alias too. Each line carries its own
    variant's numbers, samples and file, and the entry is done after one pass."""
    watch = tmp_path / "ckpts"
    a = write_fake_checkpoint(watch / "run1" / "step_100")
    # eval.limit as a fraction: half of each task's instances, in OLMES as in lm-eval
    cfg = config(tmp_path, watch, olmes_venv, {"limit": 0.5}, task=VARIANTS, limit=None)
    env = dict(__import__("os").environ, CKPT_WATCHER_FAKE_NVML=str(nvml_file(tmp_path)))
    r = subprocess.run(
        [*WATCHER, "once", "-c", str(cfg)], capture_output=True, text=True, timeout=300, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = {ln["task"]: ln for ln in read_ledger(tmp_path / "ledgers", "run1")}
    names = ["gsm8k::tulu", "gsm8k::olmes", "gsm8k@2", "gsm8k@3"]
    assert sorted(lines) == sorted(f"tulu_dev/{n}" for n in names)
    run_dir = tmp_path / "ledgers" / "run1"
    scores = set()
    for i, (name, spec) in enumerate(zip(names, VARIANTS, strict=True)):
        ln = lines[f"tulu_dev/{name}"]
        n = standin.DOCS // 2
        assert ln["status"] == "ok" and ln["n_samples"] == n, ln
        assert ln["metrics"]["primary_score"] == expected(a, spec, n), (name, ln["metrics"])
        assert Path(ln["results_file"]).name == f"task-{i:03d}-gsm8k-metrics.json"
        scores.add(ln["metrics"]["primary_score"])
        shown = subprocess.run(
            [*WATCHER, "samples", "run1", "-c", str(cfg), "--task", ln["task"], "--step", "100"]
            + ["--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert shown.returncode == 0, shown.stderr
        records = [json.loads(x) for x in shown.stdout.splitlines() if x.strip()]
        variant = standin.variant_key(standin.resolve([spec])[0])
        assert len(records) == n
        # the responses of this variant's own predictions file
        assert all(x.startswith(variant) for r in records for x in r["responses"]), records
        assert (run_dir / ln["results_file"]).exists()
    assert len(scores) > 1  # the variants' numbers differ: a mix-up would show
    again = subprocess.run(
        [*WATCHER, "once", "-c", str(cfg)], capture_output=True, text=True, timeout=300, env=env
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(read_ledger(tmp_path / "ledgers", "run1")) == 4  # the entry is done


@pytest.mark.parametrize(
    ("entry_limit", "eval_limit", "instances"),
    [(None, 1.0, 1), (None, 2.7, 2), (None, 0.25, 3), (1, None, 1), (3, 0.5, 3), (None, None, 10)],
)
def test_the_limit_reaches_olmes_as_lm_eval_reads_it(
    tmp_path: Path,
    olmes_venv: Path,
    entry_limit: int | None,
    eval_limit: float | None,
    instances: int,
) -> None:
    """What OLMES resolves (its own --dry-run) from the watcher's command line: a count stays
    a count (OLMES reads `--limit 1` as 1.0, the whole task), a fraction a fraction."""
    from ckpt_watcher.harnesses import interp
    from ckpt_watcher.harnesses.olmes import olmes_argv, olmes_environ

    spec = {"venv": str(olmes_venv), "task": ["sums::tiny"], "limit": entry_limit}
    argv = olmes_argv(spec, "ckpt", tmp_path, eval_limit) + ["--dry-run"]
    env = olmes_environ(spec, interp.environment(spec))
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    (task,) = json.loads(r.stdout)
    assert standin.limited(standin.DOCS, task.get("limit")) == instances, task


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
