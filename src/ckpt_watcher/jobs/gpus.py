"""The daemon's watch over its devices: which are free for a job, GPUs given back when training
wants them, and zombies reported (or reaped).

NVML decides: a device is free when no job or helper of ours runs there and no other process
holds more than `devices.idle_memory_mib` on it (`devices.free_devices`). With
`devices.yield_to_others`, a GPU of ours that another process starts using is given back within
`devices.yield_seconds`: its job is stopped and queued again with no attempt spent, to resume
from its journal on the next free device; a warm engine waiting there for a job (or for its
checkpoint's weights, jobs/early.py) is released. Processes not ours that sit on GPU memory at 0%
utilisation are reported, and killed only with `devices.reap_foreign_zombies`.
"""

from __future__ import annotations

import structlog

from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.devices import Device, Inventory, ZombieWatch, foreign_busy, free_devices
from ckpt_watcher.executors.base import Executor
from ckpt_watcher.executors.processes import process_groups
from ckpt_watcher.jobs.helpers import Helpers
from ckpt_watcher.jobs.supervise import Supervisor
from ckpt_watcher.sinks.prometheus import DaemonMetrics
from ckpt_watcher.state import Job, State

log = structlog.get_logger("ckpt_watcher.daemon")


class Gpus:
    """Free devices, giving GPUs back, and zombies, for the daemon's loop."""

    def __init__(
        self,
        cfg: WatcherConfig,
        state: State,
        inventory: Inventory,
        executor: Executor,
        supervisor: Supervisor,
        helpers: Helpers,
        metrics: DaemonMetrics,
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.inventory = inventory
        self.executor = executor
        self.supervisor = supervisor
        self.helpers = helpers
        self.metrics = metrics
        self.zombies = ZombieWatch(cfg.devices.zombie_after_seconds)
        self.next_give_back = 0.0

    def free(self) -> list[Device]:
        """The devices a job may start on now."""
        running = self.state.jobs("running")
        return free_devices(
            self.inventory,
            in_use=[j.device for j in running if j.device] + self.helpers.device_ids(),
            our_pids=self.our_pids(running),
            idle_memory_mib=self.cfg.devices.idle_memory_mib,
        )

    def in_use(self) -> bool:
        """Some of our workers (jobs, helpers, or warm engines waiting for a job) are on a GPU."""
        devices = [d for d in self.inventory.devices() if d.kind == "cuda"]
        if not devices:
            return False  # CPU slots only: spare the loop's pass a query of the state
        gpus = {d.id for d in devices}
        used = {j.device for j in self.state.jobs("running")} | set(self.helpers.device_ids())
        waiting = self.executor.idle_engines().keys()
        return bool(gpus & used) or any(d.label in waiting for d in devices)

    def deadline(self) -> float | None:
        """When the loop must look again for GPUs to give back (None: nothing to watch)."""
        if self.cfg.devices.yield_to_others and self.in_use():
            return self.next_give_back
        return None

    def give_back(self, now: float) -> None:
        """devices.yield_to_others: stop our jobs and helpers on GPUs another process now
        uses; the device stays avoided while the other process holds it."""
        if not self.cfg.devices.yield_to_others or now < self.next_give_back:
            return
        if not self.in_use():
            return
        self.next_give_back = now + self.cfg.devices.yield_seconds / 2
        try:
            processes = self.inventory.gpu_processes()
        except Exception as e:  # NVML hiccup: look again next time
            log.warning("devices.query_failed", error=str(e))
            return
        running = self.state.jobs("running")
        busy = foreign_busy(processes, self.our_pids(running), self.cfg.devices.idle_memory_mib)
        if not busy:
            return
        labels = {d.id: d.label for d in self.inventory.devices()}
        for job_id in self.supervisor.give_back(busy, labels):
            job = self.state.job(job_id)
            if job is not None and job.device_label:
                self.metrics.yielded.labels(device=job.device_label).inc()
        self.helpers.give_back(busy)
        waiting = self.executor.idle_engines()
        for device_id, why in busy.items():
            label = labels.get(device_id)
            if label in waiting:  # a warm engine waiting for a job (or for its weights)
                log.warning("devices.yield", device=label, reason=why, engine="idle")
                self.executor.release(label)
                self.metrics.yielded.labels(device=label).inc()

    def our_pids(self, running: list[Job]) -> set[int]:
        """Our workers, their engine processes, and the warm workers waiting for a job."""
        leaders = {j.pid for j in running if j.pid} | self.executor.worker_pids()
        leaders |= self.helpers.pids()
        if not any(d.kind == "cuda" for d in self.inventory.devices()):
            return leaders  # no GPU processes to tell apart: spare the loop a scan of /proc
        return process_groups(leaders)

    def watch_zombies(self, now: float) -> None:
        """Report processes not ours that sit on GPU memory at 0% utilisation; kill them only
        if devices.reap_foreign_zombies is true. Publish each device's state for `watcher
        status` on the way (it needs the same look at the GPUs)."""
        try:
            processes = self.inventory.gpu_processes()
        except Exception as e:  # NVML hiccup: try again next heartbeat
            log.warning("devices.query_failed", error=str(e))
            return
        running = self.state.jobs("running")
        ours = self.our_pids(running)
        devices = self.inventory.devices()
        busy = foreign_busy(processes, ours, self.cfg.devices.idle_memory_mib)
        self._publish(devices, running, busy)
        labels = {d.id: d.label for d in devices}
        suspects = self.zombies.observe(processes, ours, labels, now)
        reap = self.cfg.devices.reap_foreign_zombies
        for z in suspects:
            if not z.new:
                continue
            log.warning(
                "devices.zombie_suspected",
                pid=z.pid,
                device=z.device,
                used_mib=z.used_mib,
                idle_s=z.idle_s,
                reaping=reap,
            )
            if reap:
                try:
                    self.inventory.reap(z.device_id, z.pid)
                    log.warning("devices.zombie_reaped", pid=z.pid, device=z.device)
                except (ProcessLookupError, PermissionError) as e:
                    log.error("devices.zombie_reap_failed", pid=z.pid, error=str(e))
        self.state.set_meta(
            suspected_zombies=[
                {"pid": z.pid, "device": z.device, "used_mib": z.used_mib, "idle_s": z.idle_s}
                for z in suspects
            ]
        )

    def _publish(self, devices: list[Device], running: list[Job], busy: dict[str, str]) -> None:
        """For `watcher status`: each device, and what it does (running a job, helping one,
        busy with processes not ours, free)."""
        jobs = {j.device: j.label for j in running if j.device}
        helping = {h.device.id: h.job_id for h in self.helpers.active.values()}
        rows = []
        for d in devices:
            if d.id in jobs:
                what = {"state": "running", "job": jobs[d.id]}
            elif d.id in helping:
                what = {"state": "helping", "job": helping[d.id]}
            elif d.id in busy:
                what = {"state": "busy", "why": busy[d.id]}
            else:
                what = {"state": "free"}
            rows.append({"device": d.label} | what)
        self.state.set_meta(devices=rows)
