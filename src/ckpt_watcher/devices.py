"""Device inventory: the GPUs (through NVML) and CPU slots evals may use, and which are busy.

A GPU is identified by its UUID end to end (`CUDA_VISIBLE_DEVICES` accepts UUIDs), so a
renumbering never sends an eval to training's GPU. A GPU is busy for us when processes that are
not our workers hold more than `idle_memory_mib` on it. `FakeInventory` stands in for NVML where
there is no GPU (tests, the demo).

CPU slots share the machine's cores: a worker on one gets `cores / slots` compute threads
(torch, OpenMP, MKL), unless the daemon's own environment sets them, so slots evaluating side
by side (or one task spread over them) never fight over cores.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog

from ckpt_watcher.config import DevicesConfig

log = structlog.get_logger("ckpt_watcher.devices")

# the compute thread counts torch and the math libraries under it read at start
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class Device:
    id: str  # stable identity: "cpu:0", or "gpu:<UUID>"
    kind: str  # cpu | cuda
    visible: str  # CUDA_VISIBLE_DEVICES for a worker on it ("" hides every GPU)
    label: str  # what users read: "cpu:0", "cuda:6"
    runs_on: str = ""  # where the worker computes: cuda, cpu (CPU slots, fake GPUs), auto (Ray)
    threads: int | None = None  # a CPU slot's share of the cores (None: the worker's default)

    @property
    def compute(self) -> str:
        return self.runs_on or ("cuda" if self.kind == "cuda" else "cpu")

    def worker_env(self, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
        """What a worker on this device adds to the daemon's environment: the GPU it may see
        and, on a CPU slot, its share of the cores (a thread count the daemon's environment
        sets is kept)."""
        env = {"CUDA_VISIBLE_DEVICES": self.visible}
        if self.threads is not None:
            env |= {var: str(self.threads) for var in THREAD_VARS if var not in environ}
        return env


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on one of our GPUs, as NVML reports it."""

    pid: int
    device_id: str
    used_mib: int
    util_percent: int | None  # streaming-multiprocessor use; None when NVML cannot say


class Inventory(Protocol):
    def devices(self) -> list[Device]: ...

    def gpu_processes(self) -> list[GpuProcess]:
        """Every compute process on the selected GPUs (ours included)."""
        ...

    def reap(self, device_id: str, pid: int) -> None:
        """SIGKILL a process on one of the devices (a zombie); raises ProcessLookupError or
        PermissionError as os.kill does."""
        ...


class ThisHost:
    """Inventories of this host's own devices: their processes are this host's."""

    def reap(self, device_id: str, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)


def device_kind(device_id: str) -> str:
    """A device's kind from its id (`cpu:N` for CPU slots; GPUs, fake or real, and Ray's
    slots are cuda)."""
    return "cpu" if device_id.startswith("cpu:") else "cuda"


