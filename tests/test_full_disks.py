"""Full disks, real ones (a tmpfs of 2 MiB, filled). A ledger folder that cannot be written stops
neither the daemon nor any result: finished results wait in their job folders, no eval starts,
`watcher status` says DEGRADED, and everything is filed once there is room; `watcher once` stops
with one line instead of waiting. A state folder that cannot be written stops the daemon with
one line saying what to do, and the next start goes on."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt_watcher.config import parse_config
from ckpt_watcher.daemon import Daemon
from ckpt_watcher.devices import FakeGpu, FakeInventory
from ckpt_watcher.executors.base import WorkerHandle
from ckpt_watcher.executors.simulated import SimClock, SimulatedExecutor
from ckpt_watcher.jobfolder import JobFolder
from ckpt_watcher.jobs.filing import RETRY_SECONDS

from .conftest import (
    WATCHER,
    base_config,
    idle_config,
    read_ledger,
    write_config,
    write_fake_checkpoint,
)
from .helpers import alive, running_job, status_json, wait_for, watcher_run


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted for the test (needs root, as CI has)."""
    mount = tmp_path / "ledgers"
    mount.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {r.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(disk: Path) -> Path:
    """Write a file until the disk refuses (ENOSPC): not one page is left."""
    path = disk / "filler"
    with open(path, "wb", buffering=0) as f:  # unbuffered: nothing left to flush at close
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return path


def test_an_exit_whose_lines_cannot_be_filed_waits_and_no_other_job_starts(
    tmp_path: Path, small_disk: Path
) -> None:
    """The daemon's loop (in process, simulated executor and clock): the disk fills while step
    100 runs; its exit waits to be filed, step 200 waits to start; room at t+100 s files one,
    then starts and files the other."""
    watch = tmp_path / "ckpts"
    for step in (100, 200):
        write_fake_checkpoint(watch / f"r_step{step}")
    cfg = parse_config(
        {
            "state_dir": str(tmp_path / "state"),
            "ledger_dir": str(small_disk),
            "sources": [{"kind": "local", "path": str(watch), "inotify": False}],
            "policy": {"order": "oldest_first"},
            "eval": {"tasks": [{"task": "t1", "num_fewshot": 0}]},
        }
    )
    sim = SimClock()
    filled: list[Path] = []
    seen: dict[str, object] = {}

    class FillsTheDisk(SimulatedExecutor):
        def start(self, job_id: str, folder: JobFolder, env: dict[str, str]) -> WorkerHandle:
            handle = super().start(job_id, folder, env)
            if not filled:  # the first job: the disk fills while it runs, room 100 s later
                filled.append(fill(small_disk))
                sim.call_at(sim() + 60, look)
                sim.call_at(sim() + 100, filled[0].unlink)
                sim.call_at(sim() + 300, daemon.request_stop)
            return handle

    def look() -> None:
        seen["waiting"] = sorted(daemon.filing.pending)
        seen["queued"] = [j.step for j in daemon.state.jobs("queued")]
        seen["running"] = [j.step for j in daemon.state.jobs("running")]
        seen["summary"] = daemon.filing.summary(sim())
        seen["gauge"] = metric()

    def metric() -> float | None:
        name = "ckpt_watcher_ledger_unwritable_seconds"
        return daemon.metrics.registry.get_sample_value(name)

    daemon = Daemon(
        cfg,
        clock=sim,
        wait=sim.wait,
        inventory=FakeInventory([FakeGpu(0, "GPU-0")]),
        executor_factory=lambda cb: FillsTheDisk(cb, lambda task, k: 4.0, sim),
    )
    sim.busy = daemon.discovery.scanning
    sim.call_at(sim() + 3600, daemon.request_stop)  # whatever happens, a simulated hour ends it
    assert daemon.run() == 0
    summary = seen["summary"]
    assert isinstance(summary, dict) and "No space left on device" in summary["error"]
    assert seen["queued"] == [200] and seen["running"] == [100]  # 100 has ended, not filed
    assert seen["waiting"] == summary["waiting_jobs"] and len(summary["waiting_jobs"]) == 1
    lines = read_ledger(small_disk, "r")
    assert sorted((ln["step"], ln["status"], ln["attempt"]) for ln in lines) == [
        (100, "ok", 1),
        (200, "ok", 1),
    ]
    assert daemon.filing.summary(sim()) is None
    # Prometheus (set by the heartbeat): how long it could not be written, then 0
    gauge = seen["gauge"]
    assert isinstance(gauge, float) and 50 <= gauge <= 61, gauge
    assert metric() == 0.0


@pytest.mark.e2e
def test_a_full_ledger_disk_loses_no_result_and_stops_no_daemon(
    tmp_path: Path, small_disk: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    watch = tmp_path / "ckpts"
    copy_checkpoint(watch / "full_step100")
    data = base_config(tmp_path, watch, addition_tasks)
    data["ledger_dir"] = str(small_disk)
    cfg = write_config(tmp_path / "w.yaml", data)
    state = tmp_path / "state"
    log = tmp_path / "daemon.log"

    # step 100's worker finishes after its daemon died (kill -9): its result is in its job
    # folder only, and the ledger's disk is full before any daemon can file it
    with watcher_run(cfg, log) as daemon:
        job = wait_for(lambda: running_job(state), 120, "step 100's eval to start", daemon, log)
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.wait()
    wait_for(lambda: not alive(job.pid), 180, "step 100's worker to finish alone")
    (job_dir,) = (state / "jobs").iterdir()
    assert JobFolder(job_dir / "attempt-1").exit_code() == 0
    filler = fill(small_disk)
    assert read_ledger(small_disk, "full") == []

    # `watcher once` does not wait for room: one line saying what and that nothing is lost
    once = subprocess.run(
        [*WATCHER, "once", "-c", str(cfg)], capture_output=True, text=True, timeout=300
    )
    assert once.returncode == 1, once.stderr[-2000:]
    said = once.stderr.strip().splitlines()[-1]  # after its log lines
    assert said.startswith("watcher: ") and "Traceback" not in once.stderr, once.stderr[-2000:]
    assert "No space left on device" in said and "Nothing is lost" in said, said

    # `watcher run` keeps going: step 100 waits to be filed, step 200 (new) does not start
    copy_checkpoint(watch / "full_step200")
    with watcher_run(cfg, log) as daemon:

        def degraded() -> dict | None:
            code, st = status_json(cfg)
            return st if code == 5 and st and st.get("ledger_unwritable") else None

        st = wait_for(degraded, 120, "status to say the ledger cannot be written", daemon, log)
        unwritable = st["ledger_unwritable"]
        assert unwritable["ledger_dir"] == str(small_disk)
        assert "No space left on device" in unwritable["error"]
        assert unwritable["waiting_jobs"] == [job_dir.name]
        assert any("cannot be written" in why for why in st["degraded"]), st["degraded"]
        # past a retry: still running, and the new checkpoint queued, not started
        wait_for(
            lambda: (
                (c := status_json(cfg))[1] is not None
                and c[1]["daemon"]["heartbeat_age_s"] is not None
                and c[1]["ledger_unwritable"] is not None
                and c[1]["ledger_unwritable"]["for_s"] > RETRY_SECONDS + 1
                and c
            ),
            90,
            "a retry that fails again",
            daemon,
            log,
        )
        code, st = status_json(cfg)
        assert code == 5 and st is not None and daemon.poll() is None
        assert [q["step"] for q in st["queue"]] == [200]
        assert [r["job_id"] for r in st["running"]] == [job_dir.name]  # its lines wait
        assert not any((state / "jobs").glob("full-200-*/attempt-*/worker.log"))

        # room again: step 100's result as its worker computed it, then step 200's
        filler.unlink()
        lines = wait_for(
            lambda: len(done := read_ledger(small_disk, "full")) == 2 and done,
            240,
            "both results filed",
            daemon,
            log,
        )
        wait_for(lambda: status_json(cfg)[0] == 0, 30, "status to be healthy again", daemon, log)
    by_step = {ln["step"]: ln for ln in lines}
    assert sorted(by_step) == [100, 200]
    assert all(ln["status"] == "ok" for ln in lines), lines
    assert by_step[100]["attempt"] == 1  # filed from its job folder, not evaluated again
    assert sorted(p.name for p in job_dir.iterdir()) == ["attempt-1"]
    assert 0.0 <= by_step[100]["metrics"]["exact_match,none"] <= 1.0
    text = log.read_text()
    assert '"ledger.unwritable"' in text and '"ledger.writable_again"' in text


@pytest.mark.e2e
def test_a_full_state_disk_stops_the_daemon_with_one_line_and_the_next_start_goes_on(
    tmp_path: Path, small_disk: Path
) -> None:
    cfg = idle_config(tmp_path, state_dir=str(small_disk / "state"))
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        wait_for(lambda: status_json(cfg)[0] == 0, 60, "the daemon to run", daemon, log)
        filler = fill(small_disk)
        assert daemon.wait(timeout=60) == 1  # its heartbeat cannot be written
    said = log.read_text().strip().splitlines()[-1]
    assert said.startswith("watcher: cannot write the state database"), said
    assert "database or disk is full" in said and "free space on its disk" in said, said
    assert status_json(cfg)[0] == 3  # down
    filler.unlink()
    with watcher_run(cfg, log) as daemon:
        wait_for(lambda: status_json(cfg)[0] == 0, 60, "the next start to run", daemon, log)
