"""Multi-node execution through a real local Ray cluster that declares 2 (fake) GPUs: the daemon
stays the only scheduler and ledger writer; Ray places one task per job."""

from __future__ import annotations

import importlib.util
import os
import signal
import sqlite3
import subprocess
import tempfile
from contextlib import closing
from pathlib import Path

import pytest

from ckpt_watcher import scratch

from .conftest import CHUNK, HF, RESPONSES, base_config, read_ledger, write_config
from .helpers import Throttle, status_json, wait_for, watcher_run

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed"),
]


def ray_task_worker(job_prefix: str) -> tuple[int, int] | None:
    """(our worker, the node agent that started it) for the job whose id starts with
    `job_prefix` (its folder in the agent's is named after the job), and no other process."""
    r = subprocess.run(
        ["pgrep", "-f", f"ckpt-watcher-task-[0-9]+-agent-[^/]+/jobs/{job_prefix}"],
        capture_output=True,
        text=True,
    )
    for pid in r.stdout.split():
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if Path(f"/proc/{parent}/cmdline").read_bytes().startswith(b"ray::"):
                return int(pid), parent
        except OSError:
            continue
    return None


def test_two_checkpoints_run_concurrently_on_two_ray_gpus_and_a_killed_worker_is_retried(
    tmp_path: Path, ray_cluster: str, addition_tasks: Path, copy_checkpoint
) -> None:
    watch = tmp_path / "ckpts"
    for step in (1, 2):
        copy_checkpoint(watch / f"ray_step{step}")
    raw = base_config(tmp_path, watch, addition_tasks)
    raw["executor"] = {"kind": "ray", "address": ray_cluster}
    raw["devices"] = {"gpus": [], "cpu_slots": 0}
    cfg = write_config(tmp_path / "w.yaml", raw)
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        lines = wait_for(
            lambda: (
                len(read_ledger(tmp_path / "ledgers", "ray")) >= 2
                and read_ledger(tmp_path / "ledgers", "ray")
            ),
            300,
            "2 results",
            daemon,
            log,
        )
        # a third checkpoint: kill the Ray worker process that runs its eval
        copy_checkpoint(watch / "ray_step3")

        _, victim = wait_for(
            lambda: ray_task_worker("ray-3-"), 120, "the third eval to start", daemon, log
        )
        st = wait_for(
            lambda: (s := status_json(cfg)[1]) and s["running"] and s["running"][0]["node"] and s,
            30,
            "status to name the node",
            daemon,
            log,
        )
        # one node with no NVML: the GPUs Ray counts there, named on the node
        running = st["running"][0]
        assert running["label"] == "ray_step3" and running["device"] in (
            f"{running['node']}/gpu0",
            f"{running['node']}/gpu1",
        ), running
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: len(read_ledger(tmp_path / "ledgers", "ray")) >= 3,
            300,
            "the retried result",
            daemon,
            log,
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    lines = read_ledger(tmp_path / "ledgers", "ray")
    assert sorted((ln["step"], ln["status"]) for ln in lines) == [(1, "ok"), (2, "ok"), (3, "ok")]
    one, two = sorted((ln for ln in lines if ln["step"] in (1, 2)), key=lambda ln: ln["step"])
    assert {one["device"].split("/")[1], two["device"].split("/")[1]} == {"gpu0", "gpu1"}
    # both jobs held a Ray GPU at once: the daemon dispatched the second before the first came
    # back. (The ledger's started_at is when lm-eval began inside the worker; a Ray worker's cold
    # start varies by seconds on 2 cores, longer than the tiny eval itself, so it cannot show this.)
    with closing(sqlite3.connect(tmp_path / "state" / "state.sqlite")) as db:
        held = dict(
            (label, (started, finished))
            for label, started, finished in db.execute(
                "SELECT label, started_at, finished_at FROM jobs WHERE state = 'ok'"
            )
        )
    (s1, f1), (s2, f2) = held["ray_step1"], held["ray_step2"]
    assert s1 < f2 and s2 < f1, held
    third = next(ln for ln in lines if ln["step"] == 3)
    assert third["attempt"] == 2
    # the killed agent's folder on the node was swept by the agent that replaced it
    assert not list(Path(tempfile.gettempdir()).glob(f"{scratch.TASK_PREFIX}{victim}-*"))


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
    raw["devices"] = {"gpus": [], "cpu_slots": 0}
    cfg = write_config(tmp_path / "w.yaml", raw)
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        worker, task = wait_for(lambda: ray_task_worker("r-300-"), 300, "the task", daemon, log)
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
