"""Scheduling through the real daemon loop (in-process) with a simulated executor whose workers
take known times on a simulated clock (nothing sleeps): packing, policies, event-driven
dispatch."""

from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ckpt_watcher.config import parse_config
from ckpt_watcher.daemon import Daemon
from ckpt_watcher.devices import FakeGpu, FakeInventory
from ckpt_watcher.executors.base import WorkerHandle
from ckpt_watcher.executors.simulated import SimClock, SimulatedExecutor
from ckpt_watcher.jobfolder import JobFolder
from ckpt_watcher.state import State

from .conftest import read_ledger, write_fake_checkpoint

DURATIONS = {"t1": 4.0, "t2": 2.0, "t3": 1.0, "t4": 1.0}  # simulated seconds


class KeepLastK(SimulatedExecutor):
    """As each job starts, the trainer deletes every checkpoint but its newest (keep-last-1)."""

    def __init__(self, *args: Any, watch: Path, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.watch = watch

    def start(self, job_id: str, folder: JobFolder, env: dict[str, str]) -> WorkerHandle:
        for old in sorted(self.watch.glob("r_step*"), key=lambda p: int(p.name[6:]))[:-1]:
            shutil.rmtree(old)
        return super().start(job_id, folder, env)


def run_once(
    tmp_path: Path, steps: list[int], gpus: int, keep_last: bool = False, **over: object
) -> Path:
    watch = tmp_path / "ckpts"
    for s in steps:
        write_fake_checkpoint(watch / f"r_step{s}")
    raw = {
        "state_dir": str(tmp_path / "state"),
        "ledger_dir": str(tmp_path / "ledgers"),
        "sources": [{"kind": "local", "path": str(watch), "inotify": False}],
        "eval": {"tasks": [{"task": t, "num_fewshot": 0} for t in DURATIONS]},
        **over,
    }
    cfg = parse_config(raw)
    inv = FakeInventory([FakeGpu(i, f"GPU-{i}") for i in range(gpus)])
    sim = SimClock()
    daemon = Daemon(
        cfg,
        once=True,
        clock=sim,
        wait=sim.wait,
        inventory=inv,
        executor_factory=lambda cb: (KeepLastK if keep_last else SimulatedExecutor)(
            cb, lambda task, k: DURATIONS[task], sim, **({"watch": watch} if keep_last else {})
        ),
    )
    sim.busy = daemon.discovery.scanning
    assert daemon.run() == 0
    return tmp_path / "ledgers"


def test_simulated_time_waits_for_a_slow_scan(tmp_path: Path, monkeypatch: Any) -> None:
    """A scan reads the clock as it judges each checkpoint. On a loaded machine (a full suite,
    3 workers on 2 cores) the first scan stalled past the simulated clock's real grace before
    step 300, time jumped, and the next scan found steps 100 and 200 settled but not 300:
    skip_superseded then ran 200. Simulated time now stands still while a scan is out."""
    from ckpt_watcher.discovery import Discovery

    judge = Discovery._judge
    looks: Counter[str] = Counter()

    def slow(self: Discovery, source: Any, location: str, *args: Any) -> Any:
        looks[location] += 1
        if location.endswith("r_step300") and looks[location] == 1:
            time.sleep(0.05)  # the first scan stalls once, just before its last checkpoint
        return judge(self, source, location, *args)

    monkeypatch.setattr(Discovery, "_judge", slow)
    ledgers = run_once(tmp_path, [100, 200, 300], gpus=1, policy={"skip_superseded": True})
    assert {ln["step"] for ln in read_ledger(ledgers, "r")} == {300}


def test_spare_devices_split_a_checkpoints_tasks_and_each_runs_once(tmp_path: Path) -> None:
    ledgers = run_once(tmp_path, [100, 200], gpus=6)
    lines = read_ledger(ledgers, "r")
    assert Counter((ln["step"], ln["task"]) for ln in lines) == {
        (s, t): 1 for s in (100, 200) for t in DURATIONS
    }
    devices_per_step = {s: {ln["device"] for ln in lines if ln["step"] == s} for s in (100, 200)}
    assert all(len(d) >= 2 for d in devices_per_step.values())  # split over several GPUs
    state = State(tmp_path / "state", readonly=True)
    try:
        assert state.checkpoint_counts() == {"done": 2}
        assert len(state.jobs("ok")) >= 5  # 2 checkpoints became 6 jobs on 6 GPUs
    finally:
        state.close()


def test_every_n_steps_skips_and_says_why(tmp_path: Path) -> None:
    run_once(tmp_path, [100, 150, 200], gpus=2, policy={"every_n_steps": 100})
    state = State(tmp_path / "state", readonly=True)
    try:
        rows = {r.step: (r.state, r.reason) for r in state.checkpoints()}
    finally:
        state.close()
    assert rows[150] == ("skipped", "step 150 is not a multiple of policy.every_n_steps=100")
    assert rows[100][0] == rows[200][0] == "done"


def test_order_and_skip_superseded(tmp_path: Path) -> None:
    ledgers = run_once(tmp_path / "new", [100, 200, 300], gpus=1)
    first = min(read_ledger(ledgers, "r"), key=lambda ln: ln["started_at"])
    assert first["step"] == 300  # newest_first
    ledgers = run_once(tmp_path / "old", [100, 200, 300], gpus=1, policy={"order": "oldest_first"})
    assert min(read_ledger(ledgers, "r"), key=lambda ln: ln["started_at"])["step"] == 100
    ledgers = run_once(tmp_path / "sup", [100, 200, 300], gpus=1, policy={"skip_superseded": True})
    assert {ln["step"] for ln in read_ledger(ledgers, "r")} == {300}
    state = State(tmp_path / "sup" / "state", readonly=True)
    try:
        rows = {r.step: (r.state, r.reason) for r in state.checkpoints()}
    finally:
        state.close()
    assert rows[100] == rows[200] == ("skipped", "superseded by a newer checkpoint")


def test_backlog_thin_keeps_an_evenly_spaced_subset_and_says_what_it_skipped(
    tmp_path: Path,
) -> None:
    from ckpt_watcher.report.plot import skipped_steps
    from ckpt_watcher.report.table import metric_table

    steps = [10, 20, 30, 40, 50, 60, 70, 80]
    policy = {"backlog": {"max_pending": 3, "overflow": "thin"}}
    ledgers = run_once(tmp_path, steps, gpus=1, policy=policy)
    lines = read_ledger(ledgers, "r")
    ok = [ln for ln in lines if ln["status"] == "ok"]
    # coarse to fine: the newest, the oldest, then the middle; run newest first
    assert [ln["step"] for ln in ok if ln["task"] == "t1"] == [80, 40, 10]
    skipped = [ln for ln in lines if ln["status"] == "skipped"]
    assert sorted({ln["step"] for ln in skipped}) == [20, 30, 50, 60, 70]
    assert len(skipped) == 5 * len(DURATIONS)  # one line per task, saying why
    assert {ln["error"] for ln in skipped} == {"backlog (thin, max_pending 3)"}
    assert skipped_steps(lines) == [20, 30, 50, 60, 70]
    table = metric_table(lines)
    row = {r[0]: r for r in table.rows}
    assert row[20][1] == "SKIPPED" and isinstance(row[40][1], float)
    state = State(tmp_path / "state", readonly=True)
    try:
        assert state.checkpoint_counts() == {"done": 3, "skipped": 5}
    finally:
        state.close()


def test_backlog_skip_oldest_keeps_the_newest_and_the_final(tmp_path: Path) -> None:
    steps = [10, 20, 30, 40, 50]
    policy = {"backlog": {"max_pending": 2, "overflow": "skip_oldest"}}
    watch = tmp_path / "ckpts"
    write_fake_checkpoint(watch / "r_final")  # a final with no step: always kept
    ledgers = run_once(tmp_path, steps, gpus=1, policy=policy)
    lines = read_ledger(ledgers, "r")
    ran = {ln["label"] for ln in lines if ln["status"] == "ok"}
    assert ran == {"r_final", "r_step50"}
    assert {ln["step"] for ln in lines if ln["status"] == "skipped"} == {10, 20, 30, 40}


def test_backlog_keep_is_todays_behaviour(tmp_path: Path) -> None:
    policy = {"backlog": {"max_pending": 1, "overflow": "keep"}}
    ledgers = run_once(tmp_path, [10, 20, 30], gpus=1, policy=policy)
    assert {ln["status"] for ln in read_ledger(ledgers, "r")} == {"ok"}


def test_pins_over_their_budget_skip_the_oldest_waiting_checkpoints_visibly(
    tmp_path: Path,
) -> None:
    # about one byte: once the trainer deletes what they pinned (pins then hold it alone), the
    # pins of checkpoints not started go (a pin of files the trainer keeps costs nothing)
    policy = {"pin_max_gb": 1e-9}
    ledgers = run_once(tmp_path, [10, 20, 30], gpus=1, keep_last=True, policy=policy)
    lines = read_ledger(ledgers, "r")
    assert {ln["step"] for ln in lines if ln["status"] == "ok"} == {30}
    skipped = [ln for ln in lines if ln["status"] == "skipped"]
    assert {ln["step"] for ln in skipped} == {10, 20}
    assert {ln["error"] for ln in skipped} == {"pin budget (policy.pin_max_gb)"}
    assert not list((tmp_path / "ckpts").glob(".ckpt-watcher-pins/*")), "pins left behind"
