"""One agent per Ray node: that node's GPUs, its workers and its zombies, as on one host.

The daemon (executors/ray.py) places a `NodeAgent` actor on every alive node of the cluster.
The agent reads the node's GPUs through the node's NVML (or the node's `CKPT_WATCHER_FAKE_NVML`)
with the config's `devices` settings, reports the processes that are not ours on them (the
daemon applies the idle rule, gives GPUs back and names zombies with them, as on one host), and
runs each job it is handed as the local executors do: a one-shot worker, or the device's warm
worker that keeps its engine and swaps the next checkpoint's weights in. Each job's folder is a
temporary folder of the agent's on the node; the agent hands back the worker's outcome files
and log. Devices are named after the node (`node-a/cuda:6`); their ids carry the node's name
too, so two nodes' `cpu:0` or fake GPUs never meet.

S3 checkpoints are staged once per node: a job's worker stages into its source's `cache_dir` on
that node, where the node's next jobs of the checkpoint find it. The daemon keeps its own host's
cache in bounds; each agent keeps its node's within the source's `cache_max_gb` once a job
ends (least recently used first, sparing the copies of the jobs still running there).

Workers die with their agent (`DIE_WITH_PARENT_ENV`; those forked from the agent's worker
starter with the starter, which dies with the agent): a node that dies or an agent killed
takes its workers and their engines along, and the daemon retries those attempts on another
node, where they resume from the journals in `executor.shared_dir`. The agent starts every
worker from one thread that lives as long as it does: the kernel's parent-death signal follows
the thread that started the process, and Ray's method threads are not ours to keep.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ckpt_watcher import scratch
from ckpt_watcher.checkpoints.naming import safe_component
from ckpt_watcher.config import DevicesConfig
from ckpt_watcher.devices import Device, FileInventory, NvmlInventory, build_inventory
from ckpt_watcher.executors.base import Executor
from ckpt_watcher.executors.processes import process_groups
from ckpt_watcher.jobfolder import (
    DIE_WITH_PARENT_ENV,
    EARLY_META_DIR,
    PREPARE_DIR,
    JobFolder,
    JobSpec,
    Stage,
    warm_home,
)
from ckpt_watcher.sources.staging import evict, staged_path

NODE_SEP = "/"  # between a node's name and its device's: `node-a/cuda:6`


def on_node(node: str, name: str) -> str:
    """A device's id or label on `node`."""
    return f"{node}{NODE_SEP}{name}"


def node_of(name: str) -> str:
    """The node a device id or label of `on_node` names."""
    return name.split(NODE_SEP, 1)[0]


def ray_counted(wanted: Any, nvml: bool, ray_gpus: int) -> list[Device]:
    """The GPUs Ray counts on a node, for a node where NVML is absent, as `devices.gpus` names
    them (`all`, or indexes): none where NVML answered (it decides what is idle) or where the
    user named no GPU (`[]`)."""
    if nvml or not wanted or not ray_gpus:
        return []
    indexes = (
        range(ray_gpus)
        if wanted == "all"
        else [w for w in wanted if isinstance(w, int) and 0 <= w < ray_gpus]
    )
    return [Device(f"ray:{i}", "cuda", str(i), f"gpu{i}", "auto") for i in indexes]


