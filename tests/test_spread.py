"""One task spread over every idle device: with two CPU slots and one checkpoint's single sampled
task, the second slot joins the task (a helper), both pull chunks from the task's journal, and
the one ledger line names both devices, with metrics and per-document records equal to one
slot's run. A helper killed part way (and not replaced) gives its chunk back: the job's own
worker finishes the task, with the same numbers."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.devices import THREAD_VARS
from ckpt_watcher.jobfolder import JobFolder
from ckpt_watcher.state import State

from .conftest import HF, RESPONSES, base_config, read_ledger, write_config
from .helpers import (
    Throttle,
    running_jobs,
    status_json,
    wait_for,
    watcher_once,
    watcher_run,
)
from .test_resume import _records

pytestmark = pytest.mark.e2e


def _two_slots(tmp: Path, tasks_dir: Path, **over: Any) -> Path:
    data = base_config(tmp, tmp / "ckpts", tasks_dir, **HF | over)
    data["devices"] = {"gpus": [], "cpu_slots": 2}
    return write_config(tmp / "w.yaml", data)


def _done_marks(state: Path) -> list[dict[str, Any]]:
    marks = []
    for path in state.glob("journals/*/claims/*.done"):
        try:
            marks.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return marks


def _same_numbers(tmp: Path, line: dict[str, Any], ref: Path, reference: dict[str, Any]) -> None:
    assert line["status"] == "ok" and line["attempt"] == 1, line
    assert line["devices"] == ["cpu:0", "cpu:1"] and line["device"] == "cpu:0", line
    assert line["metrics"] == reference["metrics"]
    assert _records(tmp, line) == _records(ref, reference)
    assert not list((tmp / "state" / "journals").glob("*")), "journal kept after the ledger line"


def test_one_sampled_task_spread_over_two_slots_equals_one_slot_even_when_a_helper_dies(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint, hf_reference
) -> None:
    ref, reference = hf_reference

    # both slots evaluate the one task together, each with a warm engine (the helper's is the
    # warm worker of its device); no thread count set: each worker takes its slot's share of
    # the cores (on 2 cores one thread each, as the rest of the suite sets for every process)
    tmp = tmp_path / "spread"
    copy_checkpoint(tmp / "ckpts" / "r_step300", same_content=True)
    cfg = _two_slots(tmp, addition_tasks, warm_engine=True)
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    (line,) = watcher_once(cfg, tmp / "ledgers", "r", env=env)
    assert line["resumed"] == 0, line
    _same_numbers(tmp, line, ref, reference)
    assert (tmp / "state" / "jobs" / "_warm" / "cpu_1" / "worker.log").exists()
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    threads = [
        int(m[1])
        for log in (tmp / "state" / "jobs").glob("*/attempt-*/worker.log")
        for m in re.finditer(r"worker\.threads\s.*\btorch=(\d+)", log.read_text())
    ]
    assert threads == [share, share], threads  # the job's own worker, and its helper

    # one-shot workers; the helper is killed once it has journaled a chunk, and nobody replaces
    # it on its device
    tmp = tmp_path / "helper_dies"
    copy_checkpoint(tmp / "ckpts" / "r_step300", same_content=True)
    cfg = _two_slots(tmp, addition_tasks)
    log = tmp / "daemon.log"
    with watcher_run(cfg, log) as daemon:

        def helper_did_a_chunk() -> dict[str, Any] | None:
            if not any(m["device"] == "cpu:1" for m in _done_marks(tmp / "state")):
                return None
            db = State(tmp / "state", readonly=True)
            try:
                helpers = db.get_meta("helpers") or []
            finally:
                db.close()
            return helpers[0] if helpers else None

        helper = wait_for(
            helper_did_a_chunk, 300, "a helper's first chunk", daemon, log, every=0.05
        )
        # both workers slowed while the test looks (on a fast machine the rest of the task
        # takes about as long as one `watcher status`), then the helper dies. The helper can
        # journal a chunk before the job's own worker has loaded its model and said where the
        # task stands: the job's worker is slowed from that first report on.
        (job,) = running_jobs(tmp / "state")
        assert job.pid is not None
        folder = JobFolder.of(tmp / "state", job.id, job.attempt)
        slowed = [Throttle(helper["pid"])]
        try:
            wait_for(
                folder.progress, 300, "the job's first progress report", daemon, log, every=0.05
            )
            slowed.append(Throttle(job.pid))
            code, st = status_json(cfg)
        finally:
            for throttle in slowed:
                throttle.stop()
            os.killpg(helper["pid"], signal.SIGKILL)
            os.killpg(job.pid, signal.SIGCONT)
        assert code == 0 and st is not None
        (running,) = st["running"]
        assert running["device"] == "cpu:0" and running["helpers"] == ["cpu:1"], running
        assert running["progress"]["total"] == RESPONSES
        (line,) = wait_for(
            lambda: read_ledger(tmp / "ledgers", "r"), 300, "the job's result", daemon, log
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    _same_numbers(tmp, line, ref, reference)
    events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    helping = [e for e in events if e.get("event") == "eval.helping"]
    assert [e["device"] for e in helping] == ["cpu:1"], "a killed helper is not replaced"
