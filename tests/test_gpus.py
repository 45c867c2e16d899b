"""GPU-aware scheduling with a fake NVML inventory (a JSON file the test edits live), real
daemon processes, real workers (computing on the CPU) and real signals."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .conftest import HF, WATCHER, base_config, idle_config, read_ledger, write_config
from .helpers import alive, status_json, wait_for, watcher_once, watcher_run
from .test_resume import _cut_mid_task, _same_as_uninterrupted


def fake_nvml(
    path: Path, foreign: list[list[int]], others: dict[int, list[list[int]]] | None = None
) -> None:
    """GPU 6 with `foreign` processes, and the GPUs `others` names with theirs."""
    gpus = [{"index": i, "uuid": f"GPU-{i}-bbbb", "foreign": f} for i, f in (others or {}).items()]
    gpus += [{"index": 6, "uuid": "GPU-6-aaaa", "foreign": foreign}]  # after: not first choice
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    tmp.replace(path)


@pytest.mark.e2e
def test_gpu_held_by_training_is_skipped_then_used_once_freed_and_all_once_training_ends(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SageMaker sidecar's day on two GPUs: training on 0 and, for a while, on 6; the
    watcher on `gpus: [6]`. It waits for 6, never touches 0; once training has ended, the
    recipe's final `watcher once --set devices.gpus=all` evaluates the last step on 0 (6 is
    someone else's by then: the idle rule still holds). `devices.gpus` selects from the fake
    inventory as it does from NVML."""
    nvml = tmp_path / "nvml.json"
    training = [[4242, 30000, 97]]  # training holds 30 GB at 97%
    fake_nvml(nvml, training, {0: []})  # 0 looks idle for a moment: still training's
    monkeypatch.setenv("CKPT_WATCHER_FAKE_NVML", str(nvml))
    watch = tmp_path / "ckpts"
    copy_checkpoint(watch / "g_step1")
    raw = base_config(tmp_path, watch, addition_tasks)
    raw["devices"] = {"gpus": [6], "cpu_slots": 0}
    cfg = write_config(tmp_path / "w.yaml", raw)
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        st = wait_for(
            lambda: (s := status_json(cfg)[1]) and s["queue"] and s, 60, "a queued job", daemon, log
        )
        scans = st["sources"][0]["last_scan_at"]
        wait_for(
            lambda: status_json(cfg)[1]["sources"][0]["last_scan_at"] != scans, 10, "another scan"
        )
        st = status_json(cfg)[1]
        assert st["running"] == [] and len(st["queue"]) == 1  # its only GPU is training's
        assert st["devices"] == [
            {
                "device": "cuda:6",
                "state": "busy",
                "why": "30000 MiB held by other processes (training?)",
            }
        ], st["devices"]
        shown = subprocess.run([*WATCHER, "status", "-c", str(cfg)], capture_output=True, text=True)
        assert "devices: 1, 0 free\n  cuda:6: busy (30000 MiB held" in shown.stdout, shown.stdout
        (started,) = [
            e
            for e in map(json.loads, log.read_text().splitlines())
            if e.get("event") == "daemon.started"
        ]
        assert started["devices"] == ["cuda:6"], started
        fake_nvml(nvml, [], {0: [[4241, 30000, 97]]})  # training leaves 6
        wait_for(lambda: read_ledger(tmp_path / "ledgers", "g"), 120, "a result", daemon, log)
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    (line,) = read_ledger(tmp_path / "ledgers", "g")
    assert line["status"] == "ok" and line["device"] == "cuda:6"
    # training ends with a last save; 6 now holds someone's notebook
    copy_checkpoint(watch / "g_step2")
    fake_nvml(nvml, [[5151, 20000, 50]], {0: []})
    lines = watcher_once(cfg, tmp_path / "ledgers", "g", extra=("--set", "devices.gpus=all"))
    assert sorted(ln["step"] for ln in lines) == [1, 2]  # step 1 not evaluated again
    last = next(ln for ln in lines if ln["step"] == 2)
    assert last["status"] == "ok" and last["device"] == "cuda:0", last