class NodeAgent:
    """The node's devices and workers (a Ray actor: `executors/ray.py` places one per node)."""

    def __init__(self, node: str, settings: dict[str, Any]) -> None:
        """`settings`: devices (DevicesConfig's fields), warm, warm_idle_seconds,
        warm_verify_every, preload, caches (each S3 source's cache_dir -> its budget in
        bytes), ray_gpus (the GPUs Ray counts on this node, for a node with no NVML)."""
        self.node = node
        scratch.sweep()  # job folders and workers' folders that earlier agents here left
        self.home = Path(tempfile.mkdtemp(prefix=scratch.agent_prefix()))
        devices = DevicesConfig(**settings["devices"])
        inventory, self.warnings = build_inventory(devices)
        self.inventory = inventory
        self.local = inventory.devices()
        nvml = isinstance(inventory, NvmlInventory | FileInventory)
        ray_gpus = int(settings.get("ray_gpus") or 0)
        counted = ray_counted(devices.gpus, nvml, ray_gpus)
        if not nvml and isinstance(devices.gpus, list) and len(counted) < len(devices.gpus):
            self.warnings.append(
                f"no NVML on node {node}: of devices.gpus {devices.gpus}, only indexes below the "
                f"{ray_gpus} GPUs Ray counts there can be used (a UUID needs NVML)"
            )
        if counted:
            self.warnings.append(
                f"no NVML on node {node}: the {len(counted)} GPUs Ray counts there that "
                "devices.gpus names are used with no idle check (install the NVIDIA driver's "
                "NVML there)"
            )
            self.local += counted
        self._lock = threading.Lock()
        self._done: dict[str, threading.Event] = {}
        self._rc: dict[str, int] = {}
        self._pids: dict[str, int] = {}
        self._folders: dict[str, JobFolder] = {}
        self._staged: dict[str, Stage] = {}  # job -> the S3 checkpoint it stages here
        self.caches: dict[str, int] = dict(settings.get("caches") or {})
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-watcher-launcher")
        self.executor = self._launcher.submit(self._executor, settings).result()

    def _executor(self, settings: dict[str, Any]) -> Executor:
        """As on one host: warm workers or one-shot ones, forked from a worker starter of this
        agent's (`executor.preload`) that imported torch, transformers and lm-eval once."""
        preload = bool(settings.get("preload"))
        if settings.get("warm"):
            from ckpt_watcher.executors.warm import WarmExecutor

            return WarmExecutor(
                self._exited,
                self.home,
                idle_seconds=float(settings["warm_idle_seconds"]),
                verify_every=int(settings["warm_verify_every"]),
                preload=preload,
            )
        from ckpt_watcher.executors.local import LocalExecutor

        return LocalExecutor(self._exited, preload_in=self.home if preload else None)

    # --- what the daemon asks -------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The node's name, devices (as `Device` fields, named on this node) and warnings."""
        devices = [
            asdict(d) | {"id": on_node(self.node, d.id), "label": on_node(self.node, d.label)}
            for d in self.local
        ]
        return {
            "node": self.node,
            "pid": os.getpid(),
            "devices": devices,
            "warnings": self.warnings,
        }

    def foreign_processes(self) -> list[dict[str, Any]]:
        """Processes that are not our workers (nor their engines) holding memory on this node's
        GPUs, as `GpuProcess` fields with the device named on this node."""
        with self._lock:
            leaders = set(self._pids.values())
        ours = process_groups(leaders | self.executor.worker_pids())
        return [
            asdict(p) | {"device_id": on_node(self.node, p.device_id)}
            for p in self.inventory.gpu_processes()
            if p.pid not in ours
        ]

    def report(self) -> dict[str, Any]:
        """This node's warm engines, as `watcher status` lists a host's (their devices are
        named on this node already), and each running job's progress, as its worker wrote it
        here."""
        from ckpt_watcher.status import warm_engines

        with self._lock:
            folders = dict(self._folders)
        progress = {job: folder.progress() for job, folder in folders.items()}
        return {
            "engines": warm_engines(self.home),
            "progress": {job: asdict(p) for job, p in progress.items() if p is not None},
        }

    def start(self, job_id: str, spec_json: str, env: dict[str, str], where: str) -> int:
        """Start the job's worker in a folder of its own here, named as the daemon's is (`where`:
        `<job>/attempt-N`, or a helper's `<job>/attempt-N-help-<device>`); its pid."""
        job, attempt = (safe_component(part) for part in where.split("/"))
        folder = JobFolder(self.home / "jobs" / job / attempt)
        spec = JobSpec.from_json(spec_json)
        folder.write_spec(spec)
        with self._lock:
            self._folders[job_id] = folder
            self._done[job_id] = threading.Event()
            if spec.stage is not None:
                self._staged[job_id] = spec.stage
        env = env | {DIE_WITH_PARENT_ENV: str(os.getpid())}
        try:
            handle = self._launcher.submit(self.executor.start, job_id, folder, env).result()
        except BaseException:
            with self._lock:
                self._done.pop(job_id, None)
            raise
        with self._lock:
            if not self._done[job_id].is_set():  # (a worker that ended at once is no leader)
                self._pids[job_id] = handle.pid
        return handle.pid

    def wait(self, job_id: str) -> dict[str, Any]:
        """Once the job's worker has exited: its exit code, answer files and log."""
        with self._lock:
            done = self._done[job_id]
        done.wait()
        with self._lock:
            rc = self._rc.pop(job_id)
            self._done.pop(job_id, None)
            folder = self._folders.pop(job_id)
        out = {
            "rc": rc,
            "files": folder.results(),
            "log": folder.log.read_text(errors="replace") if folder.log.is_file() else "",
        }
        shutil.rmtree(folder.path, ignore_errors=True)
        try:
            folder.path.parent.rmdir()  # the job's, once its last attempt or helper here is done
        except OSError:
            pass
        return out

    def kill(self, job_id: str) -> None:
        self.executor.kill(job_id)

    def prepare(self, spec_json: str, env: dict[str, str], files: dict[str, bytes] | None) -> bool:
        """The device's warm worker here starts an engine ahead of its checkpoint's weights
        (executors/warm.py `prepare`) for the request `spec_json` (its device named on this
        node, as the daemon names it); False where that worker is busy. `files`: the config
        and tokenizer (or adapter) of an S3 step, as the daemon fetched them: written into a
        folder of this request's, which the request then names. The folders of the device's
        earlier requests go once its worker takes this one (an engine that served an adapter
        from one is replaced); this one goes if it is refused."""
        spec = JobSpec.from_json(spec_json)
        home = warm_home(self.home, spec.device_label)
        meta = None
        if files is not None:
            key = f"{spec.job_id}\n{spec.request.checkpoint}".encode()
            meta = home / EARLY_META_DIR / hashlib.sha256(key).hexdigest()[:16]
            shutil.rmtree(meta, ignore_errors=True)
            meta.mkdir(parents=True)
            for name, data in files.items():
                (meta / safe_component(name)).write_bytes(data)
            request = dataclasses.replace(spec.request, checkpoint=str(meta))
            spec = dataclasses.replace(spec, request=request)
        folder = JobFolder(home / PREPARE_DIR)
        folder.write_spec(spec)
        env = env | {DIE_WITH_PARENT_ENV: str(os.getpid())}
        taken = bool(
            self._launcher.submit(self.executor.prepare, spec.device_label, folder, env).result()
        )
        earlier = home / EARLY_META_DIR
        for old in sorted(earlier.iterdir()) if earlier.is_dir() else []:
            if (old == meta) != taken:  # this one refused, or an earlier one replaced
                shutil.rmtree(old, ignore_errors=True)
        return taken

    def idle_engines(self) -> dict[str, str | None]:
        """This node's warm workers that wait for a job, each with the run its engine holds."""
        return self.executor.idle_engines()

    def release(self, device_label: str) -> None:
        """Stop the device's idle warm worker (its GPU given back to training), and remove the
        files its engine was started on."""
        idle = device_label in self.executor.idle_engines()  # else a job of its runs there
        self._launcher.submit(self.executor.release, device_label).result()
        if idle:
            shutil.rmtree(warm_home(self.home, device_label) / EARLY_META_DIR, ignore_errors=True)

    def reap(self, device_id: str, pid: int) -> str | None:
        """Kill a zombie on this node (devices.reap_foreign_zombies), as the node's inventory
        does; why not, if it failed."""
        try:
            self.inventory.reap(device_id, pid)
        except (ProcessLookupError, PermissionError) as e:
            return str(e)
        return None

    def close(self) -> None:
        """The daemon stops: warm engines are released."""
        self._launcher.submit(self.executor.close).result()

    def _exited(self, job_id: str, rc: int) -> None:
        with self._lock:
            self._rc[job_id] = rc
            self._pids.pop(job_id, None)
            done = self._done.get(job_id)
            stage = self._staged.pop(job_id, None)
            running = list(self._staged.values())
        if done is not None:
            done.set()
        if stage is not None and stage.cache_dir in self.caches:
            keep = {
                staged_path(Path(s.cache_dir), s.location)
                for s in running
                if s.cache_dir == stage.cache_dir
            }
            try:
                evict(Path(stage.cache_dir), self.caches[stage.cache_dir], keep)
            except OSError:  # the cache folder is gone or unreadable: the next job's stage says
                pass
