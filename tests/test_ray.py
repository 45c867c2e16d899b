"""A Ray task killed part way, on a real local Ray cluster whose one node declares 2 GPUs and
has no NVML: its node's agent is killed with it, a new one is placed, and the retry resumes from
the journal in the shared folder. (Two nodes with their own NVML: test_ray_nodes.py; S3 and a
split checkpoint under Ray: test_deployments.py.)"""

from __future__ import annotations

import importlib.util
import os
import signal
import tempfile
from pathlib import Path

import pytest

from ckpt_watcher import scratch

from .conftest import CHUNK, HF, RESPONSES, base_config, read_ledger, write_config
from .helpers import Throttle, wait_for, watcher_run, workers_logging_to

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed"),
]


def ray_task_worker(job_prefix: str) -> tuple[int, int] | None:
    """(our worker, the node agent that started it) for the job whose id starts with
    `job_prefix`: its folder is in the agent's, which is named after the agent's pid."""
    found = workers_logging_to(rf"ckpt-watcher-task-(\d+)-agent-[^/]+/jobs/{job_prefix}[^/]*/")
    if len(found) != 1:
        return None
    ((pid, m),) = found.items()
    return pid, int(m[1])


def journaled(root: Path) -> int:
    """Responses kept in the journals under `root` (each file's lines but its header)."""
    return sum(
        max(0, len(f.read_bytes().splitlines()) - 1) for f in root.glob("*/journals/*/*.jsonl")
    )


def test_a_ray_task_killed_part_way_resumes_from_its_journal_in_the_shared_folder(
    tmp_path: Path, ray_cluster: str, addition_tasks: Path, copy_checkpoint, hf_reference
) -> None:
    """A Ray task's journal lives in `executor.shared_dir` (EFS, in a deployment), where the
    retry reads it on whichever node Ray places it: the task killed part way resumes with only
    the chunk in flight redone, and scores as the uninterrupted run. Nothing of it is left in
    the state folder or the shared one once its line is in the ledger."""
    _, reference = hf_reference
    watch, shared = tmp_path / "ckpts", tmp_path / "efs"
    copy_checkpoint(watch / "r_step300", same_content=True)
    raw = base_config(tmp_path, watch, addition_tasks, **HF)
    raw["executor"] = {"kind": "ray", "address": ray_cluster, "shared_dir": str(shared)}
    raw["devices"] = {"gpus": "all", "cpu_slots": 0}  # no NVML here: the GPUs Ray counts
    cfg = write_config(tmp_path / "w.yaml", raw)
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        # (a worker forked from the node's starter has its imports done: it is caught at once)
        worker, task = wait_for(
            lambda: ray_task_worker("r-300-"), 300, "the task", daemon, log, every=0.02
        )
        throttle = Throttle(worker, group=False)  # its own process only: Ray's is its parent
        try:
            done = wait_for(
                lambda: (n := journaled(shared)) > CHUNK and n, 300, "part done", daemon, log
            )
        finally:
            throttle.stop()
        assert done < RESPONSES, done
        os.kill(task, signal.SIGKILL)  # the node's Ray worker, and so the task, lost
        os.kill(worker, signal.SIGKILL)
        (line,) = wait_for(
            lambda: read_ledger(tmp_path / "ledgers", "r"), 300, "the resumed result", daemon, log
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    assert line["status"] == "ok" and line["attempt"] == 2, line
    assert 0 < line["resumed"] < RESPONSES and line["resumed"] >= done - CHUNK, (line, done)
    assert line["metrics"] == reference["metrics"]
    assert not list((tmp_path / "state" / "journals").glob("*/*"))  # never there
    assert journaled(shared) == 0  # removed once the line is in the ledger
    # the killed agent's folder on the node was swept by the agent that replaced it
    assert not list(Path(tempfile.gettempdir()).glob(f"{scratch.TASK_PREFIX}{task}-*"))
