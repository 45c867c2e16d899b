"""Workers forked from the worker starter (executors/starter.py, worker/starter.py): the same
results as fresh processes, one starter's imports for all of a daemon's workers, warm workers
forked with the daemon's pipes, and no result lost when the starter dies under a running
worker."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections import Counter
from pathlib import Path

import pytest

from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.executors import build_executor
from ckpt_watcher.executors.processes import is_starter
from ckpt_watcher.jobfolder import WORKER_NAME
from ckpt_watcher.proctable import process_name
from ckpt_watcher.worker.starter import CUDA_ERROR_NOT_INITIALIZED, fork_hazard

from .conftest import HF, base_config, derived_checkpoints, read_ledger, write_config
from .helpers import (
    alive,
    gone,
    running_job,
    status_json,
    wait_for,
    watcher_once,
    watcher_run,
)

E2E = pytest.mark.e2e


class _Driver:
    """libcuda's cuDeviceGetCount, answering as a driver initialized or not would (no GPU
    here: the one fake this file needs)."""

    def __init__(self, rc: int) -> None:
        self.rc = rc

    def cuDeviceGetCount(self, count: object) -> int:  # noqa: N802 (the driver's name)
        return self.rc


def test_forking_is_refused_once_an_import_initialized_the_cuda_driver() -> None:
    maps = "7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n"
    assert fork_hazard("7f00-7f10 r-xp 0 08:01 1 /usr/lib/libc.so.6\n") is None
    assert fork_hazard(maps, _Driver(CUDA_ERROR_NOT_INITIALIZED)) is None  # loaded, not begun
    hazard = fork_hazard(maps, _Driver(0))
    assert hazard is not None and "CUDA driver was initialized" in hazard
    assert fork_hazard() is None  # this process (torch imported by other tests or not)


def test_preload_off_starts_every_worker_as_a_fresh_process(tmp_path: Path) -> None:
    raw = base_config(tmp_path, tmp_path, tmp_path)
    on, _ = build_executor(WatcherConfig.model_validate(raw), lambda job, rc: None)
    raw["executor"] = {"preload": False}
    off, _ = build_executor(WatcherConfig.model_validate(raw), lambda job, rc: None)
    assert getattr(on, "starter", None) is not None
    assert getattr(off, "starter", "missing") is None and off.ready_to_start()


def _starters(log: str) -> list[str]:
    """The `starter=` field of each worker.started line of a worker log."""
    return [
        line.split("starter=")[1].split()[0]
        for line in log.splitlines()
        if "worker.started" in line and "starter=" in line
    ]


def _starter_said(cfg: Path, state: str) -> dict | None:
    """`watcher status --json`'s worker_starter, once in `state`."""
    said = (status_json(cfg)[1] or {}).get("worker_starter")
    return said if said and said["state"] == state else None


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _worker_logs(state: Path) -> list[str]:
    return [p.read_text() for p in sorted((state / "jobs").glob("*/attempt-*/worker.log"))]


@E2E
def test_forked_workers_score_as_fresh_processes_all_from_one_starter(
    tmp_path: Path, addition_tasks: Path, trained_checkpoint: Path
) -> None:
    watch = tmp_path / "ckpts"
    watch.mkdir()
    derived_checkpoints(trained_checkpoint, watch, "f", (1, 2, 3))
    metrics = {}
    for preload in (True, False):
        out = tmp_path / f"preload-{preload}"
        raw = base_config(out, watch, addition_tasks)
        raw["executor"] = {"preload": preload}
        lines = watcher_once(write_config(tmp_path / f"{preload}.yaml", raw), out / "ledgers", "f")
        assert Counter((ln["step"], ln["status"]) for ln in lines) == {
            (s, "ok"): 1 for s in (1, 2, 3)
        }
        metrics[preload] = {ln["step"]: ln["metrics"] for ln in lines}
        starters = [s for log in _worker_logs(out / "state") for s in _starters(log)]
        assert len(starters) == 3
        if preload:
            # one starter forked all three: the daemon waited for its imports, once
            assert len(set(starters)) == 1 and starters[0] != "None"
            log = (out / "state" / "worker-starter.log").read_text()
            assert log.count("ready in") == 1 and "lm_eval.models.huggingface" in log
        else:
            assert set(starters) == {"None"}
            assert not (out / "state" / "worker-starter.log").exists()
    assert metrics[True] == metrics[False]  # byte for byte the same numbers
    assert len({str(m) for m in metrics[True].values()}) > 1  # three checkpoints, not one