def cpu_slots(n: int, cores: int | None = None) -> list[Device]:
    """`n` CPU slots, each with its share of `cores` (default: the cores this process may
    run on)."""
    cores = cores or len(os.sched_getaffinity(0))
    share = max(1, cores // n) if n else None
    return [Device(f"cpu:{i}", "cpu", "", f"cpu:{i}", threads=share) for i in range(n)]


def foreign_busy(
    processes: Iterable[GpuProcess], our_pids: set[int], idle_memory_mib: int
) -> dict[str, str]:
    """Device id -> why it is busy: processes that are not our workers hold more than
    `idle_memory_mib` on it (training, someone's notebook, a zombie)."""
    held: dict[str, int] = {}
    for p in processes:
        if p.pid not in our_pids:
            held[p.device_id] = held.get(p.device_id, 0) + p.used_mib
    return {
        dev: f"{mib} MiB held by other processes (training?)"
        for dev, mib in held.items()
        if mib > idle_memory_mib
    }


@dataclass
class FakeGpu:
    index: int
    uuid: str
    # (pid, MiB, utilisation %) of processes that are not ours
    foreign: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class FakeInventory(ThisHost):
    """An in-memory GPU inventory for tests and machines without GPUs: its "GPUs" are
    scheduled like real ones (by UUID, busy when others hold memory) but workers compute on
    the CPU."""

    gpus: list[FakeGpu] = field(default_factory=list)
    cpu: int = 0

    def devices(self) -> list[Device]:
        gpus = [
            Device(f"gpu:{g.uuid}", "cuda", g.uuid, f"cuda:{g.index}", "cpu") for g in self.gpus
        ]
        return gpus + cpu_slots(self.cpu)

    def gpu_processes(self) -> list[GpuProcess]:
        return [
            GpuProcess(pid, f"gpu:{g.uuid}", mib, util)
            for g in self.gpus
            for pid, mib, util in g.foreign
        ]


def select_gpus(
    present: list[tuple[int, str]], wanted: str | list[int | str]
) -> list[tuple[int, str]]:
    """The GPUs (index, UUID) of `present` that `devices.gpus` names: `all`, or a list of
    indexes and UUIDs (one that is not here is an error)."""
    if wanted == "all":
        return present
    chosen = []
    for w in wanted:
        match = [g for g in present if g[0] == w or g[1] == w]
        if not match:
            raise ValueError(f"devices.gpus names {w!r}, but this machine has GPUs {present}")
        chosen.extend(match)
    return chosen


class FileInventory(ThisHost):
    """A fake NVML read from a JSON file on every call, so a test can change it live:
    {"gpus": [{"index": 6, "uuid": "GPU-a", "foreign": [[pid, mib, util], ...]}]}, of which
    `devices.gpus` selects as it does of the real ones. Selected with
    CKPT_WATCHER_FAKE_NVML=<file> (testing and demos only)."""

    def __init__(self, path: Path, cpu: int = 0, gpus: str | list[int | str] = "all") -> None:
        self.path = path
        self.cpu = cpu
        self.wanted = gpus

    def _load(self) -> FakeInventory:
        data = json.loads(self.path.read_text())
        chosen = set(select_gpus([(g["index"], g["uuid"]) for g in data["gpus"]], self.wanted))
        gpus = [
            FakeGpu(g["index"], g["uuid"], [tuple(x) for x in g.get("foreign", [])])
            for g in data["gpus"]
            if (g["index"], g["uuid"]) in chosen
        ]
        return FakeInventory(gpus, self.cpu)

    def devices(self) -> list[Device]:
        return self._load().devices()

    def gpu_processes(self) -> list[GpuProcess]:
        return self._load().gpu_processes()


class NvmlInventory(ThisHost):
    """The real GPUs, through nvidia-ml-py, restricted to `devices.gpus`; plus CPU slots."""

    def __init__(self, cfg: DevicesConfig) -> None:
        import pynvml

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        self.cfg = cfg
        self._gpus = self._select(cfg.gpus)

    def _select(self, wanted: str | list[int | str]) -> list[tuple[int, str]]:
        n = self._nvml.nvmlDeviceGetCount()
        all_gpus = []
        for i in range(n):
            h = self._nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = self._nvml.nvmlDeviceGetUUID(h)
            all_gpus.append((i, uuid.decode() if isinstance(uuid, bytes) else uuid))
        return select_gpus(all_gpus, wanted)

    def devices(self) -> list[Device]:
        gpus = [Device(f"gpu:{u}", "cuda", u, f"cuda:{i}") for i, u in self._gpus]
        return gpus + cpu_slots(self.cfg.cpu_slots)

    def gpu_processes(self) -> list[GpuProcess]:
        out = []
        for _index, uuid in self._gpus:
            h = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
            util: dict[int, int] = {}
            try:
                for sample in self._nvml.nvmlDeviceGetProcessUtilization(h, 0):
                    util[sample.pid] = max(util.get(sample.pid, 0), sample.smUtil)
            except self._nvml.NVMLError:
                util = {}  # not supported on this GPU/driver, or no samples yet
            for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(h):
                mib = (p.usedGpuMemory or 0) >> 20
                out.append(
                    GpuProcess(p.pid, f"gpu:{uuid}", mib, util.get(p.pid, 0 if util else None))
                )
        return out


def build_inventory(cfg: DevicesConfig) -> tuple[Inventory, list[str]]:
    """The inventory for a config, and warnings to show (e.g. NVML missing)."""
    warnings: list[str] = []
    fake = os.environ.get("CKPT_WATCHER_FAKE_NVML")
    if fake:
        warnings.append(f"using the fake GPU inventory in {fake} (CKPT_WATCHER_FAKE_NVML)")
        return FileInventory(Path(fake), cfg.cpu_slots, cfg.gpus), warnings
    if cfg.gpus == [] or cfg.gpus is None:
        return FakeInventory(cpu=cfg.cpu_slots), warnings
    try:
        return NvmlInventory(cfg), warnings
    except Exception as e:  # no driver, no library: CPU slots still work
        warnings.append(
            f"NVML unavailable ({type(e).__name__}: {e}); no GPU will be used. "
            "Install the NVIDIA driver, or set devices.gpus: [] and devices.cpu_slots"
        )
        return FakeInventory(cpu=cfg.cpu_slots), warnings


def free_devices(
    inv: Inventory, in_use: Iterable[str], our_pids: set[int], idle_memory_mib: int
) -> list[Device]:
    """Devices neither running one of our jobs nor held by foreign processes."""
    taken = set(in_use)
    busy = foreign_busy(inv.gpu_processes(), our_pids, idle_memory_mib)
    return [d for d in inv.devices() if d.id not in taken and d.id not in busy]


@dataclass(frozen=True)
class Suspect:
    """A process not ours that has held GPU memory at 0% utilisation for `idle_s` seconds."""

    pid: int
    device: str  # the device's label
    used_mib: int
    idle_s: int
    new: bool  # first time reported
    device_id: str = ""  # the device's id (which node's, under Ray)


class ZombieWatch:
    """Remembers since when each foreign process has sat idle on a GPU; `observe` names those
    idle for `after_seconds` or more (each reported as `new` once). Killing is the caller's
    decision (devices.reap_foreign_zombies)."""

    def __init__(self, after_seconds: float) -> None:
        self.after_seconds = after_seconds
        self._idle_since: dict[tuple[int, str], float] = {}
        self._reported: set[tuple[int, str]] = set()

    def observe(
        self, processes: Iterable[GpuProcess], ours: set[int], labels: dict[str, str], now: float
    ) -> list[Suspect]:
        idle_now = {
            (p.pid, p.device_id): p
            for p in processes
            if p.pid not in ours and p.used_mib > 0 and p.util_percent == 0
        }
        self._idle_since = {k: self._idle_since.get(k, now) for k in idle_now}
        out = []
        for key, since in self._idle_since.items():
            if now - since < self.after_seconds:
                continue
            p = idle_now[key]
            new = key not in self._reported
            self._reported.add(key)
            out.append(
                Suspect(
                    p.pid,
                    labels.get(p.device_id, p.device_id),
                    p.used_mib,
                    round(now - since),
                    new,
                    p.device_id,
                )
            )
        return out
