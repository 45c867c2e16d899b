"""Crash safety with real processes and real signals: kill -9 the daemon mid-eval, restart;
SIGTERM with a running eval; a worker killed mid-eval."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from ckpt_watcher.errors import StateError
from ckpt_watcher.state import DB_NAME, Job, State
from ckpt_watcher.status import STALE_AFTER

from .conftest import (
    WATCHER,
    base_config,
    idle_config,
    read_ledger,
    write_config,
    write_fake_checkpoint,
)
from .helpers import alive, running_job, status_json, wait_for, watcher_run

pytestmark = pytest.mark.e2e

TASKS = [{"task": "addition", "num_fewshot": 0}, {"task": "addition", "num_fewshot": 1}]


def test_kill_9_mid_eval_then_restart_loses_and_duplicates_nothing(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    watch = tmp_path / "ckpts"
    for step in (1, 2):
        copy_checkpoint(watch / f"k_step{step}")
    cfg = write_config(
        tmp_path / "w.yaml", base_config(tmp_path, watch, addition_tasks, tasks=TASKS)
    )
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        job = wait_for(lambda: running_job(tmp_path / "state"), 60, "an eval to start", daemon, log)
        os.kill(daemon.pid, signal.SIGKILL)  # the daemon dies; its worker is left behind
        daemon.wait()
    worker = job.pid
    assert alive(worker), "the worker should outlive a kill -9 of the daemon"
    # held until the next daemon has started, so that it finds the worker still evaluating
    # (a worker that ends while no daemon runs is filed, not adopted: its own tests)
    os.kill(worker, signal.SIGSTOP)
    code, st = status_json(cfg)
    assert code == 3 and st and not st["daemon"]["alive"]

    with watcher_run(cfg, log) as daemon:
        # the new daemon adopts the worker: it goes on, its job is not started again
        try:
            wait_for(
                lambda: '"event": "recovery.adopted"' in log.read_text(), 60, "adoption", daemon
            )
        finally:
            os.kill(worker, signal.SIGCONT)
        assert alive(worker) or any(
            ln["job_id"] == job.id for ln in read_ledger(tmp_path / "ledgers", "k")
        )
        wait_for(
            lambda: (
                len([ln for ln in read_ledger(tmp_path / "ledgers", "k") if ln["status"] == "ok"])
                >= 4
            ),
            300,
            "4 ok lines",
            daemon,
            log,
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    lines = read_ledger(tmp_path / "ledgers", "k")
    counts = Counter((ln["step"], ln["num_fewshot"]) for ln in lines if ln["status"] == "ok")
    assert counts == {(1, 0): 1, (1, 1): 1, (2, 0): 1, (2, 1): 1}
    assert all(ln["status"] == "ok" for ln in lines)
    # the adopted job ran once, in its first attempt, and cost no daemon death
    adopted = [ln for ln in lines if ln["job_id"] == job.id]
    assert adopted and {ln["attempt"] for ln in adopted} == {1}
    (attempt,) = (tmp_path / "state" / "jobs" / job.id).iterdir()
    worker_log = (attempt / "worker.log").read_text()
    assert worker_log.count("worker.started") == 1
    assert "starter=None" not in worker_log  # forked from the worker starter, which died too
    assert not alive(worker)


def test_first_sigterm_past_grace_requeues_the_running_eval_and_second_run_finishes_it(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    watch = tmp_path / "ckpts"
    copy_checkpoint(watch / "s_step1")
    raw = base_config(tmp_path, watch, addition_tasks, tasks=TASKS)
    raw["shutdown_grace_seconds"] = 0
    cfg = write_config(tmp_path / "w.yaml", raw)
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        job = wait_for(lambda: running_job(tmp_path / "state"), 60, "an eval to start", daemon, log)
        os.killpg(job.pid, signal.SIGSTOP)  # frozen, so that it cannot finish first
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    assert not alive(job.pid)
    assert read_ledger(tmp_path / "ledgers", "s") == []  # interrupted: never marked ok
    _, st = status_json(cfg)
    assert st and len(st["queue"]) == 1 and st["queue"][0]["attempt"] == 0  # not a used-up attempt

    with watcher_run(cfg, log) as daemon:
        wait_for(
            lambda: len(read_ledger(tmp_path / "ledgers", "s")) >= 2, 300, "2 results", daemon, log
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    assert sorted(ln["num_fewshot"] for ln in read_ledger(tmp_path / "ledgers", "s")) == [0, 1]


def test_worker_killed_mid_eval_is_retried_then_ok(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    watch = tmp_path / "ckpts"
    copy_checkpoint(watch / "w_step1")
    cfg = write_config(
        tmp_path / "w.yaml", base_config(tmp_path, watch, addition_tasks, tasks=TASKS)
    )
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        job = wait_for(lambda: running_job(tmp_path / "state"), 60, "an eval to start", daemon, log)
        os.killpg(job.pid, signal.SIGKILL)  # OOM killer, say
        wait_for(
            lambda: len(read_ledger(tmp_path / "ledgers", "w")) >= 2, 300, "2 results", daemon, log
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    lines = read_ledger(tmp_path / "ledgers", "w")
    assert [ln["status"] for ln in lines] == ["ok", "ok"]
    assert max(ln["attempt"] for ln in lines) == 2  # a task done before the kill keeps attempt 1
    assert "SIGKILL" in log.read_text()  # the retry said why


def test_status_tells_a_hung_daemon_from_a_dead_one(tmp_path: Path) -> None:
    cfg = idle_config(tmp_path)
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        wait_for(lambda: status_json(cfg)[0] == 0, 30, "running", daemon, log)
        _stop_outside_a_write(daemon.pid, tmp_path / "s" / DB_NAME)  # hung: its lock, no beat
        try:  # its last heartbeat STALE_AFTER ago (rather than waiting that long)
            State(tmp_path / "s").set_meta(heartbeat=time.time() - STALE_AFTER - 5)
            code, st = wait_for(lambda: (r := status_json(cfg))[0] == 4 and r, 60, "stale")
            assert st["daemon"]["alive"] and st["daemon"]["stale"]
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        wait_for(lambda: status_json(cfg)[0] == 0, 30, "fresh again", daemon, log)
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.wait()
    code, st = status_json(cfg)
    assert code == 3 and st and not st["daemon"]["alive"] and st["daemon"]["stopped_at"]


def _stop_outside_a_write(pid: int, db: Path) -> None:
    """SIGSTOP `pid` at a moment it holds no write transaction on `db` (stopped inside one, on
    a busy machine, it kept the test's own write waiting until sqlite gave up)."""
    for _ in range(100):
        os.kill(pid, signal.SIGSTOP)
        conn = sqlite3.connect(db, timeout=0.2, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:  # locked: let it finish what it was writing
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.05)
        finally:
            conn.close()
    raise AssertionError(f"pid {pid} held a write on {db} at each of 100 stops")


def test_second_signal_kills_running_evals_at_once(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    watch = tmp_path / "ckpts"
    copy_checkpoint(watch / "t_step1")
    raw = base_config(tmp_path, watch, addition_tasks, tasks=TASKS)
    raw["shutdown_grace_seconds"] = 600
    cfg = write_config(tmp_path / "w.yaml", raw)
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        job = wait_for(lambda: running_job(tmp_path / "state"), 60, "an eval to start", daemon, log)
        # the eval frozen (SIGSTOP; the daemon's SIGKILL still ends it): on a fast machine its
        # tiny tasks could end during the two `watcher status` calls below
        os.killpg(job.pid, signal.SIGSTOP)
        daemon.send_signal(signal.SIGTERM)  # drain: would wait up to 600 s
        wait_for(
            lambda: (st := status_json(cfg)[1]) and st["daemon"]["stopping"],
            10,
            "draining",
            daemon,
            log,
        )
        daemon.send_signal(signal.SIGINT)  # second signal: stop now
        assert daemon.wait(timeout=20) == 0
    assert not alive(job.pid)
    _, st = status_json(cfg)
    assert st and [q["last_error"] for q in st["queue"]] == ["interrupted by shutdown"]


def test_hung_eval_is_killed_at_timeout_retried_then_failed(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    watch = tmp_path / "ckpts"
    copy_checkpoint(watch / "h_step1")
    # 2 s is less than a fresh worker needs to import torch and lm-eval: every attempt "hangs"
    # (a worker forked from the starter has them imported, and is done within 2 s)
    raw = base_config(tmp_path, watch, addition_tasks, timeout_seconds=2, max_attempts=2)
    raw["executor"] = {"preload": False}
    cfg = write_config(tmp_path / "w.yaml", raw)
    r = subprocess.run(
        [*WATCHER, "--log-json", "once", "-c", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    (line,) = read_ledger(tmp_path / "ledgers", "h")
    assert line["status"] == "failed" and line["attempt"] == 2
    assert line["error"].startswith("timed out after 2s (eval.timeout_seconds) (after 2 attempts)")
    assert "--- worker log tail ---" in line["error"]
    assert r.stderr.count('"event": "eval.timeout"') == 2


def test_hostile_directories_are_reported_by_a_running_daemon_never_evaluated(
    tmp_path: Path, addition_tasks: Path
) -> None:
    watch = tmp_path / "ckpts"
    for name in ["x; rm -rf ~_step1", "$(touch pwned)_step2", "new\nline_step3", "latest"]:
        write_fake_checkpoint(watch / name)
    os.mkdir(os.fsencode(watch) + b"/bad\xff_step5")
    (Path(os.fsdecode(os.fsencode(watch) + b"/bad\xff_step5")) / "config.json").write_text("{}")
    outside = write_fake_checkpoint(tmp_path / "outside" / "o_step1")
    os.symlink(outside, watch / "link_step7")
    cfg = write_config(
        tmp_path / "w.yaml",
        {
            "state_dir": str(tmp_path / "s"),
            "ledger_dir": str(tmp_path / "l"),
            "sources": [{"kind": "local", "path": str(watch)}],
            "devices": {"gpus": [], "cpu_slots": 1},
            "eval": {"tasks": [{"task": "addition"}], "include_path": str(addition_tasks)},
        },
    )
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        st = wait_for(
            lambda: (
                (s := status_json(cfg)[1]) and s["checkpoint_counts"].get("unrecognised") == 6 and s
            ),
            30,
            "6 unrecognised entries",
            daemon,
            log,
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
    reasons = sorted(c["reason"] for c in st["checkpoints"])
    assert "symlink: not followed" in reasons
    assert not st["queue"] and not st["running"]
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
    assert not (tmp_path / "l").exists() or not any((tmp_path / "l").glob("*/ledger.jsonl"))


def test_a_job_running_through_three_daemon_deaths_fails_instead_of_crash_looping(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    watch = tmp_path / "ckpts"
    copy_checkpoint(watch / "loop_step1")
    raw = base_config(tmp_path, watch, addition_tasks, max_attempts=3)
    cfg = write_config(tmp_path / "w.yaml", raw)
    log = tmp_path / "daemon.log"

    killed: set[int] = set()

    def started_worker(daemon_pid: int) -> Job | None:
        # read the state directly (not through `watcher status`, a slower subprocess): the kill
        # must land while the worker is still importing, long before its eval could finish.
        # The row must be the new daemon's, not the one the last kill left `running`.
        try:
            state = State(tmp_path / "state", readonly=True)
        except StateError:
            return None
        try:
            if state.get_meta("daemon_pid") != daemon_pid:
                return None
            return next((j for j in state.jobs("running") if j.pid and j.pid not in killed), None)
        finally:
            state.close()

    for death in (1, 2, 3):
        with watcher_run(cfg, log) as daemon:
            job = wait_for(
                lambda: started_worker(daemon.pid), 60, f"the eval to start ({death})", daemon, log
            )
            killed.add(job.pid)
            assert job.attempt == 1  # earlier deaths cost no attempt
            # memory pressure: the kernel kills the daemon and the eval it was running
            os.kill(daemon.pid, signal.SIGKILL)
            os.killpg(job.pid, signal.SIGKILL)
            daemon.wait()
        assert read_ledger(tmp_path / "ledgers", "loop") == []
    with watcher_run(cfg, log) as daemon:
        lines = wait_for(
            lambda: read_ledger(tmp_path / "ledgers", "loop"), 30, "the failed line", daemon, log
        )
        code, st = status_json(cfg)
        assert code == 0 and st is not None and not st["running"] and not st["queue"]
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    (line,) = lines
    assert line["status"] == "failed"
    assert line["error"].startswith("the daemon died while this job ran (3 times)")
    assert [f["error"] for f in st["failures"]] == ["the daemon died while this job ran (3 times)"]
    assert '"event": "recovery.crash_loop"' in log.read_text()