@E2E
def test_a_starter_killed_under_a_running_worker_loses_nothing(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    watch = tmp_path / "ckpts"
    copy_checkpoint(watch / "k_step1")
    cfg = write_config(tmp_path / "w.yaml", base_config(tmp_path, watch, addition_tasks, **HF))
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        job = wait_for(lambda: running_job(tmp_path / "state"), 90, "an eval to start", daemon, log)
        os.killpg(job.pid, signal.SIGSTOP)  # it stays mid-eval while its starter goes
        said = wait_for(lambda: _starter_said(cfg, "ready"), 30, "status: ready", daemon, log)
        assert said["pid"] != job.pid
        starter = _parent(job.pid)
        assert b"--starter" in Path(f"/proc/{starter}/cmdline").read_bytes()
        # both show the starter's command line; their names tell them apart (top, ps -o comm)
        assert is_starter(starter) and not is_starter(job.pid)
        assert process_name(job.pid) == WORKER_NAME
        os.kill(starter, signal.SIGKILL)
        assert gone(starter)
        wait_for(lambda: '"event": "starter.ended"' in log.read_text(), 30, "the loss", daemon)
        said = wait_for(lambda: _starter_said(cfg, "off"), 30, "status: off", daemon, log)
        assert said["pid"] == starter and said["why"] == "it ended (exit code -9)"
        assert alive(job.pid)
        os.killpg(job.pid, signal.SIGCONT)
        copy_checkpoint(watch / "k_step2")  # after the loss: a plain process evaluates it
        wait_for(
            lambda: len(read_ledger(tmp_path / "ledgers", "k")) >= 2, 300, "2 lines", daemon, log
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    lines = read_ledger(tmp_path / "ledgers", "k")
    assert Counter((ln["step"], ln["status"], ln["attempt"]) for ln in lines) == {
        (1, "ok", 1): 1,
        (2, "ok", 1): 1,
    }
    first = next(ln for ln in lines if ln["step"] == 1)
    assert first["job_id"] == job.id and first["n_samples"] == 20
    by_job = {
        p.parent.parent.name: _starters(p.read_text())
        for p in (tmp_path / "state" / "jobs").glob("*/attempt-*/worker.log")
    }
    assert by_job.pop(job.id) == [str(starter)]
    assert list(by_job.values()) == [["None"]]
    assert not alive(job.pid)


@E2E
def test_warm_workers_are_forked_with_the_daemons_pipes_and_outlive_a_killed_starter(
    tmp_path: Path, addition_tasks: Path, trained_checkpoint: Path
) -> None:
    """A warm worker forked from the starter takes its jobs and reports their ends on the
    daemon's own pipes, passed through the starter: it evaluates the next checkpoints on
    swapped weights as a plain one does, goes on after the starter is killed -9, and is
    released and gone when the daemon stops."""
    watch, staged = tmp_path / "ckpts", tmp_path / "staged"
    watch.mkdir()
    ckpts = derived_checkpoints(trained_checkpoint, staged, "w", (30, 60, 90), tie=True)
    shutil.copytree(ckpts[0], watch / ckpts[0].name)
    # (no engine ahead of a step still settling: one asked for before the starter is ready
    # starts as a plain process, which this test is not about)
    raw = base_config(tmp_path, watch, addition_tasks, warm_engine=True, early_engine=False)
    cfg = write_config(tmp_path / "w.yaml", raw)
    log, ledgers = tmp_path / "daemon.log", tmp_path / "ledgers"

    def engine() -> dict:
        (path,) = (tmp_path / "state" / "jobs" / "_warm").glob("*/engine.json")
        return json.loads(path.read_text())

    def evaluated(n: int, daemon: object) -> list[dict]:
        return wait_for(
            lambda: len(done := read_ledger(ledgers, "w")) == n and done, 300, f"{n}", daemon, log
        )

    with watcher_run(cfg, log) as daemon:
        evaluated(1, daemon)
        said = wait_for(lambda: _starter_said(cfg, "ready"), 30, "status: ready", daemon, log)
        starter, worker = said["pid"], engine()["pid"]
        assert _parent(worker) == starter and process_name(worker) == WORKER_NAME
        started = [json.loads(x) for x in log.read_text().splitlines() if "worker_started" in x]
        assert [(e["pid"], e["forked"]) for e in started] == [(worker, True)]
        (staged / ckpts[1].name).rename(watch / ckpts[1].name)  # appears at once
        evaluated(2, daemon)
        os.kill(starter, signal.SIGKILL)
        wait_for(lambda: _starter_said(cfg, "off"), 30, "status: off", daemon, log)
        assert alive(worker)  # its pipes are the daemon's, not the starter's
        (staged / ckpts[2].name).rename(watch / ckpts[2].name)
        lines = evaluated(3, daemon)
        assert engine()["pid"] == worker
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    assert gone(worker) and engine()["state"] == "released"
    by_step = sorted((ln["step"], ln["status"], ln["attempt"], ln["engine"]) for ln in lines)
    assert by_step == [(30, "ok", 1, "cold"), (60, "ok", 1, "warm"), (90, "ok", 1, "warm")]
