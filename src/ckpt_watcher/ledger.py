"""The per-run ledger: `<ledger_dir>/<run>/ledger.jsonl`, one JSON object per result line.

The line schema is `result_line`'s. Lines are only ever appended (and fsynced), never rewritten. A torn last line (a crash in the
middle of an append) is skipped with a warning; the next append starts on a fresh line. The
daemon is the only writer. A result's identity is (run, step-or-label, task, num_fewshot,
settings hash): after any crash each identity has at most one `ok` line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher.clock import seconds_between
from ckpt_watcher.durable import fsync_dir
from ckpt_watcher.errors import LedgerError

SCHEMA = 1
LEDGER_NAME = "ledger.jsonl"
log = structlog.get_logger("ckpt_watcher.ledger")

ResultKey = tuple[str, str, str, int | None, str]


def result_key(
    run: str, step: int | None, label: str, task: str, num_fewshot: int | None, settings: str
) -> ResultKey:
    """The identity of one result. A final checkpoint without a step is identified by label."""
    return (run, str(step) if step is not None else f"label:{label}", task, num_fewshot, settings)


def task_key(
    run: str, step: int | None, label: str, task: dict[str, Any], settings: str
) -> ResultKey:
    """The identity of one task entry (`{"task": ..., "num_fewshot": ...}`) on a checkpoint."""
    return result_key(run, step, label, task["task"], task["num_fewshot"], settings)


def result_line(
    *,
    job: Any,
    outcome: dict[str, Any],
    status: str,
    error: str | None,
    eval_cfg: Any,
    ledger_dir: Path,
) -> dict[str, Any]:
    """One ledger line (schema 1) for a task's outcome on a job's checkpoint.

    `job` is a state.Job, `outcome` what the worker wrote for the task (for a failure with no
    outcome, just task and num_fewshot), `eval_cfg` the config's `eval` section.
    """
    started = outcome.get("started_at") or ""
    finished = outcome.get("finished_at") or ""
    rfile = outcome.get("results_file")
    if rfile:
        try:  # relative to the run's ledger folder, so the folder can move
            rfile = str(Path(rfile).relative_to((ledger_dir / job.run).resolve()))
        except ValueError:
            pass
    gen_kwargs = dict(eval_cfg.gen_kwargs)
    if eval_cfg.max_gen_toks is not None:
        gen_kwargs["max_gen_toks"] = eval_cfg.max_gen_toks
    ok = status == "ok"
    return {
        "schema": SCHEMA,
        "run": job.run,
        "step": job.step,
        "label": job.label,
        "checkpoint": job.location,
        "task": outcome["task"],
        "num_fewshot": outcome["num_fewshot"],
        "status": status,
        "metrics": outcome.get("metrics", {}) if ok else {},
        "backend": eval_cfg.backend,
        "device": job.device_label,
        "model_args": eval_cfg.model_args,
        "gen_kwargs": gen_kwargs,
        "seed": eval_cfg.seed,
        "clamped_requests": outcome.get("clamped_requests", 0),
        "truncated_prompts": outcome.get("truncated_prompts", 0),
        "n_samples": outcome.get("n_samples"),
        "attempt": job.attempt,
        "started_at": started or None,
        "finished_at": finished or None,
        "duration_s": seconds_between(started, finished),
        "lm_eval_version": outcome.get("lm_eval_version"),
        "results_file": rfile if ok else None,
        "error": error,
        "job_id": job.id,
        "settings_hash": job.settings_hash,
    }


def line_key(line: dict[str, Any]) -> ResultKey:
    return result_key(
        line["run"],
        line.get("step"),
        line.get("label", ""),
        line["task"],
        line.get("num_fewshot"),
        line.get("settings_hash", ""),
    )


@dataclass
class ReadReport:
    lines: list[dict[str, Any]]
    skipped: int  # torn or unparseable lines


def ledger_path(ledger_dir: Path, run: str) -> Path:
    return ledger_dir / run / LEDGER_NAME


def read_lines(path: Path) -> ReadReport:
    """Every well-formed line of one ledger file; torn or corrupt lines are counted and skipped."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return ReadReport([], 0)
    except OSError as e:
        raise LedgerError(f"cannot read ledger {path}: {e.strerror}") from e
    lines, skipped = [], 0
    for n, chunk in enumerate(raw.split(b"\n"), start=1):
        if not chunk.strip():
            continue
        try:
            obj = json.loads(chunk)
            if not isinstance(obj, dict) or "run" not in obj or "task" not in obj:
                raise ValueError("not a ledger line")
        except ValueError:
            skipped += 1
            log.warning("ledger.line_skipped", path=str(path), line=n, reason="torn or not JSON")
            continue
        lines.append(obj)
    return ReadReport(lines, skipped)


def iter_runs(ledger_dir: Path) -> Iterator[str]:
    if not ledger_dir.is_dir():
        return
    for child in sorted(ledger_dir.iterdir()):
        if (child / LEDGER_NAME).is_file():
            yield child.name


def append(ledger_dir: Path, line: dict[str, Any]) -> Path:
    """Append one line durably: write, flush, fsync (and fsync the folder on first creation)."""
    path = ledger_path(ledger_dir, line["run"])
    created = not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(line, sort_keys=False, ensure_ascii=False, default=str).encode("utf-8")
    try:
        with open(path, "ab") as f:
            if f.tell() > 0 and not _ends_with_newline(path):
                f.write(b"\n")  # a torn line from a crash stays on its own line, skipped on read
            f.write(data + b"\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise LedgerError(f"cannot append to ledger {path}: {e.strerror}") from e
    if created:
        fsync_dir(path.parent)
    return path


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


class LedgerIndex:
    """In-memory set of result identities already `ok`, loaded from every run's ledger."""

    def __init__(self, ledger_dir: Path) -> None:
        self.ledger_dir = ledger_dir
        self.ok: set[ResultKey] = set()
        self.failed_lines = 0
        self.durations: dict[tuple[str, int | None], list[float]] = {}

    def load(self) -> LedgerIndex:
        for run in iter_runs(self.ledger_dir):
            for line in read_lines(ledger_path(self.ledger_dir, run)).lines:
                self._note(line)
        return self

    def _note(self, line: dict[str, Any]) -> None:
        if line.get("status") == "ok":
            self.ok.add(line_key(line))
            if isinstance(line.get("duration_s"), int | float):
                key = (line["task"], line.get("num_fewshot"))
                self.durations.setdefault(key, []).append(float(line["duration_s"]))
        else:
            self.failed_lines += 1

    def append(self, line: dict[str, Any]) -> bool:
        """Append unless an `ok` line with the same identity exists; True if written."""
        if line.get("status") == "ok" and line_key(line) in self.ok:
            log.info(
                "ledger.duplicate_skipped",
                run=line["run"],
                step=line.get("step"),
                task=line["task"],
            )
            return False
        append(self.ledger_dir, line)
        self._note(line)
        return True

    def estimate(self, task: str, num_fewshot: int | None, default: float = 60.0) -> float:
        """Typical duration of a task from earlier results (median of the last 20)."""
        seen = self.durations.get((task, num_fewshot))
        if not seen:
            return default
        recent = sorted(seen[-20:])
        return recent[len(recent) // 2]

    def is_ok(self, key: ResultKey) -> bool:
        return key in self.ok

    def due(
        self,
        run: str,
        step: int | None,
        label: str,
        tasks: list[dict[str, Any]],
        settings: str,
    ) -> list[dict[str, Any]]:
        """The task entries of a checkpoint that have no `ok` line with these settings yet."""
        return [t for t in tasks if not self.is_ok(task_key(run, step, label, t, settings))]
