"""The daemon: its loop, signals, two-stage stop, heartbeat and systemd notify. Nothing else.

Each pass: collect worker exits (jobs/supervise) -> apply finished scans and start due ones
(discovery) -> plan (planner) -> time out (jobs/supervise), give GPUs back to other processes
(jobs/gpus), dispatch (jobs/dispatch), engines ahead of their checkpoints (jobs/early) ->
heartbeat; then sleep until the next deadline or a wake-up
(inotify, a worker's exit, a scan's end, a signal). Nothing on this thread waits on the network:
sources and the ledger mirror run their I/O on lanes of their own. The daemon never imports
torch, vLLM or lm-eval: evals run in worker processes.
"""

from __future__ import annotations

import os
import queue
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
import yaml

from ckpt_watcher import planner, redact, scheduler
from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.devices import Inventory, build_inventory
from ckpt_watcher.discovery import Discovery
from ckpt_watcher.durable import write_atomic
from ckpt_watcher.errors import ConfigError, LedgerError, StateError
from ckpt_watcher.executors import build_executor
from ckpt_watcher.executors.base import Executor, ExitCallback
from ckpt_watcher.jobs.book import JobBook
from ckpt_watcher.jobs.dispatch import Dispatcher
from ckpt_watcher.jobs.early import EarlyEngines
from ckpt_watcher.jobs.filing import Filing
from ckpt_watcher.jobs.gpus import Gpus
from ckpt_watcher.jobs.journals import Journals
from ckpt_watcher.jobs.recovery import recover
from ckpt_watcher.jobs.supervise import Supervisor
from ckpt_watcher.ledger import LedgerIndex, iter_runs
from ckpt_watcher.mirror import LedgerMirror
from ckpt_watcher.notify import Notifier
from ckpt_watcher.pins import Pins
from ckpt_watcher.sinks import Sinks
from ckpt_watcher.sinks.prometheus import DaemonMetrics
from ckpt_watcher.sources import Source, build_sources
from ckpt_watcher.state import HEARTBEAT_SECONDS, State

log = structlog.get_logger("ckpt_watcher.daemon")

MIRROR_FLUSH_SECONDS = 30.0


