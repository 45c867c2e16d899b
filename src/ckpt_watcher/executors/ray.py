"""Run each job as one Ray task (`num_gpus=1`) somewhere in a Ray cluster (multi-node).

The daemon stays the only scheduler and the only ledger writer: a Ray task runs
`python -m ckpt_watcher.worker` as a subprocess on whichever node Ray placed it (the subprocess
inherits the `CUDA_VISIBLE_DEVICES` Ray set), then returns the worker's outcome files and log to
the daemon, which writes them into the job's folder and settles the job as for a local worker.
A node that dies fails its job's attempt; the job is retried (elsewhere) like any failure.
Checkpoint and ledger folders must be on storage every node sees (EFS/NFS), or S3 sources used.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher import scratch
from ckpt_watcher.devices import Device, GpuProcess
from ckpt_watcher.errors import BackendUnavailable
from ckpt_watcher.executors.base import Executor, ExitCallback, WorkerHandle
from ckpt_watcher.jobfolder import WORKER_MODULE, JobFolder, JobSpec

log = structlog.get_logger("ckpt_watcher.executors.ray")


def _run_on_node(spec_json: str, job_id: str) -> Iterator[Any]:
    """Inside the Ray task: say which node this is, then run the worker in a scratch job folder
    and return what it wrote (a streaming generator: the node arrives before the result)."""
    import os
    import subprocess
    import sys
    import tempfile

    import ray

    yield ray.util.get_node_ip_address()
    scratch.sweep()  # what tasks killed on this node left (their job folders, their workers')
    with tempfile.TemporaryDirectory(prefix=scratch.task_prefix(job_id)) as tmp:
        folder = JobFolder(Path(tmp))
        folder.write_spec(JobSpec.from_json(spec_json))
        with open(folder.log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, str(folder)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(os.environ),
            )
            rc = proc.wait()
        scratch.remove(proc.pid)  # its temporary folder, with what a killed engine left there
        yield {
            "rc": rc,
            "files": folder.results(),
            "log": folder.log.read_text(errors="replace"),
        }


class RayExecutor(Executor):
    def __init__(self, on_exit: ExitCallback, address: str = "auto") -> None:
        try:
            import ray
        except ImportError as e:
            raise BackendUnavailable(
                "executor.kind is ray but Ray is not installed: pip install 'ckpt-watcher[ray]'"
            ) from e
        self._ray: Any = ray
        if not ray.is_initialized():
            ray.init(
                address=address,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        self._remote = ray.remote(num_gpus=1, max_retries=0, num_returns="streaming")(_run_on_node)
        self.on_exit = on_exit
        self._refs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.nodes: dict[str, str] = {}  # job id -> node, once known

    def slots(self) -> list[Device]:
        """One device per GPU Ray sees in the cluster (Ray places each task)."""
        gpus = int(self._ray.cluster_resources().get("GPU", 0))
        return [Device(f"ray:{i}", "cuda", "", f"ray:gpu{i}", "auto") for i in range(gpus)]

    def start(self, job_id: str, folder: JobFolder, env: dict[str, str]) -> WorkerHandle:
        ref = self._remote.options(name=job_id).remote(folder.spec_text(), job_id)
        with self._lock:
            self._refs[job_id] = ref
        threading.Thread(target=self._wait, args=(job_id, ref, folder), daemon=True).start()
        return WorkerHandle(job_id, 0, "ray")

    def _wait(self, job_id: str, ref: Any, folder: JobFolder) -> None:
        try:
            self.nodes[job_id] = str(self._ray.get(next(ref)))
            result = self._ray.get(next(ref))
        except Exception as e:  # the node died, the task was cancelled, Ray lost it
            folder.log.write_text(f"Ray task failed: {type(e).__name__}: {e}\n")
            rc = -9
        else:
            folder.put_results(result["files"])
            folder.log.write_text(f"[ran on node {self.nodes[job_id]}]\n" + result["log"])
            rc = int(result["rc"])
        with self._lock:
            self._refs.pop(job_id, None)
        self.on_exit(job_id, rc)

    def kill(self, job_id: str) -> None:
        with self._lock:
            ref = self._refs.get(job_id)
        if ref is not None:
            self._ray.cancel(ref, force=True)

    def where(self, job_id: str) -> str | None:
        """The node running a job, once its task has started."""
        return self.nodes.get(job_id)

    def running(self) -> set[str]:
        with self._lock:
            return set(self._refs)


class RayInventory:
    """Capacity of a Ray cluster: one slot per GPU it has; Ray places each task on a node."""

    def __init__(self, executor: RayExecutor) -> None:
        self.executor = executor

    def devices(self) -> list[Device]:
        return list(self.executor.slots())

    def gpu_processes(self) -> list[GpuProcess]:
        return []  # other nodes' GPUs are not visible to this host's NVML
