"""The daemon loop: wake (poll tick, inotify, worker exit, signal) -> scan -> check -> plan ->
dispatch -> collect -> ledger.

Crash-safe order for one job: (1) the job row goes `running` (commit) before its worker starts;
(2) the worker writes each task's outcome file (tmp + fsync + rename); (3) the daemon appends
the ledger line (fsync), then marks the job `ok`. On start, ledger `ok` lines win over job
states, workers left by an earlier instance are killed and their jobs re-queued, and outcome
files they finished are harvested first, so nothing is lost and nothing is appended twice.
The daemon never imports torch, vLLM or lm-eval: evals run in worker processes.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog
import yaml

from ckpt_watcher import ledger as ledger_mod
from ckpt_watcher import scheduler
from ckpt_watcher.checkpoints import completeness
from ckpt_watcher.config import LocalSource as LocalSourceConfig
from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.devices import Device, GpuProcess, Inventory, build_inventory, free_devices
from ckpt_watcher.errors import ConfigError, NamingFixError, WatcherError
from ckpt_watcher.executors.base import WORKER_MODULE, Executor, is_our_worker
from ckpt_watcher.executors.local import LocalExecutor, kill_group
from ckpt_watcher.ledger import LedgerIndex, result_key
from ckpt_watcher.mirror import LedgerMirror
from ckpt_watcher.notify import Notifier
from ckpt_watcher.sources.base import Found, Source, diff
from ckpt_watcher.sources.local import LocalSource
from ckpt_watcher.sources.s3 import S3Source
from ckpt_watcher.state import Job, State

log = structlog.get_logger("ckpt_watcher.daemon")

HEARTBEAT_SECONDS = 2.0
LOG_TAIL_LINES = 25
# Checkpoint states that a fresh scan re-examines (the writer may still change them).
_RECHECK = ("incomplete", "invalid")
# States in which a vanished checkpoint counts as missed (it was never evaluated).
_MISSABLE = ("incomplete", "invalid", "ready", "planned")


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class RayInventory:
    """Capacity of a Ray cluster: one slot per GPU it has; Ray places each task on a node."""

    def __init__(self, executor: Any) -> None:
        self.executor = executor

    def devices(self) -> list[Device]:
        return list(self.executor.slots())

    def gpu_processes(self) -> list[GpuProcess]:
        return []  # other nodes' GPUs are not visible to this host's NVML


def build_sources(cfg: WatcherConfig) -> list[Source]:
    out: list[Source] = []
    for s in cfg.sources:
        if isinstance(s, LocalSourceConfig):
            out.append(LocalSource(s.path, s.poll_seconds, s.max_depth, s.inotify))
        else:
            out.append(
                S3Source(
                    s.uri,
                    s.poll_seconds,
                    s.endpoint_url,
                    cache_dir=s.cache_dir,
                    keep_staged=s.keep_staged,
                    cache_max_gb=s.cache_max_gb,
                )
            )
    return out


def job_dir(state_dir: Path, job_id: str, attempt: int) -> Path:
    return state_dir / "jobs" / job_id / f"attempt-{attempt}"


def find_stray_workers(state_dir: Path) -> list[int]:
    """PIDs of worker processes started for this state_dir (by any earlier daemon instance)."""
    prefix = str(state_dir / "jobs").encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if WORKER_MODULE.encode() in argv and any(a.startswith(prefix) for a in argv):
            pids.append(int(entry.name))
    return pids


@dataclass
class _SourceRuntime:
    source: Source
    snapshot: dict[str, Found] = field(default_factory=dict)
    next_scan: float = 0.0
    woken: bool = False
    watching: bool = False


class Daemon:
    """One watcher instance over one config. `run()` blocks until stopped (or one pass, `once`)."""

    def __init__(
        self,
        cfg: WatcherConfig,
        *,
        once: bool = False,
        clock: Callable[[], float] = time.time,
        inventory: Inventory | None = None,
        sources: list[Source] | None = None,
        executor_factory: Callable[[Callable[[str, int], None]], Executor] | None = None,
    ) -> None:
        self.cfg = cfg
        self.once = once
        self.clock = clock
        self.wake = threading.Event()
        self.exits: queue.Queue[tuple[str, int]] = queue.Queue()
        self.stop_requests = 0
        self.stop_deadline: float | None = None
        self.inventory_warnings: list[str] = []
        self.sources = [_SourceRuntime(s) for s in (sources or build_sources(cfg))]
        if executor_factory is None and cfg.executor.kind == "ray":
            from ckpt_watcher.executors.ray import RayExecutor

            ray_executor = RayExecutor(self._on_worker_exit, cfg.executor.address)
            self.executor: Executor = ray_executor
            inventory = inventory or RayInventory(ray_executor)
        else:
            factory = executor_factory or (lambda cb: LocalExecutor(cb))
            self.executor = factory(self._on_worker_exit)
        if inventory is None:
            inventory, self.inventory_warnings = build_inventory(cfg.devices)
        self.inventory = inventory
        if not self.inventory.devices():
            raise ConfigError(
                "config field devices: no device to run evals on (no usable GPU found); "
                "set devices.cpu_slots to 1 or more on a machine without GPUs"
            )
        self.state = State(cfg.state_dir)
        self.ledger = LedgerIndex(cfg.ledger_dir)
        self.settings_hash = cfg.eval.settings_hash()
        self.timed_out: set[str] = set()
        self.killed_for_stop: set[str] = set()
        self.failures_this_pass = 0
        self._last_heartbeat = 0.0
        self.notifier = Notifier()
        self._idle_since: dict[tuple[int, str], float] = {}
        self._reported: set[tuple[int, str]] = set()
        self.mirror = LedgerMirror(cfg.ledger_mirror, cfg.ledger_dir) if cfg.ledger_mirror else None

    def _source(self, name: str) -> Source | None:
        return next((rt.source for rt in self.sources if rt.source.name == name), None)

    # --- signals and worker exits arrive from other threads: they only set flags and wake ----
    def _on_worker_exit(self, job_id: str, rc: int) -> None:
        self.exits.put((job_id, rc))
        self.wake.set()

    def request_stop(self) -> None:
        self.stop_requests += 1
        self.wake.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.request_stop())

    # --- life cycle ----------------------------------------------------------------------------
    def run(self) -> int:
        """Run until stopped; returns the process exit code."""
        self.state.acquire_daemon_lock()
        try:
            return self._run()
        finally:
            for rt in self.sources:
                rt.source.close()
            self.state.set_meta(daemon_stopped_at=self.clock(), daemon_pid=None)
            self.state.close()

    def _run(self) -> int:
        now = self.clock()
        self.state.set_meta(
            daemon_pid=os.getpid(),
            daemon_started_at=now,
            heartbeat=now,
            mode="once" if self.once else "run",
            stopping=False,
            daemon_stopped_at=None,
        )
        for w in self.inventory_warnings:
            log.warning("devices.warning", message=w)
        self.ledger.load()
        self._save_resolved_config()
        self._recover(now)
        log.info(
            "daemon.started",
            pid=os.getpid(),
            sources=[rt.source.name for rt in self.sources],
            devices=[d.label for d in self.inventory.devices()],
            mode="once" if self.once else "run",
        )
        self.notifier.ready(self._status_line())
        first_pass = True
        while True:
            now = self.clock()
            self._collect(now)
            if self.stop_requests:
                if self._stopping(now):
                    break
            else:
                if first_pass or not self.once:  # `once` discovers exactly once
                    self._scan_due(now, force=first_pass)
                self._plan(now)
                self._check_timeouts(now)
                self._dispatch(now)
            first_pass = False
            self._heartbeat(now)
            if self.once and not self.stop_requests and self._idle():
                break
            self.wake.wait(timeout=self._sleep_for(self.clock()))
            self.wake.clear()
        log.info("daemon.stopped", failures=self.failures_this_pass)
        if self.once and self.failures_this_pass:
            return 1
        return 0

    def _idle(self) -> bool:
        return not self.state.jobs("queued", "running") and self.exits.empty()

    def _sleep_for(self, now: float) -> float:
        deadlines = [now + HEARTBEAT_SECONDS]
        watchdog = self.notifier.watchdog_due(now)
        if watchdog is not None:
            deadlines.append(watchdog)
        if not self.once:
            deadlines += [rt.next_scan for rt in self.sources]
        retry = scheduler.next_retry_at(self.state.jobs("queued"), now)
        if retry is not None:
            deadlines.append(retry)
        if self.stop_deadline is not None:
            deadlines.append(self.stop_deadline)
        for job in self.state.jobs("running"):
            if job.started_at:
                deadlines.append(job.started_at + self.cfg.eval.timeout_seconds)
        return max(0.0, min(deadlines) - now)

    def _heartbeat(self, now: float) -> None:
        self.notifier.watchdog(now)
        where = getattr(self.executor, "where", None)
        if where is not None:  # executors that place jobs on other nodes say where
            for job in self.state.jobs("running"):
                host = where(job.id)
                if host and host != job.host:
                    self.state.update_job(job.id, host=host)
                    log.info("eval.placed", job_id=job.id, run=job.run, step=job.step, node=host)
        if now - self._last_heartbeat >= HEARTBEAT_SECONDS:
            self._watch_zombies(now)
            self.state.set_meta(heartbeat=now, stopping=bool(self.stop_requests))
            self.notifier.status(self._status_line())
            self._last_heartbeat = now

    def _watch_zombies(self, now: float) -> None:
        """Report processes not ours that sit on GPU memory at 0% utilisation; kill them only
        if devices.reap_foreign_zombies is true."""
        ours = {j.pid for j in self.state.jobs("running") if j.pid}
        try:
            processes = self.inventory.gpu_processes()
        except Exception as e:  # NVML hiccup: try again next heartbeat
            log.warning("devices.query_failed", error=str(e))
            return
        idle_now = {
            (p.pid, p.device_id): p
            for p in processes
            if p.pid not in ours and p.used_mib > 0 and p.util_percent == 0
        }
        self._idle_since = {k: self._idle_since.get(k, now) for k in idle_now}
        labels = {d.id: d.label for d in self.inventory.devices()}
        suspects = []
        for key, since in self._idle_since.items():
            if now - since < self.cfg.devices.zombie_after_seconds:
                continue
            p = idle_now[key]
            suspects.append(
                {
                    "pid": p.pid,
                    "device": labels.get(p.device_id, p.device_id),
                    "used_mib": p.used_mib,
                    "idle_s": round(now - since),
                }
            )
            if key not in self._reported:
                self._reported.add(key)
                log.warning(
                    "devices.zombie_suspected",
                    pid=p.pid,
                    device=labels.get(p.device_id),
                    used_mib=p.used_mib,
                    idle_s=round(now - since),
                    reaping=self.cfg.devices.reap_foreign_zombies,
                )
                if self.cfg.devices.reap_foreign_zombies:
                    try:
                        os.kill(p.pid, signal.SIGKILL)
                        log.warning(
                            "devices.zombie_reaped", pid=p.pid, device=labels.get(p.device_id)
                        )
                    except (ProcessLookupError, PermissionError) as e:
                        log.error("devices.zombie_reap_failed", pid=p.pid, error=str(e))
        self.state.set_meta(suspected_zombies=suspects)

    def _status_line(self) -> str:
        counts = self.state.job_counts()
        word = "stopping" if self.stop_requests else "watching"
        return (
            f"{word}: {counts.get('queued', 0)} queued, {counts.get('running', 0)} running, "
            f"{counts.get('ok', 0)} done, {counts.get('failed', 0)} failed"
        )

    def _save_resolved_config(self) -> None:
        self.cfg.ledger_dir.mkdir(parents=True, exist_ok=True)
        path = self.cfg.ledger_dir / "watcher-config.resolved.yaml"
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            yaml.safe_dump(self.cfg.resolved(), f, sort_keys=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    # --- recovery after a crash or restart -----------------------------------------------------
    def _recover(self, now: float) -> None:
        for pid in find_stray_workers(self.cfg.state_dir):
            log.warning("recovery.killing_stray_worker", pid=pid)
            kill_group(pid)
        for job in self.state.jobs("running"):
            if job.pid and is_our_worker(job.pid, job.pid_start, job.id):
                kill_group(job.pid)
            self._harvest(job, now)
            remaining = self._due_tasks(job)
            if remaining:
                # the interruption was not the job's fault: it does not use up an attempt
                self._requeue(
                    job, remaining, attempt=max(0, job.attempt - 1), error="daemon restarted"
                )
                log.info("recovery.requeued", job_id=job.id, run=job.run, step=job.step)
            else:
                self._finish_job(job, "ok", now)
        for job in self.state.jobs("queued"):
            if job.settings_hash != self.settings_hash:
                self.state.update_job(job.id, state="skipped", error="eval settings changed")
                self.state.upsert_checkpoint(job.location, "", now, state="ready", reason="re-plan")
                continue
            remaining = self._due_tasks(job)
            if not remaining:
                self._finish_job(job, "ok", now)
            elif remaining != job.tasks:
                self.state.update_job(job.id, tasks=remaining)

    # --- scanning ------------------------------------------------------------------------------
    def _scan_due(self, now: float, force: bool) -> None:
        for rt in self.sources:
            if not (force or rt.woken or now >= rt.next_scan):
                continue
            rt.woken = False
            rt.next_scan = now + rt.source.poll_seconds
            if not rt.watching:
                rt.watching = rt.source.watch(functools.partial(self._wake_source, rt))
            self._scan(rt, now)

    def _wake_source(self, rt: _SourceRuntime) -> None:
        rt.woken = True
        self.wake.set()

    def _scan(self, rt: _SourceRuntime, now: float) -> None:
        name = rt.source.name
        try:
            found = rt.source.scan()
        except (OSError, WatcherError) as e:  # one failing source never stops the others
            self.state.record_scan(name, now, str(e), None)
            log.warning("source.scan_failed", source=name, error=str(e))
            return
        snapshot = {f.location: f for f in found}
        added, removed = diff(rt.snapshot, snapshot)
        rt.snapshot = snapshot
        for f in added:
            self._register(name, f, now)
        for f in removed:
            self._forget(f, now)
        for row in self.state.checkpoints(*_RECHECK, source=name):
            if row["location"] in snapshot:
                self._check(row, now)
        self.state.record_scan(name, now, None, sum(1 for f in found if f.ident))

    def _register(self, source: str, f: Found, now: float) -> None:
        row = self.state.checkpoint(f.location)
        if f.ident is None:
            if row is None or row["state"] != "unrecognised":
                self.state.upsert_checkpoint(
                    f.location, source, now, state="unrecognised", reason=f.note
                )
                log.warning("checkpoint.unrecognised", location=f.location, reason=f.note)
            return
        if row is not None and row["state"] not in ("missed",):
            return  # known from before a restart: its state stands
        ident = f.ident
        self.state.upsert_checkpoint(
            f.location,
            source,
            now,
            run=ident.run,
            step=ident.step,
            label=ident.label,
            final=int(ident.final),
            state="incomplete",
            reason="just seen",
        )
        log.info("checkpoint.seen", location=f.location, run=ident.run, step=ident.step)
        row = self.state.checkpoint(f.location)
        assert row is not None
        self._check(row, now)

    def _forget(self, f: Found, now: float) -> None:
        row = self.state.checkpoint(f.location)
        if row is None or row["state"] not in _MISSABLE:
            return
        for job in self.state.jobs("queued", location=f.location):
            self.state.update_job(
                job.id, state="skipped", error="checkpoint deleted before evaluation"
            )
        if not self.state.jobs("running", location=f.location):
            self.state.upsert_checkpoint(
                f.location, row["source"], now, state="missed", reason="deleted before evaluation"
            )
            log.warning("checkpoint.missed", location=f.location, run=row["run"], step=row["step"])

    def _check(self, row: Any, now: float) -> None:
        source = self._source(row["source"])
        if source is None:
            return  # its source left the config
        prev_fp = row["fingerprint"]
        try:
            verdict = completeness.check(
                source.view(row["location"]),
                now=now,
                stable_seconds=self.cfg.stable_seconds,
                unchanged_since=row["unchanged_since"],
                previous_fingerprint=prev_fp,
            )
        except (OSError, WatcherError) as e:  # unreadable now (S3 down?): judged again next scan
            log.warning("checkpoint.check_failed", location=row["location"], error=str(e))
            return
        fields: dict[str, Any] = {"state": verdict.state, "reason": verdict.reason}
        if verdict.fingerprint and verdict.fingerprint != prev_fp:
            fields |= {"fingerprint": verdict.fingerprint, "unchanged_since": now}
        if verdict.ready:
            fields["ready_at"] = now
        if verdict.state != row["state"] or verdict.reason != row["reason"]:
            self.state.upsert_checkpoint(row["location"], row["source"], now, **fields)
            event = f"checkpoint.{verdict.state}"
            log.info(
                event,
                location=row["location"],
                run=row["run"],
                step=row["step"],
                reason=verdict.reason,
            )
        elif "fingerprint" in fields:
            self.state.upsert_checkpoint(row["location"], row["source"], now, **fields)

    # --- planning ------------------------------------------------------------------------------
    def _task_key(self, run: str, step: int | None, label: str, t: dict[str, Any]) -> Any:
        return result_key(run, step, label, t["task"], t["num_fewshot"], self.settings_hash)

    def _due_tasks(self, job: Job) -> list[dict[str, Any]]:
        return [
            t
            for t in job.tasks
            if not self.ledger.is_ok(self._task_key(job.run, job.step, job.label, t))
        ]

    def _plan(self, now: float) -> None:
        policy = self.cfg.policy
        all_tasks = [t.model_dump() for t in self.cfg.eval.tasks]
        for row in self.state.checkpoints("ready"):
            loc, run, step, label, final = (
                row["location"],
                row["run"],
                row["step"],
                row["label"],
                bool(row["final"]),
            )
            if not scheduler.step_due(step, final, policy.every_n_steps):
                self.state.upsert_checkpoint(
                    loc,
                    row["source"],
                    now,
                    state="skipped",
                    reason=f"step {step} is not a multiple of policy.every_n_steps={policy.every_n_steps}",
                )
                continue
            due = [
                t for t in all_tasks if not self.ledger.is_ok(self._task_key(run, step, label, t))
            ]
            if not due:
                self.state.upsert_checkpoint(
                    loc, row["source"], now, state="done", reason="all tasks in the ledger"
                )
                continue
            if self.state.jobs("queued", "running", location=loc):
                self.state.upsert_checkpoint(loc, row["source"], now, state="planned", reason="")
                continue
            source = self._source(row["source"])
            if source is None:
                continue
            try:
                for action in source.prepare(loc):
                    log.info("checkpoint.names_fixed", location=loc, action=action)
            except NamingFixError as e:
                self.state.upsert_checkpoint(
                    loc, row["source"], now, state="invalid", reason=str(e)
                )
                log.error("checkpoint.names_unfixable", location=loc, error=str(e))
                continue
            job = Job.new(
                id=f"{run}-{step if step is not None else label}-{uuid.uuid4().hex[:8]}",
                location=loc,
                run=run,
                step=step,
                label=label,
                tasks=due,
                settings_hash=self.settings_hash,
                created_at=now,
                order_key=scheduler.order_key(step, final),
            )
            self.state.add_job(job)
            self.state.upsert_checkpoint(loc, row["source"], now, state="planned", reason="")
            log.info(
                "job.queued", job_id=job.id, run=run, step=step, tasks=[t["task"] for t in due]
            )
        if policy.skip_superseded:
            self._skip_superseded(now)

    def _skip_superseded(self, now: float) -> None:
        newest: dict[str, float] = {}
        for row in self.state.checkpoints("ready", "planned", "done"):
            key = scheduler.order_key(row["step"], bool(row["final"]))
            newest[row["run"]] = max(newest.get(row["run"], -1.0), key)
        for job in self.state.jobs("queued"):
            if job.order_key < newest.get(job.run, -1.0):
                self.state.update_job(
                    job.id, state="skipped", error="superseded by a newer checkpoint"
                )
                self.state.upsert_checkpoint(
                    job.location,
                    "",
                    now,
                    state="skipped",
                    reason="superseded by a newer checkpoint",
                )
                log.info(
                    "job.skipped", job_id=job.id, run=job.run, step=job.step, reason="superseded"
                )

    # --- dispatch ------------------------------------------------------------------------------
    def _dispatch(self, now: float) -> None:
        running = self.state.jobs("running")
        free = free_devices(
            self.inventory,
            in_use=[j.device for j in running if j.device],
            our_pids={j.pid for j in running if j.pid},
            idle_memory_mib=self.cfg.devices.idle_memory_mib,
        )
        if not free:
            return
        queued = self.state.jobs("queued")
        if self._split(scheduler.eligible(queued, now), len(free), now):
            queued = self.state.jobs("queued")
        assignments = scheduler.assign(queued, free, now, self.cfg.policy.order)
        if not assignments:
            return
        needed = [j.location for j in queued + running]
        for rt in self.sources:
            rt.source.make_room(needed)  # staged copies of jobs that are due stay
        for job, device in assignments:
            self._start(job, device, now)

    def _split(self, eligible: list[Job], free: int, now: float) -> bool:
        """Spread one checkpoint's tasks over spare devices (see scheduler.split_plan)."""
        plan = scheduler.split_plan(
            eligible, free, lambda t: self.ledger.estimate(t["task"], t["num_fewshot"])
        )
        for job_id, groups in plan.items():
            job = next(j for j in eligible if j.id == job_id)
            self.state.update_job(job.id, tasks=groups[0])
            for i, group in enumerate(groups[1:], start=1):
                part = Job.new(
                    id=f"{job.id}-{i}",
                    location=job.location,
                    run=job.run,
                    step=job.step,
                    label=job.label,
                    tasks=group,
                    settings_hash=job.settings_hash,
                    created_at=now,
                    order_key=job.order_key,
                )
                self.state.add_job(part)
            log.info("job.split", job_id=job.id, parts=[[t["task"] for t in g] for g in groups])
        return bool(plan)

    def _request(self, job: Job, device: Device) -> dict[str, Any]:
        ev = self.cfg.eval
        run_dir = self.cfg.ledger_dir / job.run
        folder = f"step_{job.step}" if job.step is not None else job.label
        return {
            "checkpoint": job.location,
            "backend": ev.backend,
            "model_args": ev.model_args,
            "tasks": job.tasks,
            "seed": ev.seed,
            "gen_kwargs": ev.gen_kwargs,
            "max_gen_toks": ev.max_gen_toks,
            "include_path": str(ev.include_path) if ev.include_path else None,
            "batch_size": ev.batch_size,
            "limit": ev.limit,
            "results_dir": str((run_dir / folder).resolve()),
            "device": device.compute,
            "tensor_parallel_size": ev.tensor_parallel_size,
        }

    def _start(self, job: Job, device: Device, now: float) -> None:
        attempt = job.attempt + 1
        folder = job_dir(self.cfg.state_dir, job.id, attempt)
        folder.mkdir(parents=True, exist_ok=True)
        source = self._source(self._checkpoint_source(job))
        spec = {
            "job_id": job.id,
            "device_label": device.label,
            "request": self._request(job, device),
            "stage": source.stage_spec(job.location) if source is not None else None,
        }
        (folder / "spec.json").write_text(json.dumps(spec, indent=2), encoding="utf-8")
        # (1) running, committed before the worker exists: a crash now leaves a job to recover
        self.state.update_job(
            job.id,
            state="running",
            attempt=attempt,
            device=device.id,
            device_label=device.label,
            started_at=self.clock(),  # not the loop's `now`: scanning and planning took time
            pid=None,
            pid_start=None,
        )
        env = {"CUDA_VISIBLE_DEVICES": device.visible}
        try:
            handle = self.executor.start(job.id, folder, env, folder / "worker.log")
        except OSError as e:
            self._requeue(job, job.tasks, attempt=job.attempt, error=f"could not start: {e}")
            log.error("eval.start_failed", job_id=job.id, error=str(e))
            return
        self.state.update_job(job.id, pid=handle.pid, pid_start=handle.start_token)
        log.info(
            "eval.started",
            job_id=job.id,
            run=job.run,
            step=job.step,
            device=device.label,
            attempt=attempt,
            pid=handle.pid,
            tasks=[t["task"] for t in job.tasks],
        )

    def _check_timeouts(self, now: float) -> None:
        limit = self.cfg.eval.timeout_seconds
        for job in self.state.jobs("running"):
            if job.started_at and now - job.started_at > limit and job.id not in self.timed_out:
                self.timed_out.add(job.id)
                log.error("eval.timeout", job_id=job.id, run=job.run, step=job.step, seconds=limit)
                self.executor.kill(job.id)

    # --- collecting results --------------------------------------------------------------------
    def _collect(self, now: float) -> None:
        while True:
            try:
                job_id, rc = self.exits.get_nowait()
            except queue.Empty:
                return
            job = self.state.job(job_id)
            if job is None or job.state != "running":
                continue
            self._harvest(job, now)
            self._settle(job, rc, now)

    def _outcomes(self, job: Job) -> list[dict[str, Any]]:
        folder = job_dir(self.cfg.state_dir, job.id, job.attempt)
        out = []
        for p in sorted(folder.glob("outcome-*.json")):
            try:
                out.append(json.loads(p.read_text(encoding="utf-8")))
            except (OSError, ValueError) as e:  # renamed into place, so never torn; be safe
                log.error("eval.outcome_unreadable", job_id=job.id, path=str(p), error=str(e))
        return out

    def _harvest(self, job: Job, now: float) -> None:
        """(3) Append an ok ledger line for every finished task of the job's current attempt."""
        for o in self._outcomes(job):
            if o["status"] == "ok":
                self._append(job, o, "ok", None)

    def _append(self, job: Job, o: dict[str, Any], status: str, error: str | None) -> None:
        ev = self.cfg.eval
        started = o.get("started_at") or ""
        finished = o.get("finished_at") or ""
        duration = None
        if started and finished:
            duration = round(
                (
                    datetime.fromisoformat(finished) - datetime.fromisoformat(started)
                ).total_seconds(),
                3,
            )
        rfile = o.get("results_file")
        if rfile:
            try:
                rfile = str(Path(rfile).relative_to((self.cfg.ledger_dir / job.run).resolve()))
            except ValueError:
                pass
        gen_kwargs = dict(ev.gen_kwargs)
        if ev.max_gen_toks is not None:
            gen_kwargs["max_gen_toks"] = ev.max_gen_toks
        line = {
            "schema": ledger_mod.SCHEMA,
            "run": job.run,
            "step": job.step,
            "label": job.label,
            "checkpoint": job.location,
            "task": o["task"],
            "num_fewshot": o["num_fewshot"],
            "status": status,
            "metrics": o.get("metrics", {}) if status == "ok" else {},
            "backend": ev.backend,
            "device": job.device_label,
            "model_args": ev.model_args,
            "gen_kwargs": gen_kwargs,
            "seed": ev.seed,
            "clamped_requests": o.get("clamped_requests", 0),
            "truncated_prompts": o.get("truncated_prompts", 0),
            "n_samples": o.get("n_samples"),
            "attempt": job.attempt,
            "started_at": started or None,
            "finished_at": finished or None,
            "duration_s": duration,
            "lm_eval_version": o.get("lm_eval_version"),
            "results_file": rfile if status == "ok" else None,
            "error": error,
            "job_id": job.id,
            "settings_hash": job.settings_hash,
        }
        if self.ledger.append(line):
            if self.mirror is not None:
                self.mirror.upload(job.run)
            log.info(
                "eval.finished" if status == "ok" else "eval.failed",
                job_id=job.id,
                run=job.run,
                step=job.step,
                task=o["task"],
                num_fewshot=o["num_fewshot"],
                device=job.device_label,
                metrics=line["metrics"],
                error=error,
            )

    def _settle(self, job: Job, rc: int, now: float) -> None:
        """Decide what a worker's exit means for its job: ok, retry, failed, or re-queued."""
        outcomes = {(o["task"], o["num_fewshot"]): o for o in self._outcomes(job)}
        remaining = self._due_tasks(job)
        if not remaining:
            self._finish_job(job, "ok", now)
            log.info("job.ok", job_id=job.id, run=job.run, step=job.step)
            return
        if job.id in self.killed_for_stop:
            self.killed_for_stop.discard(job.id)
            self._requeue(
                job, remaining, attempt=max(0, job.attempt - 1), error="interrupted by shutdown"
            )
            log.info("job.requeued", job_id=job.id, reason="shutdown")
            return
        row = self.state.checkpoint(job.location)
        source = self._source(row["source"]) if row is not None else None
        if source is not None and not self._still_there(source, job.location):
            # deleted while it was being evaluated: retrying cannot help
            self.state.update_job(
                job.id, state="skipped", error="checkpoint deleted during evaluation"
            )
            self.state.upsert_checkpoint(
                job.location, source.name, now, state="missed", reason="deleted during evaluation"
            )
            log.warning("checkpoint.missed", location=job.location, run=job.run, step=job.step)
            return
        task_errors = [
            f"{t['task']}: {outcomes[(t['task'], t['num_fewshot'])]['error']}"
            for t in remaining
            if (t["task"], t["num_fewshot"]) in outcomes
        ]
        tail = self._log_tail(job)
        if job.id in self.timed_out:
            self.timed_out.discard(job.id)
            reason = f"timed out after {self.cfg.eval.timeout_seconds:g}s (eval.timeout_seconds)"
        elif task_errors:
            reason = "; ".join(task_errors)
        elif rc < 0:
            reason = f"worker killed by signal {signal.Signals(-rc).name} (OOM killer?)"
        else:
            # a crash: the traceback's last line says what went wrong
            reason = f"worker exited with code {rc}"
            if tail.strip():
                reason += f": {tail.strip().splitlines()[-1][:300]}"
        if job.attempt < self.cfg.eval.max_attempts:
            delay = self.cfg.eval.retry_backoff_seconds * 2 ** (job.attempt - 1)
            self._requeue(job, remaining, attempt=job.attempt, not_before=now + delay, error=reason)
            log.warning(
                "eval.retry",
                job_id=job.id,
                run=job.run,
                step=job.step,
                attempt=job.attempt,
                max_attempts=self.cfg.eval.max_attempts,
                in_seconds=delay,
                reason=reason,
            )
            return
        error = f"{reason} (after {job.attempt} attempts)" + (
            f"\n--- worker log tail ---\n{tail}" if tail else ""
        )
        for t in remaining:
            o = outcomes.get(
                (t["task"], t["num_fewshot"]), {"task": t["task"], "num_fewshot": t["num_fewshot"]}
            )
            self._append(job, o, "failed", error)
        self.failures_this_pass += 1
        self._finish_job(job, "failed", now, error=reason)

    def _requeue(
        self,
        job: Job,
        tasks: list[dict[str, Any]],
        *,
        attempt: int,
        error: str,
        not_before: float = 0.0,
    ) -> None:
        """Back to the queue with the tasks still due; the device and worker are released."""
        self.state.update_job(
            job.id,
            state="queued",
            tasks=tasks,
            attempt=attempt,
            not_before=not_before,
            pid=None,
            device=None,
            device_label=None,
            error=error,
        )

    def _log_tail(self, job: Job) -> str:
        path = job_dir(self.cfg.state_dir, job.id, job.attempt) / "worker.log"
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-LOG_TAIL_LINES:])

    @staticmethod
    def _still_there(source: Source, location: str) -> bool:
        try:
            return source.exists(location)
        except (OSError, WatcherError):
            return True  # cannot tell now: treat the failure as the job's, and retry it

    def _checkpoint_source(self, job: Job) -> str:
        row = self.state.checkpoint(job.location)
        return str(row["source"]) if row is not None else ""

    def _finish_job(self, job: Job, state: str, now: float, error: str | None = None) -> None:
        self.state.update_job(job.id, state=state, finished_at=now, error=error, pid=None)
        if self.state.jobs("queued", "running", location=job.location):
            return  # other parts of a split checkpoint are still due
        source = self._source(self._checkpoint_source(job))
        if source is not None:
            source.release(job.location)
        row = self.state.checkpoint(job.location)
        if row is not None and row["state"] in ("planned", "ready"):
            all_tasks = [t.model_dump() for t in self.cfg.eval.tasks]
            due = [
                t
                for t in all_tasks
                if not self.ledger.is_ok(self._task_key(job.run, job.step, job.label, t))
            ]
            failed = [j.error for j in self.state.jobs("failed", location=job.location) if j.error]
            self.state.upsert_checkpoint(
                job.location,
                row["source"],
                now,
                state="failed" if due else "done",
                reason=(failed[-1] if failed else "") if due else "",
            )

    # --- two-stage shutdown --------------------------------------------------------------------
    def _stopping(self, now: float) -> bool:
        """True when the loop may exit. First signal drains; deadline or second signal kills."""
        running = self.state.jobs("running")
        if self.stop_deadline is None:
            self.stop_deadline = now + self.cfg.shutdown_grace_seconds
            self.state.set_meta(stopping=True)
            self.notifier.stopping()
            log.info(
                "daemon.draining",
                running=len(running),
                grace_seconds=self.cfg.shutdown_grace_seconds,
            )
        if not running:
            return True
        if self.stop_requests >= 2 or now >= self.stop_deadline:
            for job in running:
                if job.id not in self.killed_for_stop:
                    self.killed_for_stop.add(job.id)
                    log.warning("daemon.killing_worker", job_id=job.id, pid=job.pid)
                    self.executor.kill(job.id)
                    if job.id not in self.executor.running():
                        # no live process to report an exit (e.g. after a restart): settle now
                        self._on_worker_exit(job.id, -signal.SIGKILL)
        return False


def run_daemon(cfg: WatcherConfig, once: bool = False) -> int:
    """Entry point for `watcher run` / `watcher once`."""
    daemon = Daemon(cfg, once=once)
    daemon.install_signal_handlers()
    return daemon.run()