@pytest.mark.e2e
def test_suspected_zombies_are_reported_and_killed_only_when_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    zombie = subprocess.Popen(["sleep", "300"])
    try:
        nvml = tmp_path / "nvml.json"
        fake_nvml(nvml, [[zombie.pid, 5000, 0]])  # holds 5 GB, does nothing
        monkeypatch.setenv("CKPT_WATCHER_FAKE_NVML", str(nvml))
        devices = {"gpus": "all", "cpu_slots": 0, "zombie_after_seconds": 1}
        cfg = idle_config(tmp_path, devices=devices)
        log = tmp_path / "daemon.log"
        with watcher_run(cfg, log) as daemon:
            st = wait_for(
                lambda: (s := status_json(cfg)[1]) and s["suspected_zombies"] and s,
                30,
                "a suspected zombie",
                daemon,
                log,
            )
            assert st["suspected_zombies"][0]["pid"] == zombie.pid
            assert st["suspected_zombies"][0]["device"] == "cuda:6"
            r = subprocess.run([*WATCHER, "status", "-c", str(cfg)], capture_output=True, text=True)
            assert f"pid {zombie.pid} holds 5000 MiB at 0%" in r.stdout
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(timeout=30) == 0
        assert zombie.poll() is None  # reported, never killed

        cfg = idle_config(tmp_path, devices=devices | {"reap_foreign_zombies": True})
        with watcher_run(cfg, log) as daemon:
            wait_for(lambda: zombie.poll() is not None, 30, "the zombie to be reaped", daemon, log)
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(timeout=30) == 0
        assert zombie.returncode == -signal.SIGKILL
        assert '"event": "devices.zombie_reaped"' in log.read_text()
    finally:
        if zombie.poll() is None:
            zombie.kill()


@pytest.mark.e2e
def test_a_job_gives_its_gpu_back_when_training_wants_it_and_resumes_later_without_loss(
    tmp_path: Path,
    addition_tasks: Path,
    copy_checkpoint,
    monkeypatch: pytest.MonkeyPatch,
    hf_reference: tuple[Path, dict[str, Any]],
) -> None:
    """devices.yield_to_others: training starts on the GPU our eval uses; the eval stops,
    spends no attempt, waits while the GPU is held, then resumes from its journal."""
    ref, reference = hf_reference
    tmp = tmp_path / "gpu"
    nvml = tmp / "nvml.json"
    nvml.parent.mkdir()
    fake_nvml(nvml, [])
    monkeypatch.setenv("CKPT_WATCHER_FAKE_NVML", str(nvml))
    copy_checkpoint(tmp / "ckpts" / "r_step300", same_content=True)
    raw = base_config(tmp, tmp / "ckpts", addition_tasks, **HF)
    raw["devices"] = {"gpus": "all", "cpu_slots": 0, "yield_seconds": 2}
    cfg = write_config(tmp / "w.yaml", raw)
    log = tmp / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        job, _ = _cut_mid_task(tmp / "state", daemon, log)
        fake_nvml(nvml, [[4242, 30000, 97]])  # training starts on cuda:6
        assert job.pid is not None
        wait_for(lambda: not alive(job.pid), 60, "the eval stopped", daemon, log)
        st = wait_for(
            lambda: (s := status_json(cfg)[1]) and s["queue"] and s, 30, "requeued", daemon, log
        )
        (queued,) = st["queue"]
        assert st["running"] == [] and queued["attempt"] == 0, st
        assert queued["last_error"].startswith("yielded cuda:6 (30000 MiB held"), queued
        scans = st["sources"][0]["last_scan_at"]
        wait_for(lambda: status_json(cfg)[1]["sources"][0]["last_scan_at"] != scans, 30, "a scan")
        assert status_json(cfg)[1]["running"] == []  # the GPU stays training's while it holds it
        fake_nvml(nvml, [])  # training let go
        (line,) = wait_for(
            lambda: read_ledger(tmp / "ledgers", "r"), 300, "the resumed result", daemon, log
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    assert line["attempt"] == 1 and line["device"] == "cuda:6", line  # no attempt spent
    _same_as_uninterrupted(tmp, line, ref, reference)
    events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    (yielded,) = [e for e in events if e.get("event") == "eval.yielded"]
    assert yielded["device"] == "cuda:6" and yielded["job_id"] == job.id


def test_a_ray_node_without_nvml_uses_the_gpus_ray_counts_only_as_devices_gpus_names_them() -> None:
    """`devices.gpus: []` names no GPU: a node's agent that selects none must not fall back to
    the GPUs Ray counts there (used with no idle check). The fallback is for a node where NVML
    is absent, and keeps to the GPUs named."""
    from ckpt_watcher.executors.node_agent import ray_counted

    assert ray_counted([], nvml=False, ray_gpus=2) == []
    assert [d.label for d in ray_counted("all", nvml=False, ray_gpus=2)] == ["gpu0", "gpu1"]
    assert [d.label for d in ray_counted([1, 6], nvml=False, ray_gpus=2)] == ["gpu1"]
    assert ray_counted("all", nvml=True, ray_gpus=2) == []  # NVML there decides what is idle
