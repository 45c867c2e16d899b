"""Failures that cannot heal get one attempt and a line that says what to change; the rest are
retried. The table (evaluators/failures.py), then the daemon acting on it end to end."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ckpt_watcher.evaluators.failures import classify

from .conftest import base_config, read_ledger, write_config
from .helpers import wait_for, watcher_run


def _jinja_undefined() -> BaseException:
    from jinja2 import StrictUndefined

    try:
        str(StrictUndefined(name="nope"))
    except Exception as e:
        return e
    raise AssertionError("StrictUndefined did not raise")


@pytest.mark.parametrize(
    "exc, heals, says",
    [
        # what lm-eval, datasets and transformers raise (messages copied from them)
        (
            KeyError("Spec 'additon' is not a registered task/group/tag name or valid YAML path"),
            False,
            "custom tasks need eval.include_path",
        ),
        (
            FileNotFoundError("Unable to find '/data/test.jsonl'"),
            False,
            "fix dataset_kwargs.data_files",
        ),
        (
            OSError("It looks like the config file at '/c/config.json' is not a valid JSON file."),
            False,
            "re-save them",
        ),
        (
            ValueError(
                "Unrecognized model in /c. Should have a `model_type` key in its config.json."
            ),
            False,
            "re-save them",
        ),
        (OSError("Can't load tokenizer for '/c'."), False, "re-save them"),
        (
            ValueError(
                "Attempted to run task: mbpp which is marked as unsafe. Set confirm_run_unsafe_code=True to run this task."
            ),
            False,
            "allow_code_execution: true",
        ),
        (_jinja_undefined(), False, "fix the task's YAML"),
        # worth another try
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True, ""),
        (OSError(5, "Input/output error"), True, ""),
        (ConnectionResetError("Connection reset by peer"), True, ""),
        (
            FileNotFoundError(2, "No such file or directory", "/efs/ckpt/model.safetensors"),
            True,
            "",
        ),
        (RuntimeError("probability tensor contains either inf or nan"), True, ""),
    ],
)
def test_the_classification_table(exc: BaseException, heals: bool, says: str) -> None:
    failure = classify(exc)
    assert failure.heals is heals, failure
    assert failure.error.startswith(f"{type(exc).__name__}: ")
    assert says in failure.error
    if not heals:
        assert failure.error.endswith("then `watcher requeue`)")


def test_a_truncated_weights_file_is_not_retried_and_says_what_to_check(tmp_path: Path) -> None:
    """What safetensors itself raises on a file cut short (behind a completion marker the
    watcher takes it as complete): three attempts would fail alike."""
    from safetensors import safe_open

    from .conftest import write_safetensors

    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"w": 1024}, truncate_by=100)
    with pytest.raises(Exception) as caught:
        with safe_open(str(path), "pt") as f:
            f.get_tensor("w")
    failure = classify(caught.value)
    assert failure.error.startswith("SafetensorError: ") and not failure.heals
    assert "truncated or corrupt: check that the trainer finished writing it" in failure.error


@pytest.mark.e2e
def test_a_vanished_data_file_and_an_unloadable_checkpoint_get_one_attempt_each(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    folder = tmp_path / "tasks"
    folder.mkdir()
    data = folder / "sums.jsonl"
    data.write_text((addition_tasks / "addition_test.jsonl").read_text())
    (folder / "sums.yaml").write_text(
        (addition_tasks / "addition.yaml")
        .read_text()
        .replace("task: addition", "task: sums")
        .replace(str(addition_tasks / "addition_test.jsonl"), str(data))
    )
    watch = tmp_path / "ckpts"
    watch.mkdir()
    raw = base_config(tmp_path, watch, folder, tasks=[{"task": "sums", "num_fewshot": 0}])
    raw["eval"]["max_attempts"] = 3
    cfg = write_config(tmp_path / "w.yaml", raw)
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        wait_for(
            lambda: '"event": "daemon.started"' in log.read_text(), 60, "the start", daemon, log
        )
        data.unlink()  # after the start-up check passed: only a job can notice now
        copy_checkpoint(watch / "gone_step1")
        copy_checkpoint(watch / "broken_step1", edit_config=lambda c: c.pop("model_type"))
        wait_for(
            lambda: (
                len(read_ledger(tmp_path / "ledgers", "gone"))
                + len(read_ledger(tmp_path / "ledgers", "broken"))
                >= 2
            ),
            300,
            "two failed lines",
            daemon,
            log,
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    (gone,) = read_ledger(tmp_path / "ledgers", "gone")
    assert gone["status"] == "failed" and gone["attempt"] == 1  # not retried
    assert gone["error"].startswith(f"sums: FileNotFoundError: Unable to find '{data}'")
    assert (
        "fix dataset_kwargs.data_files in the task's YAML; then `watcher requeue`" in gone["error"]
    )
    assert "not retried: it would fail the same way" in gone["error"]
    (broken_line,) = read_ledger(tmp_path / "ledgers", "broken")
    assert broken_line["status"] == "failed" and broken_line["attempt"] == 1
    assert "Unrecognized model" in broken_line["error"]
    assert "config.json or tokenizer files cannot be loaded" in broken_line["error"]
    assert '"event": "eval.retry"' not in log.read_text()


def test_a_wall_clock_stepped_forward_times_out_no_running_eval(tmp_path: Path) -> None:
    """Running time is monotonic from the moment the daemon sees a job running: NTP stepping
    the clock a day ahead (or a VM resumed) kills nothing; a real hour over the limit does."""
    from ckpt_watcher.state import Job

    from .helpers import simulated_daemon

    killed: list[str] = []
    daemon = simulated_daemon(tmp_path, eval={"timeout_seconds": 3600})
    daemon.executor.kill = killed.append  # type: ignore[method-assign]
    mono = [500.0]
    supervisor = daemon.supervisor
    supervisor.monotonic = lambda: mono[0]
    try:
        job = Job("j", "/c/j", "r", 1, "j", [{"task": "t1", "num_fewshot": None}], "h", 0, 1)
        daemon.state.add_job(job)
        daemon.state.update_job("j", state="running", attempt=1, started_at=1000.0)
        supervisor.check_timeouts(1600.0)  # first seen 10 minutes in
        mono[0] += 60
        supervisor.check_timeouts(1660.0 + 86400)  # a minute later, the clock a day ahead
        assert killed == [] and not supervisor.timed_out
        (deadline,) = supervisor.deadlines(1660.0 + 86400)
        assert deadline == pytest.approx(1660.0 + 86400 + 3600 - 660)
        mono[0] += 3600 - 660 + 1  # a second over the hour, really
        supervisor.check_timeouts(1660.0 + 86400 + 2941)
        assert killed == ["j"]
    finally:
        daemon.state.close()