class Daemon:
    """One watcher instance over one config. `run()` blocks until stopped (or one pass, `once`)."""

    def __init__(
        self,
        cfg: WatcherConfig,
        *,
        once: bool = False,
        clock: Callable[[], float] = time.time,
        wait: Callable[[threading.Event, float], bool] | None = None,
        inventory: Inventory | None = None,
        sources: list[Source] | None = None,
        executor_factory: Callable[[ExitCallback], Executor] | None = None,
    ) -> None:
        """`clock` and `wait` (the loop's sleep: an event to wake on and a timeout) are time;
        tests pass simulated ones (executors/simulated.py's SimClock)."""
        self.cfg = cfg
        self.once = once
        self.clock = clock
        self.wait = wait or (lambda event, timeout: event.wait(timeout))
        self.wake = threading.Event()
        self.exits: queue.Queue[tuple[str, int]] = queue.Queue()
        self.stop_requests = 0
        self.stop_deadline: float | None = None
        inventory_warnings: list[str] = []
        if executor_factory is not None:
            self.executor = executor_factory(self._on_worker_exit)
        else:
            self.executor, own_inventory = build_executor(
                cfg, self._on_worker_exit, wake=self.wake.set
            )
            inventory = inventory or own_inventory
        if inventory is None:
            inventory, inventory_warnings = build_inventory(cfg.devices)
        self.inventory = inventory
        self.inventory_warnings = inventory_warnings
        if not self.inventory.devices():
            raise ConfigError(
                "config field devices: no device to run evals on (no usable GPU found); "
                "set devices.cpu_slots to 1 or more on a machine without GPUs"
            )
        self.state = State(cfg.state_dir)
        self.metrics = DaemonMetrics()
        self.mirror = (
            LedgerMirror(cfg.ledger_mirror, cfg.ledger_dir, wake=self.wake.set)
            if cfg.ledger_mirror
            else None
        )
        self.sinks = Sinks(
            cfg,
            self.state,
            self.metrics,
            page_written=self.mirror.request if self.mirror is not None else None,
            clock=clock,
        )
        self.ledger = LedgerIndex(cfg.ledger_dir)
        self.ledger.listen(self.sinks.ledger_line)
        if self.mirror is not None:
            self.ledger.listen(self.mirror.ledger_line)
        max_gb = cfg.policy.pin_max_gb
        self.pins = Pins(
            self.state, int(max_gb * 2**30) if max_gb is not None else None, cfg.policy.pin
        )
        self.discovery = Discovery(
            sources if sources is not None else build_sources(cfg),
            self.state,
            cfg.stable_seconds,
            self.wake.set,
            on_ready=self.metrics.checkpoint_ready,
            pin_of=self.pins.path,
            settle_seconds=cfg.settle_seconds,
            tokenizer_required=not cfg.eval.model_args.get("tokenizer"),
            clock=clock,
        )
        self.book = JobBook(cfg, self.state, self.ledger, self.discovery)
        self.filing = Filing(cfg.ledger_dir, keep_trying=not once)
        self.dispatcher = Dispatcher(
            cfg, self.state, self.executor, self.discovery, self.book, clock, self.pins
        )
        self.dispatcher.on_skipped = lambda reason: self.metrics.skipped.labels(reason).inc()
        self.discovery.on_held_deleted = self.dispatcher.pin_budget_due
        self.helpers = self.dispatcher.helpers
        max_journal = cfg.policy.journal_max_gb
        self.journals = Journals(
            self.book, self.state, int(max_journal * 2**30) if max_journal is not None else None
        )
        self.supervisor = Supervisor(
            cfg,
            self.state,
            self.executor,
            self.exits,
            self.discovery,
            self.book,
            self.helpers,
            self.filing,
            # running time: monotonic, unless time itself is simulated (tests)
            monotonic=time.monotonic if clock is time.time else clock,
        )
        self.gpus = Gpus(
            cfg,
            self.state,
            self.inventory,
            self.executor,
            self.supervisor,
            self.helpers,
            self.metrics,
        )
        self.early = EarlyEngines(
            cfg, self.state, self.executor, self.dispatcher, once, wake=self.wake.set
        )
        self.notifier = Notifier()
        self._last_heartbeat = 0.0

    # --- worker exits and signals arrive from other threads: they only queue, flag and wake ----
    def _on_worker_exit(self, job_id: str, rc: int) -> None:
        self.exits.put((job_id, rc))
        self.wake.set()

    def request_stop(self) -> None:
        """Ask the loop to stop (from any thread; a signal goes through `install_signal_handlers`)."""
        self.stop_requests += 1
        self.wake.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT count a stop request and wake the loop through a pipe and a thread of
        its own. A handler runs on the loop's thread between two bytecodes, possibly while that
        thread holds the wake Event's lock (in its wait or clear): an Event.set() there would
        wait for that lock forever. A write to a pipe takes no lock."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)

        def relay() -> None:
            while os.read(read_fd, 64):
                self.wake.set()

        threading.Thread(target=relay, name="signal-relay", daemon=True).start()

        def on_signal(*_: object) -> None:
            self.stop_requests += 1
            try:
                os.write(write_fd, b"s")
            except BlockingIOError:  # the pipe is full of wake-ups already
                pass

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

    # --- life cycle ----------------------------------------------------------------------------
    def run(self) -> int:
        """Run until stopped; returns the process exit code."""
        self.state.acquire_daemon_lock()
        try:
            return self._run()
        except sqlite3.OperationalError as e:  # its disk full (a trainer's checkpoints), I/O
            raise StateError(
                f"cannot write the state database {self.state.path} ({e}): free space on its "
                "disk, or fix it, then start the watcher again. Nothing is lost: running evals "
                "are adopted, finished ones filed from their job folders"
            ) from e
        finally:
            self.helpers.stop_all()  # they help jobs of this daemon only
            self.executor.close()  # warm engines are released with the daemon
            self.sinks.flush_pages()  # before the mirror's last uploads, which carry them
            if self.mirror is not None:
                if not self.mirror.flush(MIRROR_FLUSH_SECONDS):
                    log.error(
                        "ledger.mirror_behind",
                        runs=sorted(self.mirror.pending()),
                        hint="the local ledgers are complete; the next start uploads every run again",
                    )
                self.mirror.close()
            self.discovery.close()
            self.metrics.close()
            self.sinks.close()
            try:
                self.state.set_meta(daemon_stopped_at=self.clock(), daemon_pid=None)
            except sqlite3.OperationalError as e:  # as above: `watcher status` says "down"
                log.error("state.not_written", error=str(e))
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
            metrics_url=None,
            helpers=[],
        )
        for w in self.inventory_warnings:
            log.warning("devices.warning", message=w)
        self.journals.check_home(
            ray=self.cfg.executor.kind == "ray", shared=self.cfg.executor.shared_dir is not None
        )
        history: list[dict[str, Any]] = []
        self.ledger.load(each=history.append)
        runs = list(iter_runs(self.cfg.ledger_dir))
        self.sinks.start(runs, history)
        if self.mirror is not None:  # a crash may have come between an append and its upload
            for run in runs:
                self.mirror.request(run)
        self._save_resolved_config()
        if self.cfg.metrics_port is not None:
            # the gauges filled before the first scrape can come (it read 0 free devices)
            self._update_metrics()
            self._serve_metrics(self.cfg.metrics_port, self.cfg.metrics_addr)
        recover(self.book, self.executor, self.filing, now)
        log.info(
            "daemon.started",
            pid=os.getpid(),
            sources=[w.source.name for w in self.discovery.watched],
            devices=[d.label for d in self.inventory.devices()],
            mode="once" if self.once else "run",
        )
        self.notifier.ready(self._status_line())
        first_pass = True
        while True:
            now = self.clock()
            self.supervisor.collect(now)
            if self.stop_requests:
                if self._stopping(now):
                    break
            else:
                # `once` scans once, then only looks again at checkpoints that are settling
                self.discovery.tick(now, force=first_pass, polls=not self.once)
                self._filing_steps(
                    now,
                    self._plan,
                    self.dispatcher.enforce_backlog,
                    self.dispatcher.enforce_pin_budget,
                )
                self.journals.tick(now)
                self.supervisor.check_timeouts(now)
                self.gpus.give_back(now)
                self._filing_steps(now, self._dispatch)
            first_pass = False
            self._heartbeat(now)
            if self.once and not self.stop_requests and self._idle():
                break
            self.wait(self.wake, self._sleep_for(self.clock()))
            self.wake.clear()
        log.info("daemon.stopped", failures=self.book.failures)
        if self.once and self.book.failures:
            return 1
        return 0

    def _filing_steps(self, now: float, *steps: Callable[[float], object]) -> None:
        """Steps that may file lines (skips, reused results): a ledger folder that cannot take
        them ends these steps for this pass, never the loop (`jobs/filing.py`); every step
        looks at the state afresh, so the next pass does again what this one left."""
        try:
            for step in steps:
                step(now)
        except LedgerError as e:
            self.filing.failed(str(e), now)

    def _serve_metrics(self, port: int, addr: str) -> None:
        try:
            bound = self.metrics.serve(port, addr)
        except OSError as e:
            raise ConfigError(
                f"config field metrics_port: cannot serve /metrics on {addr}:{port} "
                f"({e.strerror or e}); choose a free port, or remove metrics_port"
            ) from e
        self.state.set_meta(metrics_url=f"http://{addr}:{bound}/metrics")

    def _idle(self) -> bool:
        discovering = self.discovery.scanning() or self.discovery.settling()
        return not self.supervisor.busy() and not discovering

    def _sleep_for(self, now: float) -> float:
        deadlines = [now + HEARTBEAT_SECONDS, *self.supervisor.deadlines(now)]
        watchdog = self.notifier.watchdog_due(now)
        if watchdog is not None:
            deadlines.append(watchdog)
        filing = self.filing.deadline()
        if filing is not None:
            deadlines.append(filing)
        scan = self.discovery.next_deadline(polls=not self.once)
        if scan is not None:
            deadlines.append(scan)
        retry = scheduler.next_retry_at(self.state.jobs("queued"), now)
        if retry is not None:
            deadlines.append(retry)
        if self.stop_deadline is not None:
            deadlines.append(self.stop_deadline)
        give_back = self.gpus.deadline()
        if give_back is not None:
            deadlines.append(give_back)
        return max(0.0, min(deadlines) - now)

    # --- planning and dispatch: decisions from pure modules, carried out here ------------------
    def _plan(self, now: float) -> None:
        settings = self.book.settings_hash
        tasks = self.book.all_tasks
        actions = planner.plan_ready(
            self.state.checkpoints("ready"),
            plan=lambda r: self.ledger.plan(planner.subject(r), tasks, settings),
            has_jobs=lambda loc: bool(self.state.jobs("queued", "running", location=loc)),
            every_n_steps=self.cfg.policy.every_n_steps,
            in_flight={
                j.fingerprint: j.location
                for j in self.state.jobs("queued", "running")
                if j.fingerprint
            },
        )
        if self.cfg.policy.skip_superseded:
            actions += planner.superseded(
                self.state.checkpoints("ready", "planned", "done"), self.state.jobs("queued")
            )
        changed: set[str] = set()  # judged again: planned later, on its new files
        for action in actions:
            if action.location in changed:
                continue
            if isinstance(action, planner.QueueJob):
                if self.dispatcher.queue(action, now) is None:
                    changed.add(action.location)
            elif isinstance(action, planner.ReuseResults):
                self._reuse(action)
            elif isinstance(action, planner.SkipJob):
                self.state.update_job(action.job_id, state="skipped", error=action.reason)
                log.info("job.skipped", job_id=action.job_id, reason=action.reason)
            else:
                self.state.upsert_checkpoint(
                    action.location, "", now, state=action.state, reason=action.reason
                )

    def _reuse(self, action: planner.ReuseResults) -> None:
        """File results computed on the same content elsewhere under this checkpoint too."""
        for line in action.lines:
            self.ledger.append(line)
        log.info(
            "eval.reused",
            location=action.location,
            reused_from=action.lines[0]["reused_from"],
            tasks=[ln["task"] for ln in action.lines],
        )

    def _dispatch(self, now: float) -> None:
        prefer = self.early.preferred() if self.early.enabled else None
        self.dispatcher.dispatch(now, self.gpus.free(), may_start=self._may_start, prefer=prefer)
        if self.early.enabled and not self.stop_requests:
            # on the devices still free; not waiting for the worker starter's imports (the
            # worker then imports on its own, beside it): the earlier, the better
            self.early.start(self.gpus.free())

    def _may_start(self, now: float) -> bool:
        """Jobs start once the ledger folder takes lines and the executor is ready (its
        worker starter's imports: a plain worker would spend that time on them too)."""
        return self.filing.can_start(now) and self.executor.ready_to_start()

    # --- heartbeat -----------------------------------------------------------------------------
    def _heartbeat(self, now: float) -> None:
        self.notifier.watchdog(now)
        if now - self._last_heartbeat >= HEARTBEAT_SECONDS:
            self._record_placements()
            self._update_metrics()
            self.gpus.watch_zombies(now)
            if self.mirror is not None:
                self.mirror.retry_due(now)
            unwritable = self.filing.summary(now)
            self.metrics.ledger_unwritable.set(unwritable["for_s"] if unwritable else 0.0)
            self.state.set_meta(
                heartbeat=now,
                stopping=bool(self.stop_requests),
                ledger_unwritable=unwritable,
                worker_starter=self.executor.starter_state(),
                engines_elsewhere=self.executor.look_elsewhere(),
            )
            self.notifier.status(self._status_line())
            self._last_heartbeat = now

    def _record_placements(self) -> None:
        """Executors that place jobs on other nodes (Ray) say where; status shows it."""
        for job in self.state.jobs("running"):
            host = self.executor.where(job.id)
            if host and host != job.host:
                self.state.update_job(job.id, host=host)
                log.info("eval.placed", job_id=job.id, run=job.run, step=job.step, node=host)

    def _update_metrics(self) -> None:
        jobs = self.state.jobs("running")
        running = {j.device for j in jobs if j.device} | set(self.helpers.device_ids())
        devices = self.inventory.devices()
        self.metrics.loop_pass(
            self.state.job_counts(),
            [d.label for d in devices],
            {d.label for d in devices if d.id in running},
            [(r["name"], r["last_ok_at"]) for r in self.state.sources()],
        )
        ratios = {}
        for job in jobs:
            p = self.book.folder(job).progress()
            if p is not None and p.total:
                ratios[(job.id, p.task)] = p.done / p.total
        self.metrics.job_progress(ratios)

    def _status_line(self) -> str:
        counts = self.state.job_counts()
        word = "stopping" if self.stop_requests else "watching"
        return (
            f"{word}: {counts.get('queued', 0)} queued, {counts.get('running', 0)} running, "
            f"{counts.get('ok', 0)} done, {counts.get('failed', 0)} failed"
        )

    def _save_resolved_config(self) -> None:
        """The settings this daemon runs with, beside the ledgers (for the reader's record; a
        ledger folder that cannot be written now is the filing's business, not a reason to
        stop)."""
        text = yaml.safe_dump(redact.resolved(self.cfg.resolved()), sort_keys=False)
        try:
            self.cfg.ledger_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.cfg.ledger_dir / "watcher-config.resolved.yaml", text)
        except OSError as e:
            log.warning(
                "config.resolved_not_saved", ledger_dir=str(self.cfg.ledger_dir), error=str(e)
            )

    # --- two-stage shutdown --------------------------------------------------------------------
    def _stopping(self, now: float) -> bool:
        """True when the loop may exit. First signal drains; deadline or second signal kills.
        A job whose worker has ended but whose lines wait for the ledger folder stays `running`
        in the state: the next start files it, as after a crash."""
        running = [j for j in self.state.jobs("running") if not self.filing.waits_for(j.id)]
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
            self.supervisor.kill_for_stop()
        return False


def run_daemon(cfg: WatcherConfig, once: bool = False) -> int:
    """Entry point for `watcher run` / `watcher once`."""
    daemon = Daemon(cfg, once=once)
    daemon.install_signal_handlers()
    return daemon.run()
