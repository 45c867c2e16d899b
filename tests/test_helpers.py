"""Helpers, the daemon's side: which running job a spare device joins, and when a helper goes
(its job ended; a queued checkpoint needs the device; the daemon stops). A recording executor
stands in for processes (the spread itself, with real workers, is tests/test_spread.py)."""

from __future__ import annotations

from pathlib import Path

from ckpt_watcher.devices import Device, cpu_slots
from ckpt_watcher.executors.base import Executor, WorkerHandle
from ckpt_watcher.jobfolder import EvalRequest, JobFolder, JobSpec
from ckpt_watcher.jobs.helpers import Helpers
from ckpt_watcher.state import Job, State


class Recording(Executor):
    shares_journals = True

    def __init__(self) -> None:
        self.started: list[str] = []
        self.killed: list[str] = []

    def start(self, job_id: str, folder: JobFolder, env: dict[str, str]) -> WorkerHandle:
        self.started.append(job_id)
        return WorkerHandle(job_id, 1000 + len(self.started), "t")

    def kill(self, job_id: str) -> None:
        self.killed.append(job_id)

    def running(self) -> set[str]:
        return set(self.started) - set(self.killed)


def _job(state: State, jid: str, state_name: str, started: float) -> Job:
    job = Job(jid, f"/c/{jid}", "r", 1, jid, [{"task": "t", "num_fewshot": 0}], "h", 0.0, 1.0)
    job.fingerprint = f"sampled:{jid}"
    state.add_job(job)
    state.update_job(jid, state=state_name, attempt=1, started_at=started, device="cpu:0")
    return job


def _spec(job: Job, device: Device) -> JobSpec:
    request = EvalRequest(job.location, "hf", {}, [], 42, {}, None, None, None, None, "/r", "cpu")
    return JobSpec(job.id, device.label, request)


def test_spare_devices_join_and_leave_when_their_job_ends_or_a_checkpoint_needs_them(
    tmp_path: Path,
) -> None:
    state = State(tmp_path)
    executor = Recording()
    helpers = Helpers(state, executor, tmp_path)
    _job(state, "a", "running", 10.0)
    _job(state, "b", "running", 20.0)
    helpers.start(cpu_slots(4)[1:], _spec)
    assert [(h.job_id, h.device.label) for h in helpers.active.values()] == [
        ("a", "cpu:1"),
        ("b", "cpu:2"),
        ("a", "cpu:3"),
    ]
    assert sorted(helpers.device_ids()) == ["cpu:1", "cpu:2", "cpu:3"]
    assert state.get_meta("helpers")[0] == {"job_id": "a", "device": "cpu:1", "pid": 1001}
    spec = JobFolder.helper(tmp_path, "a", 1, "cpu:1").read_spec()
    assert spec.request.helps == "a" and spec.device_label == "cpu:1"
    # nothing changed: nobody is told to go
    helpers.reap(devices_wanted=0)
    assert executor.killed == []
    # b ends: its helper goes, and that frees the device one queued checkpoint wants
    state.update_job("b", state="ok")
    helpers.reap(devices_wanted=1)
    assert executor.killed == ["b.help-cpu:2.1"]
    # two queued checkpoints want a device: a's newest helper goes too, once
    helpers.reap(devices_wanted=2)
    helpers.reap(devices_wanted=2)  # asked again before the exits arrive: nobody else goes
    assert executor.killed == ["b.help-cpu:2.1", "a.help-cpu:3.1"]
    for helper_id in list(executor.killed):
        assert helpers.exited(helper_id, -9)
    assert not helpers.exited("a", 0)  # a job's own exit is not a helper's
    assert helpers.device_ids() == ["cpu:1"]
    # a device that helped this attempt of a does not join it again
    helpers.start([cpu_slots(4)[3]], _spec)
    assert helpers.device_ids() == ["cpu:1"]
    # a job queued for its next attempt keeps its helper; the daemon's stop ends it
    state.update_job("a", state="queued")
    helpers.reap(devices_wanted=0)
    assert "a.help-cpu:1.1" not in executor.killed
    helpers.stop_all()
    assert "a.help-cpu:1.1" in executor.killed
    state.close()


def test_a_helpers_spec_makes_no_journal_for_a_task_nobody_has_begun(tmp_path: Path) -> None:
    """What a helper runs names the job's journaled tasks; their folders are made by the job's
    own worker as it begins each (a helper waits for it), never ahead by the daemon: a helper
    never runs a task the job's own worker has not reached."""
    from ckpt_watcher.config import parse_config
    from ckpt_watcher.daemon import Daemon
    from ckpt_watcher.devices import FakeInventory

    (tmp_path / "ckpts").mkdir()
    cfg = parse_config(
        {
            "state_dir": str(tmp_path / "state"),
            "ledger_dir": str(tmp_path / "ledgers"),
            "sources": [{"kind": "local", "path": str(tmp_path / "ckpts"), "inotify": False}],
            "eval": {"tasks": [{"task": "t1"}, {"task": "t2"}]},
        }
    )
    daemon = Daemon(cfg, inventory=FakeInventory(cpu=2), executor_factory=lambda cb: Recording())
    try:
        job = Job("j", "/c/j", "r", 1, "j", [t.model_dump() for t in cfg.eval.tasks], "h", 0, 1)
        job.fingerprint = "sampled:j"
        spec = daemon.dispatcher.helper_spec(job, cpu_slots(2)[1])
        assert spec is not None and [t.task for t in spec.request.tasks] == ["t1", "t2"]
        for t in spec.request.tasks:
            assert t.journal is not None and not Path(t.journal.folder).exists()
    finally:
        daemon.state.close()
