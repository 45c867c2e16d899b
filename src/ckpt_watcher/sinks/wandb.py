"""The W&B sink: each `ok` ledger line logged as `eval/<task>/<shots>/<metric>` against
`train/step` (`define_metric(..., step_metric="train/step")`, so evals that run out of step
order still plot in order).

The ledger is the truth and the sink follows it. Per (sink, run) a cursor file under
`<state_dir>/sinks/` counts the ledger lines already handled; syncing a run logs the `ok` lines
past the cursor and moves it after each one. Every run is synced at start, so lines appended
while the daemon was down, or while W&B could not be reached, are sent then, and none twice
(a crash between a log and its cursor move can repeat that one line). All W&B calls run on the
sink's own thread, retried with back-off: the daemon's loop only names runs to sync.

Which W&B run: `run_id` from the sink's config (the training run), else the id in
`run_id_file` beside the checkpoint (its folder or the folder above, local sources), else one
W&B run per watched run, resumed by an id derived from the run path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import queue
import threading
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher.config import BASELINE_RUN, WandbSink
from ckpt_watcher.durable import write_json_atomic
from ckpt_watcher.errors import ConfigError
from ckpt_watcher.ledger import is_result, ledger_path, read_lines
from ckpt_watcher.report.table import entry_name, is_stderr_metric, length_stats

log = structlog.get_logger("ckpt_watcher.sinks.wandb")

MAX_BACKOFF_SECONDS = 60.0


def metric_key(task: str, shots: int | None, metric: str) -> str:
    """`eval/gsm8k/8shot/exact_match,strict-match`."""
    return f"eval/{task}/{'default' if shots is None else f'{shots}shot'}/{metric}"


def logged_values(line: dict[str, Any]) -> dict[str, Any] | None:
    """What one ledger line logs (None: nothing: failed, no step, or the baseline)."""
    step = line.get("step")
    if not is_result(line) or not isinstance(step, int):
        return None
    if (line.get("run_path") or line["run"]) == BASELINE_RUN:
        return None
    values: dict[str, Any] = {"train/step": step}
    for metric, value in (line.get("metrics") or {}).items():
        if is_stderr_metric(metric) or not isinstance(value, int | float):
            continue
        values[metric_key(entry_name(line), line.get("num_fewshot"), metric)] = value
    for stat, value in length_stats(line).items():  # response lengths, step by step
        values[metric_key(entry_name(line), line.get("num_fewshot"), stat)] = value
    return values if len(values) > 1 else None


def own_run_id(project: str, run_path: str) -> str:
    """The W&B run id for a watched run that names no training run: stable across restarts."""
    return "ckptw-" + hashlib.sha256(f"{project}\0{run_path}".encode()).hexdigest()[:16]


def wandb_missing() -> str | None:
    """What to do when the wandb package is not installed (None when it is)."""
    if importlib.util.find_spec("wandb") is None:
        return (
            "config field sinks: kind wandb needs the wandb package: "
            "pip install -e '.[wandb]' (or pip install wandb)"
        )
    return None


class WandbSinkWorker:
    def __init__(self, sink: WandbSink, ledger_dir: Path, state_dir: Path) -> None:
        missing = wandb_missing()
        if missing is not None:
            raise ConfigError(missing)
        self.sink = sink
        self.ledger_dir = ledger_dir
        self.dir = sink.dir or state_dir / "wandb"
        ident = f"{sink.project}\0{sink.entity}\0{sink.run_id}"
        self.cursors = (
            state_dir / "sinks" / f"wandb-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"
        )
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._runs: dict[str, Any] = {}
        self.logged = 0  # lines logged, and attempts that failed (for tests and logs)
        self.failed_attempts = 0
        self._thread = threading.Thread(target=self._work, name="wandb-sink", daemon=True)
        self._thread.start()

    # --- the loop's side: name runs to sync ----------------------------------------------------
    def request(self, run_path: str) -> None:
        with self._lock:
            if run_path in self._pending:
                return
            self._pending.add(run_path)
        self._queue.put(run_path)

    def close(self, budget_seconds: float = 30.0) -> None:
        """Finish what is queued and the W&B runs within the budget, then stop."""
        self._closing.set()  # a retry waiting out its back-off gives up: the cursor keeps its place
        self._queue.put(None)
        self._thread.join(timeout=budget_seconds)

    # --- the sink's thread ---------------------------------------------------------------------
    def _work(self) -> None:
        failures = 0
        while True:
            run_path = self._queue.get()
            if run_path is None:
                break
            with self._lock:
                self._pending.discard(run_path)
            try:
                self._sync(run_path)
                failures = 0
            except Exception as e:  # W&B down, a bad key...: the eval goes on, we retry later
                failures += 1
                self.failed_attempts += 1
                wait = min(MAX_BACKOFF_SECONDS, 2.0**failures)
                log.warning("wandb.retry", run_path=run_path, error=str(e), in_seconds=wait)
                self._runs.pop(run_path, None)
                if self._closing.wait(wait):
                    break
                self.request(run_path)
        for run_path, run in list(self._runs.items()):
            try:
                run.finish()
            except Exception as e:
                log.warning("wandb.finish_failed", run_path=run_path, error=str(e))

    def _sync(self, run_path: str) -> None:
        lines = read_lines(ledger_path(self.ledger_dir, run_path)).lines
        done = self._cursor(run_path)
        for i in range(done, len(lines)):
            values = logged_values(lines[i])
            if values is not None:
                self._run(run_path, lines[i]).log(values)
                self.logged += 1
            self._save_cursor(run_path, i + 1)
        if len(lines) > done:
            log.info("wandb.synced", run_path=run_path, lines=len(lines) - done)

    def _run(self, run_path: str, line: dict[str, Any]) -> Any:
        if run_path in self._runs:
            return self._runs[run_path]
        import wandb

        run_id = self.sink.run_id or self._trainer_run_id(line)
        own = run_id is None
        self.dir.mkdir(parents=True, exist_ok=True)
        run = wandb.init(
            project=self.sink.project,
            entity=self.sink.entity,
            id=run_id or own_run_id(self.sink.project, run_path),
            name=run_path if own else None,
            resume="allow",
            dir=str(self.dir),
            mode=self.sink.mode,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )
        run.define_metric("train/step")
        run.define_metric("eval/*", step_metric="train/step")
        log.info("wandb.run", run_path=run_path, wandb_run=run.id, training_run=not own)
        self._runs[run_path] = run
        return run

    def _trainer_run_id(self, line: dict[str, Any]) -> str | None:
        where = str(line.get("checkpoint") or "")
        if not where or "://" in where:
            return None
        for folder in (Path(where), Path(where).parent):
            try:
                text = (folder / self.sink.run_id_file).read_text(encoding="utf-8").strip()
            except OSError:
                continue
            if text:
                return text
        return None

    def _cursor_file(self, run_path: str) -> Path:
        return self.cursors / f"{hashlib.sha256(run_path.encode()).hexdigest()[:16]}.json"

    def _cursor(self, run_path: str) -> int:
        try:
            data = json.loads(self._cursor_file(run_path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return 0
        return int(data.get("lines", 0)) if data.get("run_path") == run_path else 0

    def _save_cursor(self, run_path: str, lines: int) -> None:
        self.cursors.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self._cursor_file(run_path), {"run_path": run_path, "lines": lines})
