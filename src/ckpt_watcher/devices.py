"""Device inventory: the GPUs (through NVML) and CPU slots evals may use, and which are busy.

A GPU is identified by its UUID end to end (`CUDA_VISIBLE_DEVICES` accepts UUIDs), so a
renumbering never sends an eval to training's GPU. A GPU is busy for us when processes that are
not our workers hold more than `idle_memory_mib` on it. `FakeInventory` stands in for NVML where
there is no GPU (tests, the demo).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from ckpt_watcher.config import DevicesConfig

log = structlog.get_logger("ckpt_watcher.devices")


@dataclass(frozen=True)
class Device:
    id: str  # stable identity: "cpu:0", or "gpu:<UUID>"
    kind: str  # cpu | cuda
    visible: str  # CUDA_VISIBLE_DEVICES for a worker on it ("" hides every GPU)
    label: str  # what users read: "cpu:0", "cuda:6"


class Inventory(Protocol):
    def devices(self) -> list[Device]: ...

    def foreign_busy(self, our_pids: set[int]) -> dict[str, str]:
        """Device id -> why it is busy with processes not ours."""
        ...


def cpu_slots(n: int) -> list[Device]:
    return [Device(f"cpu:{i}", "cpu", "", f"cpu:{i}") for i in range(n)]


@dataclass
class FakeGpu:
    index: int
    uuid: str
    foreign_mib: int = 0  # memory held by processes that are not ours


@dataclass
class FakeInventory:
    """An in-memory GPU inventory (plus CPU slots) for tests and machines without GPUs."""

    gpus: list[FakeGpu] = field(default_factory=list)
    cpu: int = 0
    idle_memory_mib: int = 1024

    def devices(self) -> list[Device]:
        gpus = [Device(f"gpu:{g.uuid}", "cuda", g.uuid, f"cuda:{g.index}") for g in self.gpus]
        return gpus + cpu_slots(self.cpu)

    def foreign_busy(self, our_pids: set[int]) -> dict[str, str]:
        return {
            f"gpu:{g.uuid}": f"{g.foreign_mib} MiB held by other processes"
            for g in self.gpus
            if g.foreign_mib > self.idle_memory_mib
        }


class NvmlInventory:
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
        if wanted == "all":
            return all_gpus
        chosen = []
        for w in wanted:
            match = [g for g in all_gpus if g[0] == w or g[1] == w]
            if not match:
                raise ValueError(f"devices.gpus names {w!r}, but this machine has GPUs {all_gpus}")
            chosen.extend(match)
        return chosen

    def devices(self) -> list[Device]:
        gpus = [Device(f"gpu:{u}", "cuda", u, f"cuda:{i}") for i, u in self._gpus]
        return gpus + cpu_slots(self.cfg.cpu_slots)

    def foreign_busy(self, our_pids: set[int]) -> dict[str, str]:
        busy = {}
        for _index, uuid in self._gpus:
            h = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(h)
            held = sum((p.usedGpuMemory or 0) for p in procs if p.pid not in our_pids) >> 20
            if held > self.cfg.idle_memory_mib:
                busy[f"gpu:{uuid}"] = f"{held} MiB held by other processes (training?)"
        return busy


def build_inventory(cfg: DevicesConfig) -> tuple[Inventory, list[str]]:
    """The inventory for a config, and warnings to show (e.g. NVML missing)."""
    warnings: list[str] = []
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


def free_devices(inv: Inventory, in_use: Iterable[str], our_pids: set[int]) -> list[Device]:
    """Devices neither running one of our jobs nor held by foreign processes."""
    taken = set(in_use)
    busy = inv.foreign_busy(our_pids)
    return [d for d in inv.devices() if d.id not in taken and d.id not in busy]
