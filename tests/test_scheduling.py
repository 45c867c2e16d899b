"""Scheduling through the real daemon loop (in-process) with a simulated executor whose workers
take known times on a simulated clock (nothing sleeps): packing, policies, event-driven
dispatch."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ckpt_watcher.config import parse_config
from ckpt_watcher.daemon import Daemon
from ckpt_watcher.devices import FakeGpu, FakeInventory
from ckpt_watcher.executors.simulated import SimClock, SimulatedExecutor
from ckpt_watcher.state import State

from .conftest import read_ledger, write_fake_checkpoint

DURATIONS = {"t1": 4.0, "t2": 2.0, "t3": 1.0, "t4": 1.0}  # simulated seconds


def run_once(tmp_path: Path, steps: list[int], gpus: int, **over: object) -> Path:
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
        executor_factory=lambda cb: SimulatedExecutor(cb, lambda task, k: DURATIONS[task], sim),
    )
    assert daemon.run() == 0
    return tmp_path / "ledgers"


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
