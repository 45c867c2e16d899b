"""Two Ray nodes as good as one host: a real cluster of two raylets on this machine, each with
its own fake NVML file, one agent per node, a local folder and an S3 prefix watched. No job
lands on a GPU that training holds; each node keeps its warm workers; a zombie on the second
node is reaped there; a job whose GPU training takes yields and resumes on the other node; a
remote job's progress shows in status; a node that dies mid-task fails only its attempt, which
is retried saying so and resumes on the other node from the shared journal; a node that
(re)joins, with no NVML this time, offers the GPU its raylet declares and is used at once, for
a checkpoint from S3; its dead predecessor's agent folder is swept. A new run's first step,
written config first, finds an engine started ahead on a node's free GPU, and is served by it."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher import scratch
from ckpt_watcher.executors.node_agent import node_of
from ckpt_watcher.jobfolder import ENGINE_FILE
from ckpt_watcher.s3client import make_client

from .conftest import (
    CHUNK,
    HF,
    RESPONSES,
    TwoNodes,
    base_config,
    read_ledger,
    s3_source,
    upload_dir,
    write_config,
)
from .helpers import Throttle, alive, status_json, wait_for, watcher_run

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed"),
]

TRAINING = [4242, 30000, 95]  # a training process on a GPU: pid, MiB, utilisation


def nvml(path: Path, gpus: dict[int, list[list[int]]], node: str) -> None:
    """A node's fake NVML: its GPUs by index, each with the processes not ours on it."""
    data = {
        "gpus": [
            {"index": i, "uuid": f"GPU-{node}-{i}", "foreign": foreign}
            for i, foreign in gpus.items()
        ]
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def warm_workers() -> dict[int, str]:
    """The live warm workers the nodes' agents keep: pid -> their device, as each says in its
    home's engine.json (the agent's home: `ckpt-watcher-task-<agent pid>-agent-*`)."""
    out = {}
    for path in Path(tempfile.gettempdir()).glob(
        f"{scratch.TASK_PREFIX}*-agent-*/jobs/_warm/*/{ENGINE_FILE}"
    ):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        pid = int(data.get("pid") or 0)
        if pid and data.get("state") != "released" and alive(pid):
            out[pid] = str(data["device"])
    return out


def worker_of(device_label: str) -> int | None:
    return next((p for p, d in warm_workers().items() if d == device_label), None)


def home_of(worker: int | None) -> Path | None:
    """The folder of the node agent whose warm worker `worker` is
    (`ckpt-watcher-task-<agent pid>-agent-*`)."""
    for path in Path(tempfile.gettempdir()).glob(
        f"{scratch.TASK_PREFIX}*-agent-*/jobs/_warm/*/{ENGINE_FILE}"
    ):
        try:
            if int(json.loads(path.read_text()).get("pid") or 0) == worker:
                return path.parents[3]
        except (OSError, ValueError):
            continue
    return None


def journaled(root: Path) -> int:
    """Responses kept in the journals under `root` (each file's lines but its header)."""
    return sum(
        max(0, len(f.read_bytes().splitlines()) - 1) for f in root.glob("*/journals/*/*.jsonl")
    )


def running(cfg: Path, label: str) -> dict[str, Any] | None:
    st = status_json(cfg)[1]
    return next((r for r in (st or {}).get("running", []) if r["label"] == label), None)


def shown_free(cfg: Path) -> int:
    devices = (status_json(cfg)[1] or {}).get("devices") or []
    return sum(d["state"] == "free" for d in devices)


@contextlib.contextmanager
def slowed() -> Iterator[None]:
    """The warm workers there are run slowed meanwhile (a warm worker's task takes seconds; a
    warm worker started meanwhile imports torch and loads its model first, unslowed)."""
    throttles = {pid: Throttle(pid, share=0.1, group=False) for pid in warm_workers()}
    try:
        yield
    finally:
        for pid, t in throttles.items():
            t.stop()
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile: nothing to resume
                os.kill(pid, signal.SIGCONT)


def cut(
    appear: Callable[[], object], label: str, cfg: Path, shared: Path, daemon: Any, log: Path
) -> tuple[dict, int]:
    """Make the checkpoint `label` appear and freeze its job once more than a chunk of it is
    journaled: its status row and the responses journaled. The warm workers there are run
    slowed beforehand (a warm worker's task takes seconds, and another device may join it as
    a helper); at the cut every warm worker stops, and all but the job's own go on."""
    throttles = [Throttle(pid, share=0.1, group=False) for pid in warm_workers()]
    before = journaled(shared)
    try:
        appear()
        done = wait_for(
            lambda: (n := journaled(shared) - before) > CHUNK and n,
            300,
            "part done",
            daemon,
            log,
            every=0.02,
        )
    finally:
        for t in throttles:
            t.stop()  # left frozen
        for pid in warm_workers():  # and those started meanwhile
            os.kill(pid, signal.SIGSTOP)
    row = wait_for(
        lambda: (r := running(cfg, label)) and r["node"] and r, 60, f"{label} placed", daemon, log
    )
    assert row["node"] == node_of(row["device"]), row  # status says where it runs
    worker = worker_of(row["device"])
    for pid in set(warm_workers()) - {worker}:
        os.kill(pid, signal.SIGCONT)
    assert worker is not None and done < RESPONSES, (worker, done)
    return row, done


def _released(log: Path) -> bool:
    """An idle warm engine was given back to training (the head's GPU 0, taken)."""
    return any(
        '"devices.yield"' in line and '"engine": "idle"' in line and "/cuda:0" in line
        for line in log.read_text().splitlines()
    )


def test_two_nodes_idle_gpus_warm_engines_zombies_a_yield_and_a_lost_node(
    tmp_path: Path,
    ray_two_nodes: TwoNodes,
    addition_tasks: Path,
    copy_checkpoint,
    hf_reference: tuple[Path, dict[str, Any]],
    s3_endpoint: str,
    bucket: str,
) -> None:
    _, reference = hf_reference
    head, second = ray_two_nodes.nvml
    zombie = subprocess.Popen(["sleep", "600"])  # holds 500 MiB at 0%: under the idle limit
    nvml(head, {0: [], 1: [TRAINING]}, "head")  # the head's GPU 1 is training's
    nvml(second, {6: [[zombie.pid, 500, 0]]}, "second")
    watch, shared = tmp_path / "ckpts", tmp_path / "efs"
    for step in (100, 200, 300):
        copy_checkpoint(watch / f"r_step{step}")
    raw = base_config(tmp_path, watch, addition_tasks, **HF, warm_engine=True)
    raw["sources"].append(
        s3_source(f"s3://{bucket}/ray/", tmp_path / "cache", endpoint_url=s3_endpoint)
    )
    raw["executor"] = {"kind": "ray", "address": ray_two_nodes.address, "shared_dir": str(shared)}
    raw["devices"] = {
        "gpus": "all",
        "yield_seconds": 2,
        "zombie_after_seconds": 1,
        "reap_foreign_zombies": True,
    }
    cfg = write_config(tmp_path / "w.yaml", raw)
    log = tmp_path / "daemon.log"

    def result_of(step: int, what: str) -> dict[str, Any]:
        """The step's ledger line, once it is in (while the daemon runs)."""

        def lines() -> list[dict[str, Any]]:
            return [ln for ln in read_ledger(tmp_path / "ledgers", "r") if ln["step"] == step]

        return wait_for(lines, 300, what, daemon, log)[0]

    try:
        with watcher_run(cfg, log) as daemon:
            first = wait_for(
                lambda: len(ls := read_ledger(tmp_path / "ledgers", "r")) >= 3 and ls,
                400,
                "3 results",
                daemon,
                log,
            )
            wait_for(lambda: zombie.poll() is not None, 60, "the zombie reaped", daemon, log)
            # every node's devices in watcher status (at its next heartbeat), training's busy
            want = {"cuda:0": "free", "cuda:1": "busy", "cuda:6": "free"}

            def shown() -> list[dict[str, Any]] | None:
                devices = (status_json(cfg)[1] or {}).get("devices") or []
                states = {d["device"].split("/")[1]: d["state"] for d in devices}
                return devices if states == want and len(devices) == 3 else None

            devices = wait_for(shown, 30, f"status to show {want}", daemon, log)
            assert len({d["device"].split("/")[0] for d in devices}) == 2, devices
            engines = wait_for(
                lambda: (st := status_json(cfg)[1]) and st["warm_engines"],
                30,
                "the nodes' warm engines in status",
                daemon,
                log,
            )
            assert sorted(e["device"].split("/")[1] for e in engines) == ["cuda:0", "cuda:6"]
            assert all(e["state"] == "idle" and e["checkpoint"] for e in engines), engines
            # weights swapped into a kept engine: the third job's (and a helper's, whose device
            # joined the last running job once its own was done)
            assert sum(e["swaps"] for e in engines) >= 1, engines

            # training takes the GPU a job runs on: it yields, and resumes on the other node
            row, done = cut(
                lambda: copy_checkpoint(watch / "r_step400"), "r_step400", cfg, shared, daemon, log
            )
            taken = row["device"]
            if taken.endswith("/cuda:6"):
                nvml(second, {6: [TRAINING]}, "second")
            else:  # training grows onto the head's GPU 0 too
                nvml(head, {0: [TRAINING], 1: [TRAINING]}, "head")
            yielded = result_of(400, "the yielded job's result")

            # one GPU free on each node: the second joins the first's task (a helper there)
            nvml(second, {6: []}, "second")
            nvml(head, {0: [], 1: [TRAINING]}, "head")
            wait_for(lambda: shown_free(cfg) == 2, 30, "both GPUs free", daemon, log)
            with slowed():  # both warm workers: the task lasts while the helper joins
                copy_checkpoint(watch / "r_step450")
                spread = result_of(450, "the spread task's result")

            # the second node dies mid-task: its attempt resumes on the head
            nvml(second, {6: []}, "second")
            nvml(head, {0: [TRAINING], 1: [TRAINING]}, "head")  # so the job goes to the second
            row, done_lost = cut(
                lambda: copy_checkpoint(watch / "r_step500"), "r_step500", cfg, shared, daemon, log
            )
            assert row["device"].endswith("/cuda:6"), row
            # its worker writes its progress on its own node: status shows it all the same
            # (as of the daemon's last heartbeat, and of the worker's last progress write,
            # once a second: a worker frozen right after a chunk may not have written it yet)
            progress = wait_for(
                lambda: (
                    (p := (running(cfg, "r_step500") or {}).get("progress")) and p["done"] > 0 and p
                ),
                30,
                "the remote job's progress in status",
                daemon,
                log,
            )
            assert progress["task"] == "addition" and progress["done"] < RESPONSES, progress
            lost_worker = worker_of(row["device"])
            lost_home = home_of(lost_worker)  # its node's agent's folder
            nvml(head, {0: [], 1: [TRAINING]}, "head")
            os.kill(ray_two_nodes.raylet[1], signal.SIGKILL)  # the second node's raylet
            resumed = result_of(500, "the lost node's job's result")
            assert lost_worker is not None and not alive(lost_worker)  # went with its agent

            # the node is back (a new raylet), with no NVML this time: the GPU its raylet
            # declares is used at once, for a checkpoint on S3 its agent stages there
            ray_two_nodes.start_second(nvml=False)
            nvml(head, {0: [TRAINING], 1: [TRAINING]}, "head")
            upload_dir(
                make_client(s3_endpoint), copy_checkpoint(tmp_path / "s3" / "r_step600"), bucket,
                "ray/r_step600/",
            )  # fmt: skip
            back = result_of(600, "a job on the node that came back")

            # a new run's first step, written as a trainer writes it (config and tokenizer
            # first): the head's GPU 0, free again and its warm worker given back to training
            # meanwhile, starts an engine for the run before its weights exist; they are
            # swapped in once written
            wait_for(lambda: _released(log), 30, "the head's idle engine given back", daemon, log)
            nvml(head, {0: [], 1: [TRAINING]}, "head")
            written = copy_checkpoint(tmp_path / "written" / "q_step100")
            step = watch / "q_step100"
            step.mkdir()
            weights = [f for f in sorted(written.iterdir()) if ".safetensors" in f.name]
            for f in sorted(set(written.iterdir()) - set(weights)):
                shutil.copy(f, step / f.name)
            ahead = wait_for(
                lambda: [
                    e for e in (status_json(cfg)[1] or {}).get("warm_engines") or []
                    if e.get("ready_for") == "q" and e["state"] == "ready"
                ],
                120,
                "an engine ready for run q on a node",
                daemon,
                log,
            )  # fmt: skip
            assert not read_ledger(tmp_path / "ledgers", "q")
            for f in weights:
                shutil.copy(f, step / f.name)
            (early,) = wait_for(
                lambda: read_ledger(tmp_path / "ledgers", "q"), 120, "run q's result", daemon, log
            )
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(timeout=60) == 0
    finally:
        zombie.kill()
    events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    joined = {e["node"]: e["devices"] for e in events if e.get("event") == "ray.node_joined"}
    # the head, the second node, the second node again (a new raylet: another node, no NVML)
    assert sorted(sorted(d.split("/")[1] for d in ds) for ds in joined.values()) == [
        ["cuda:0", "cuda:1"],
        ["cuda:6"],
        ["gpu0"],
    ], joined
    (warned,) = [e for e in events if "no NVML on node" in e.get("message", "")]
    assert "1 GPUs Ray counts there" in warned["message"], warned
    # training's GPU was never used; every result is the checkpoint's own
    lines = read_ledger(tmp_path / "ledgers", "r")
    assert sorted(ln["step"] for ln in lines) == [100, 200, 300, 400, 450, 500, 600]  # once each
    assert all(ln["status"] == "ok" for ln in lines), lines
    assert not any(ln["device"].endswith("/cuda:1") for ln in lines), lines
    assert all(ln["metrics"] == reference["metrics"] for ln in lines)
    # each device's first job started its warm worker, the next ones swapped weights in
    by_device: dict[str, list[str]] = {}
    for ln in sorted(first, key=lambda ln: ln["started_at"]):
        by_device.setdefault(ln["device"], []).append(ln["engine"])
    # (or an engine started ahead, while the first steps settled)
    assert all(e[0] in ("cold", "early") and set(e[1:]) <= {"warm"} for e in by_device.values()), (
        by_device
    )
    assert any(len(e) > 1 for e in by_device.values()), by_device
    # the zombie was found on the second node's GPU and killed there
    (reaped,) = [e for e in events if e.get("event") == "devices.zombie_reaped"]
    assert reaped["device"].endswith("/cuda:6") and reaped["pid"] == zombie.pid
    # given back to training: no attempt spent, resumed on the other node from the journal
    assert yielded["attempt"] == 1 and yielded["device"] != taken, (yielded, taken)
    assert yielded["resumed"] >= done - CHUNK, (yielded, done)
    (gave,) = [e for e in events if e.get("event") == "eval.yielded"]
    assert gave["device"] == taken
    # one task over both nodes' GPUs: the same numbers as one device's
    assert spread["attempt"] == 1 and spread["resumed"] == 0, spread
    assert len({d.split("/")[0] for d in spread["devices"]}) == 2, spread["devices"]
    # the lost node: one attempt failed, the next resumed on the head
    assert resumed["attempt"] == 2 and resumed["device"].endswith("/cuda:0"), resumed
    # the engine started ahead on a node served the run's first step, its own numbers
    assert early["engine"] == "early" and early["device"] == ahead[0]["device"], (early, ahead)
    assert early["device"].endswith("/cuda:0") and early["metrics"] == reference["metrics"]
    assert resumed["resumed"] >= done_lost - CHUNK, (resumed, done_lost)
    lost = [e["node"] for e in events if e.get("event") == "ray.node_lost"]
    assert lost and back["device"].endswith("/gpu0") and node_of(back["device"]) not in lost
    assert back["checkpoint"] == f"s3://{bucket}/ray/r_step600/", back
    # the lost node's agent folder, swept by the agent placed when the node came back
    assert lost_home is not None and not lost_home.exists(), lost_home
    # retried for what happened: its node was lost (not a signal, not the OOM killer)
    (retry,) = [e for e in events if e.get("event") == "eval.retry"]
    assert f"node {lost[0]} was lost" in retry["reason"] and "OOM" not in retry["reason"], retry
    assert journaled(shared) == 0
