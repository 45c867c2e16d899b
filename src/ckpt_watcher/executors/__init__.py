"""Executors start a worker process for a job on a device, report its exit, and kill it."""

from __future__ import annotations

from collections.abc import Callable

from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.devices import Inventory
from ckpt_watcher.executors.base import Executor, ExitCallback


def build_executor(
    cfg: WatcherConfig, on_exit: ExitCallback, wake: Callable[[], None] = lambda: None
) -> tuple[Executor, Inventory | None]:
    """The executor for `executor.kind`, and the device inventory it brings (Ray: the
    cluster's nodes' GPUs, through an agent on each), or None to use this host's (NVML, CPU
    slots). `wake` wakes the daemon's loop (the worker starter is ready)."""
    if cfg.executor.kind == "ray":
        from ckpt_watcher.executors.ray import RayExecutor, RayInventory

        ray = RayExecutor(on_exit, cfg)
        return ray, RayInventory(ray)
    preload_in = cfg.state_dir if cfg.forks_workers else None
    if cfg.eval.warm:
        from ckpt_watcher.executors.warm import WarmExecutor

        warm = WarmExecutor(
            on_exit,
            cfg.state_dir,
            idle_seconds=cfg.eval.warm_idle_seconds,
            verify_every=cfg.eval.warm_verify_every,
            preload=cfg.forks_workers,
            wake=wake,
        )
        return warm, None
    from ckpt_watcher.executors.local import LocalExecutor

    return LocalExecutor(on_exit, preload_in=preload_in, wake=wake), None
