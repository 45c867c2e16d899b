"""Engines started before their checkpoints: as soon as a run's model is known, an idle device
starts its engine on placeholder weights, so the run's first checkpoint is served as fast as
its tenth (`eval.early_engine`).

A run's model is known once a step of it still being written (or complete but still settling,
`stable_seconds`) has its config and tokenizer whole (checkpoints/model_meta.py); a LoRA run's,
once a step's adapter config is whole (its base is then loaded, for real; on vLLM with LoRA
enabled).
Those files are read on a lane of their own (lane.py), never on the daemon's loop; an S3
step's are fetched into `<state_dir>/early-meta/` (`model_meta.fetch`; a LoRA step's adapter
config and weights once both are up). Then, when nothing of that run is queued or running and
no warm engine waits for it already, the first free device with no warm worker of its own gets
one (executors/warm.py `prepare`; the worker's
side is worker/early.py, which also does the first job's lm-eval set-up). Its job later goes to
that device first (scheduler.assign's `prefer`, which also sends a run's next job to the idle
engine its last job left), and no helper takes that device meanwhile. Only on a free device
(the idle rule of `devices.py` holds as for jobs), never in place of a warm engine another run
left, and given back like a job when another process starts using its GPU (gpus.py), and
started again once the device is free (`TRIES_PER_STEP`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import structlog

from ckpt_watcher.checkpoints import model_meta
from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.devices import Device
from ckpt_watcher.executors.base import Executor
from ckpt_watcher.jobfolder import EARLY_META_DIR, PREPARE_DIR, JobFolder, warm_home
from ckpt_watcher.jobs.dispatch import Dispatcher
from ckpt_watcher.lane import Lane
from ckpt_watcher.state import CheckpointRow, Job, State

log = structlog.get_logger("ckpt_watcher.jobs")

# Engines started for one step at most: again after one was given back to training, or released
# idle, but not for ever for a step whose engine will not start (its worker waits, not ready)
TRIES_PER_STEP = 3
LOOK_SECONDS = 2.0  # between two looks at the files of a step whose model is not known yet


class EarlyEngines:
    """The daemon's side of engines ahead of their checkpoints."""

    def __init__(
        self,
        cfg: WatcherConfig,
        state: State,
        executor: Executor,
        dispatcher: Dispatcher,
        once: bool = False,
        wake: Callable[[], None] | None = None,
    ) -> None:
        """`once`: `watcher once`, which ends before a step being written is complete; `wake`
        wakes the loop when a step's files have been read."""
        self.cfg = cfg
        self.state = state
        self.executor = executor
        self.dispatcher = dispatcher
        self.tasks = [t for t in dispatcher.book.all_tasks if t.get("harness") == "lm-eval"]
        self.enabled = (
            cfg.eval.early_engine
            and executor.starts_engines_ahead
            and cfg.eval.backend in ("vllm", "hf")
            and bool(self.tasks)
            and not once
        )
        self.tried: dict[str, int] = {}  # step -> engines started for it
        self.tokenizer_required = not cfg.eval.model_args.get("tokenizer")
        # a step's files are read on a lane of their own, never on the loop (EFS may hang)
        self.lane = Lane("early-engines")
        self.wake = wake  # once a look finds a step's model (not after every look)
        # step -> the folder its engine starts on once its model is known (None: not yet)
        self.looks: dict[str, Future[str | None]] = {}
        self.next_look: dict[str, float] = {}  # step -> when it may be looked at again
        # the meta files of S3 steps, fetched: what an engine starts on (the worker copies them);
        # what no step looked at now holds is removed at each pass (`_sweep`): a look that
        # ended after its step left, an earlier daemon's
        self.fetched = cfg.state_dir / EARLY_META_DIR

    def preferred(self) -> dict[str, str]:
        """Run path -> the device label whose idle engine holds that run's model (started ahead
        of its first checkpoint, or left by its last job), for the runs with work coming (a job
        queued, a step being written): their devices are kept for them."""
        idle = {run: d for d, run in self.executor.idle_engines().items() if run is not None}
        if not idle:
            return {}
        coming = {j.run_path for j in self.state.jobs("queued")}
        coming |= {r.run_path for r in self.state.checkpoints("incomplete")}
        return {run: d for run, d in idle.items() if run in coming}

    def start(self, free: list[Device]) -> None:
        """Start engines for the runs whose model is known and whose first checkpoint has no
        engine waiting, on the free devices that hold no warm worker."""
        if not self.enabled or not free:
            return
        idle = self.executor.idle_engines()
        waiting = {run for run in idle.values() if run is not None}
        busy = {j.run_path for j in self.state.jobs("queued", "running")}
        devices = [d for d in free if d.label not in idle]
        rows = self.state.checkpoints("incomplete")
        gone = self.looks.keys() - {r.location for r in rows}
        for location in gone:  # judged since (or deleted): no more looks
            del self.looks[location]
            self.next_look.pop(location, None)
        self._sweep()
        for row in rows:
            if not devices:
                return
            tries = self.tried.get(row.location, 0)
            if row.run_path in waiting or row.run_path in busy or tries >= TRIES_PER_STEP:
                continue
            folder = self._known(row.location, row.source)
            if folder is None:
                continue
            self.tried[row.location] = tries + 1
            device = devices.pop(0)
            if self._prepare(row, folder, device):
                waiting.add(row.run_path)

    def _known(self, location: str, source: str) -> str | None:
        """The folder the step's engine starts on once its model is known: the answer of the
        last look at its files, which run on the lane (None meanwhile, and a new look asked
        once one has ended without it). Once known it stays known: its files are not read,
        nor fetched again, while the engine may be reading them."""
        look = self.looks.get(location)
        if look is not None and not look.done():
            return None
        try:
            folder = look.result() if look is not None else None
        except Exception:  # an unreadable folder, an S3 error: not known (yet)
            folder = None
        now = time.monotonic()
        if folder is None and now >= self.next_look.get(location, 0.0):
            self.next_look[location] = now + LOOK_SECONDS  # not once a loop pass
            look = self.lane.submit(lambda: self._readable(location, source))
            look.add_done_callback(self._found)
            self.looks[location] = look
        return folder

    def _found(self, look: Future[str | None]) -> None:
        """On the lane, a look ended: the loop is woken when it found a step's model."""
        try:
            found = look.result() is not None
        except Exception:
            found = False
        if found and self.wake is not None:
            self.wake()

    def _sweep(self) -> None:
        """Remove the fetched folders of steps no longer looked at."""
        if not self.fetched.exists():
            return
        kept = {self._fetched_for(location).name for location in self.looks}
        try:
            folders = [p for p in self.fetched.iterdir() if p.name not in kept]
        except OSError:
            return
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)

    def _readable(self, location: str, source: str) -> str | None:
        """On the lane: the folder with the step's whole config and tokenizer (or its adapter
        config), or None. An S3 step's are fetched into a folder of ours (a LoRA step's adapter
        config and weights, once both are up: the base is loaded on what they name)."""
        served = self.cfg.eval.serve_adapters
        if "://" in location:
            src = self.dispatcher.discovery.source_named(source)
            if src is None:
                return None
            files = src.view(location)
            # an adapter first, as the worker looks (worker/early.py): one may hold a config too
            names = model_meta.adapter_in(files) if served else None
            names = names or model_meta.find_in(files, self.tokenizer_required)
            if names is None:
                return None
            return str(model_meta.fetch(files, names, self._fetched_for(location)))
        step = Path(location)
        if model_meta.find(step, self.tokenizer_required) is not None:
            return location
        return location if served and model_meta.adapter(step) else None

    def _fetched_for(self, location: str) -> Path:
        return self.fetched / hashlib.sha256(location.encode()).hexdigest()[:16]

    def _prepare(self, row: CheckpointRow, folder: str, device: Device) -> bool:
        """Ask for an engine on `device` for the step `row`, started on `folder`."""
        run_path = row.run_path
        job = Job(
            id=run_path,
            location=row.location,
            run=row.run,
            step=row.step,
            label=row.label,
            tasks=self.tasks,
            settings_hash="",
            created_at=0.0,
            order_key=0.0,
            run_path=run_path,
        )
        spec = self.dispatcher.spec(job, device)
        if folder != row.location:  # an S3 step: its meta files, fetched (nothing is staged)
            request = dataclasses.replace(spec.request, checkpoint=folder)
            spec = dataclasses.replace(spec, request=request, stage=None)
        prepare = JobFolder(warm_home(self.cfg.state_dir, device.label) / PREPARE_DIR)
        try:
            prepare.write_spec(spec)
            ok = self.executor.prepare(device.label, prepare, device.worker_env())
        except OSError as e:  # a full disk, a worker starter that died: the job loads cold
            log.warning("engine.prepare_failed", run=run_path, device=device.label, error=str(e))
            return False
        log.info("engine.prepare", run=run_path, step=row.step, device=device.label, sent=ok)
        return ok
