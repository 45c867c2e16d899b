"""Fail fast on what will not heal: task names resolve and data files exist before any device is
spent (checked with lm-eval's own TaskManager, in a subprocess, cached per task set)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt_watcher.config import parse_config
from ckpt_watcher.errors import WatcherError
from ckpt_watcher.preflight import task_problems

from .conftest import WATCHER, base_config, write_config

pytestmark = pytest.mark.e2e  # lm-eval indexes its task YAMLs: ~12 s here


def test_a_misspelt_task_stops_the_start_with_exit_2_and_the_closest_name(
    tmp_path: Path, addition_tasks: Path
) -> None:
    watch = tmp_path / "ckpts"
    watch.mkdir()
    raw = base_config(
        tmp_path, watch, addition_tasks, tasks=[{"task": "additon", "num_fewshot": 0}]
    )
    cfg = write_config(tmp_path / "w.yaml", raw)
    started = time.monotonic()
    r = subprocess.run(
        [*WATCHER, "once", "-c", str(cfg)], capture_output=True, text=True, timeout=300
    )
    took = time.monotonic() - started
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(
        "watcher: config field eval.tasks: unknown task 'additon' (did you mean 'addition'"
    )
    assert not (tmp_path / "state" / "jobs").exists()  # nothing was dispatched
    print(f"exit 2 after {took:.1f}s")  # about 15 s here, almost all of it lm-eval's task index
    doctor = subprocess.run(
        [*WATCHER, "doctor", "-c", str(cfg)], capture_output=True, text=True, timeout=300
    )
    assert doctor.returncode == 1
    assert "FAIL  tasks: unknown task 'additon' (did you mean 'addition'" in doctor.stdout


def test_a_missing_data_file_is_named_before_the_start(
    tmp_path: Path, addition_tasks: Path
) -> None:
    folder = tmp_path / "tasks"
    folder.mkdir()
    text = (addition_tasks / "addition.yaml").read_text()
    gone = tmp_path / "nowhere" / "test.jsonl"
    (folder / "lost.yaml").write_text(
        text.replace("task: addition", "task: lost").replace(
            str(addition_tasks / "addition_test.jsonl"), str(gone)
        )
    )
    raw = base_config(tmp_path, tmp_path, folder, tasks=[{"task": "lost", "num_fewshot": 0}])
    assert task_problems(parse_config(raw)) == [
        f"task 'lost' reads {gone}, which does not exist (fix dataset_kwargs.data_files in its YAML)"
    ]


def test_a_passed_check_is_cached_until_the_task_files_change(
    tmp_path: Path, addition_tasks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "addition.yaml").write_text((addition_tasks / "addition.yaml").read_text())
    cfg = parse_config(base_config(tmp_path, tmp_path, folder))
    assert task_problems(cfg) == []
    monkeypatch.setattr(sys, "executable", "/bin/false")  # no second lm-eval run possible
    assert task_problems(cfg) == []  # answered from the cache
    (folder / "addition.yaml").write_text((folder / "addition.yaml").read_text() + "\n# edited\n")
    with pytest.raises(WatcherError, match="cannot check the task names"):
        task_problems(cfg)  # the YAML changed: checked again (and here it cannot be)


def test_a_built_in_task_is_loaded_from_its_own_folder_found_in_an_index_kept_per_install(
    tmp_path: Path, addition_tasks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lm-eval's index of its built-in YAMLs is built once per installation into the host's
    cache (the run's shared compile cache, as one host's daemons share theirs): a job of gsm8k
    then indexes gsm8k's folder and the user's, not lm-eval's thousands of YAMLs, and gets the
    same task; a group still gets lm-eval's full index; a name in neither is unknown at once."""
    import lm_eval.tasks

    from ckpt_watcher.evaluators import lm_eval_internals as lmi
    from ckpt_watcher.evaluators import taskcheck

    from .conftest import COMPILE_CACHE

    paths = [str(addition_tasks)]
    index = lmi.builtin_tasks(COMPILE_CACHE)
    assert index["gsm8k"]["kind"] == "TASK" and index["minerva_math"]["kind"] == "GROUP"
    full = lmi.task_manager(["minerva_math"], paths, index_dir=COMPILE_CACHE)  # a group
    assert len(full.all_tasks) == len(index) + 2  # lm-eval's all, and the user's two
    narrow = lmi.task_manager(["gsm8k", "addition"], paths, index_dir=COMPILE_CACHE)
    assert {"gsm8k", "addition"} <= set(narrow.all_tasks) and len(narrow.all_tasks) < 50
    for name in ("gsm8k", "addition"):
        assert lmi.task_yaml_config(narrow, name) == lmi.task_yaml_config(full, name)

    built = []
    real = lm_eval.tasks.TaskManager

    def counted(*args: object, **kwargs: object) -> object:
        built.append(kwargs.get("include_defaults", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", counted)
    said = taskcheck.check(["gsm8k", "addition", "gsm8kk"], str(addition_tasks), str(COMPILE_CACHE))
    assert said == {"unknown": {"gsm8kk": ["gsm8k", "gsm8k_cot"]}, "missing_data": {}}, said
    assert built and True not in built, built  # the index file answered: no full index
