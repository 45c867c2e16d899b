"""The per-run ledger: `<ledger_dir>/<run_path>/ledger.jsonl`, one JSON object per result line.

The line schema is `result_line`'s. Lines are only ever appended (and fsynced), never rewritten.
A torn last line (a crash in the middle of an append) is skipped with a warning; the next append
starts on a fresh line. The daemon is the only writer.

A result's identity is (run path, step or label, task, num_fewshot, settings hash, fingerprint):
an `ok` line is dropped only when one with the same identity is already there, so after any
crash each identity has at most one `ok` line, and a checkpoint rewritten with other weights
(another fingerprint) gets results of its own. For one checkpoint version, `LedgerIndex.plan`
tells per task whether it is done, can reuse a result computed on the same content elsewhere
(`reused_from`), or is due. Lines written before fingerprints existed count for the checkpoint
at their `checkpoint` location, until that checkpoint is seen rewritten.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher import redact
from ckpt_watcher.config import BASELINE_RUN, task_settings_hash
from ckpt_watcher.durable import fsync_dir
from ckpt_watcher.errors import LedgerError
from ckpt_watcher.jobfolder import TaskOutcome
from ckpt_watcher.timestamps import seconds_between

SCHEMA = 1
LEDGER_NAME = "ledger.jsonl"
PROBE_BYTES = 4096  # `writable` writes a page: a disk with no page left refuses it
# Every field a ledger line may carry, and what it means: the one definition (docs/reference/
# ledger.md is generated from it; the tests check each line they read against it).
FIELDS: dict[str, str] = {
    "schema": "The line format's version (1).",
    "run": "The run's name (`mix` for `.../jobA/mix_step600`).",
    "run_path": "The run's path under its source (`jobA/mix`): the ledger's folder.",
    "step": "The training step (null for a labelled checkpoint such as `_final`).",
    "label": "The checkpoint's folder name (`mix_step600`, `checkpoint-600`, `mix_final`, "
    "`global_step_600`).",
    "checkpoint": "Where the checkpoint was found (a local path or an `s3://` URI).",
    "fingerprint": "The content fingerprint the result was computed on (`sampled:...` or "
    "`full:...`); a checkpoint rewritten with other weights gets results of its own.",
    "task": "The task (lm-eval's name, or the entry's `name`; an OLMES part: `<entry>/<part>`).",
    "name": "The task entry's `name`, where it has one.",
    "num_fewshot": "Few-shot examples (null where the harness has no such setting).",
    "status": "`ok`, `failed` (`error` says why) or `skipped` (by policy; `error` says which).",
    "metrics": "The task's metrics by name (`exact_match,none`, `pass@4`, `reward`, ...); "
    "empty unless `ok`.",
    "error": "Why the result failed or was skipped (null when `ok`).",
    "backend": "`vllm` or `hf`: the engine lm-eval entries ran on.",
    "device": "The device the job ran on (`cuda:6`, `cpu:0`).",
    "devices": "Every device that computed the result: the job's own first, then helpers.",
    "model_args": "The engine's arguments (`eval.model_args`, merged over the defaults).",
    "gen_kwargs": "Generation arguments applied (`eval.gen_kwargs`, the entry's, `max_gen_toks`).",
    "seed": "The seed (`eval.seed`).",
    "clamped_requests": "Requests whose generation length was lowered to fit the context.",
    "truncated_prompts": "Prompts cut to leave room for generation.",
    "n_samples": "Documents evaluated (examples, for verifiers).",
    "samples": "Responses per document (sampled tasks only).",
    "pass_at": "The k of each pass@k metric (sampled tasks only).",
    "apply_chat_template": "True where the entry applied the tokenizer's chat template.",
    "attempt": "Which attempt of the job produced the line (1 first).",
    "started_at": "When the task started (UTC, ISO 8601).",
    "finished_at": "When the task ended (UTC, ISO 8601).",
    "duration_s": "Seconds from start to end of the task.",
    "lm_eval_version": "lm-eval's version (lm-eval entries).",
    "harness": "Which harness computed it: `lm-eval`, `olmes`, `verifiers` or `command`.",
    "harness_version": "That harness's version (part of the settings hash).",
    "engine": "`cold` (loaded or started for this job), `warm` (weights swapped in, or "
    "already serving) or `early` (weights swapped into an engine started on the run's config "
    "before they existed, `eval.early_engine`).",
    "engine_seconds": "Seconds to have the model ready for this job (load, or swap and check).",
    "source_format": "The trainer's own format the checkpoint was converted from before the "
    "eval (`verl-fsdp`); absent for a Hugging Face checkpoint.",
    "convert_seconds": "Seconds the conversion into a Hugging Face folder took (for a job "
    "that used the copy another job of the checkpoint made: the wait for it).",
    "adapter": "For a LoRA/PEFT adapter saved alone: `served` (served on its base model: by "
    "vLLM with LoRA enabled, or by peft on the hf backend) or `merged` (evaluated merged into a "
    "copy of its base).",
    "no_op": "Why the checkpoint changes nothing (an adapter whose every update is zero, "
    "weights byte for byte its base's): evaluated, but left out of `results`, alerts, W&B, "
    "Prometheus and the report.",
    "resumed": "Units (responses, likelihood requests) answered from the task's journal "
    "after an interruption instead of computed again.",
    "results_file": "The harness's results file, relative to the ledger's folder.",
    "samples_file": "The per-document records (`watcher samples`), relative to the ledger's "
    "folder.",
    "job_id": "The job that computed it (its folder under `<state_dir>/jobs/`).",
    "settings_hash": "The hash of every setting that changes a result (task entry, eval "
    "settings, harness version): another hash is another result.",
    "reused_from": "Where an equal result was computed (the same fingerprint and settings): "
    "filed here too, not computed again.",
    "entry": "For a part of an entry with several results (an OLMES suite): the entry's name.",
    "entry_parts": "How many parts that entry has (the entry is done when all are in).",
    "response_tokens": "Response lengths in tokens: mean, p50, p90, max (generation tasks).",
    "length_capped_rate": "The share of responses the length cap stopped.",
    "unterminated_rate": "The share that never closed their thinking (with `think_end`; "
    "else null).",
}
REPORT_NAME = "report.html"  # the run's HTML page (report/page.py), beside its ledger
log = structlog.get_logger("ckpt_watcher.ledger")

# (run_path, step or "label:<label>", task, num_fewshot, settings hash, fingerprint)
Identity = tuple[str, str, str, int | None, str, str | None]
# the same content evaluated the same way: (fingerprint, task, num_fewshot, settings hash)
ContentKey = tuple[str, str, int | None, str]
# a pre-fingerprint ok line: (checkpoint location, task, num_fewshot, settings hash)
LegacyKey = tuple[str, str, int | None, str]


@dataclass(frozen=True)
class Subject:
    """One checkpoint version, as results are filed under it."""

    location: str
    run: str
    run_path: str
    step: int | None
    label: str
    fingerprint: str | None
    legacy_ok: bool = False  # lines without a fingerprint at `location` count (not rewritten since)

    @classmethod
    def of_job(cls, job: Any) -> Subject:
        """The checkpoint version a job (a `state.Job`) evaluates."""
        return cls(job.location, job.run, job.run_path, job.step, job.label, job.fingerprint)

    def identity(self, task: dict[str, Any], settings: str) -> Identity:
        """`settings` is `eval`'s hash; a task entry with settings of its own extends it."""
        step = str(self.step) if self.step is not None else f"label:{self.label}"
        own = task_settings_hash(settings, task)
        return (self.run_path, step, task["task"], task["num_fewshot"], own, self.fingerprint)


def line_run_path(line: dict[str, Any]) -> str:
    """The run path a ledger line is filed under (lines from before run paths: its run)."""
    return str(line.get("run_path") or line["run"])


def is_result(line: dict[str, Any]) -> bool:
    """An `ok` line whose numbers are its checkpoint's own: not a step flagged `no_op` (its
    numbers are its base model's), which results, alerts, sinks and reports leave out."""
    return line.get("status") == "ok" and not line.get("no_op")


def line_identity(line: dict[str, Any]) -> Identity:
    step = line.get("step")
    return (
        line_run_path(line),
        str(step) if step is not None else f"label:{line.get('label', '')}",
        line["task"],
        line.get("num_fewshot"),
        line.get("settings_hash", ""),
        line.get("fingerprint"),
    )


@dataclass
class TaskPlan:
    """Per task entry of one checkpoint version: what is due, and what can be reused."""

    due: list[dict[str, Any]] = field(default_factory=list)
    reuse: list[dict[str, Any]] = field(default_factory=list)  # ready-made ledger lines


def result_line(
    *,
    job: Any,
    outcome: TaskOutcome,
    status: str,
    error: str | None,
    eval_cfg: Any,
    ledger_dir: Path,
) -> dict[str, Any]:
    """One ledger line (schema 1) for a task's outcome on a job's checkpoint.

    `job` is a state.Job, `outcome` what the worker wrote for the task (for a failure with no
    outcome, one with just the task and num_fewshot), `eval_cfg` the config's `eval` section.
    """
    entry: dict[str, Any] = next((t for t in job.tasks if task_key(t) == outcome.key), {})
    gen_kwargs = dict(eval_cfg.gen_kwargs) | (entry.get("gen_kwargs") or {})
    if eval_cfg.max_gen_toks is not None:
        gen_kwargs["max_gen_toks"] = eval_cfg.max_gen_toks
    ok = status == "ok"
    sampled = {"samples": entry.get("samples", 1), "pass_at": entry.get("pass_at")}
    harness = {
        "harness": entry.get("harness", "lm-eval"),
        "harness_version": outcome.harness_version or outcome.lm_eval_version or None,
    }
    return (
        {
            "schema": SCHEMA,
            "run": job.run,
            "step": job.step,
            "label": job.label,
            "checkpoint": job.location,
            "task": outcome.task,
            "num_fewshot": outcome.num_fewshot,
            "status": status,
            "metrics": outcome.metrics if ok else {},
            "backend": eval_cfg.backend,
            "device": job.device_label,
            "model_args": redact.resolved(eval_cfg.model_args),
            "gen_kwargs": gen_kwargs,
            "seed": eval_cfg.seed,
            "clamped_requests": outcome.clamped_requests,
            "truncated_prompts": outcome.truncated_prompts,
            "n_samples": outcome.n_samples,
            "attempt": job.attempt,
            "started_at": outcome.started_at or None,
            "finished_at": outcome.finished_at or None,
            "duration_s": seconds_between(outcome.started_at, outcome.finished_at),
            "lm_eval_version": outcome.lm_eval_version or None,
            "engine": outcome.engine,
            "engine_seconds": outcome.engine_seconds,
            "resumed": outcome.resumed,
            "devices": _devices(job.device_label, outcome.devices),
            "results_file": _run_relative(outcome.results_file, ledger_dir, job) if ok else None,
            "samples_file": _run_relative(outcome.samples_file, ledger_dir, job) if ok else None,
            "error": redact.Redactor.of(eval_cfg)(error) if error else error,
            "job_id": job.id,
            "settings_hash": task_settings_hash(job.settings_hash, entry),
            "run_path": job.run_path,
            "fingerprint": job.fingerprint,
        }
        | (sampled if entry.get("pass_at") is not None else {})
        | ({"apply_chat_template": True} if entry.get("apply_chat_template") else {})
        | ({"name": entry["name"]} if entry.get("name") else {})
        | (
            {"source_format": outcome.source_format, "convert_seconds": outcome.convert_seconds}
            if outcome.source_format
            else {}
        )
        | ({"adapter": outcome.adapter} if outcome.adapter else {})
        | ({"no_op": outcome.no_op} if outcome.no_op else {})
        | (_lengths(outcome.lengths) if ok and outcome.lengths else {})
        | harness
    )


def result_lines(**kw: Any) -> list[dict[str, Any]]:
    """The ledger lines of a task's outcome (`result_line`'s arguments): one, or one per part
    of an entry that yields several results (OLMES: `task` is `<entry>/<part>`, `entry` and
    `entry_parts` say whose part it is, so the entry counts as done once all its parts are in)."""
    line = result_line(**kw)
    outcome, status, job, ledger_dir = kw["outcome"], kw["status"], kw["job"], kw["ledger_dir"]
    if status != "ok" or not outcome.parts:
        return [line]
    lines = []
    for part in outcome.parts:
        one = dict(line)
        one.update(
            task=f"{outcome.task}/{part['task']}",
            metrics=part.get("metrics") or {},
            n_samples=part.get("n_samples"),
            results_file=_run_relative(part.get("results_file"), ledger_dir, job),
            samples_file=_run_relative(part.get("samples_file"), ledger_dir, job),
            entry=outcome.task,
            entry_parts=len(outcome.parts),
        )
        lines.append(one)
    return lines


def task_key(task: dict[str, Any]) -> tuple[str, int | None]:
    """A task entry's (name or task, num_fewshot): how outcomes and ledger lines name it (as
    `TaskOutcome.key` does on the worker's side)."""
    return (task.get("name") or task["task"], task["num_fewshot"])


def _lengths(measured: dict[str, Any]) -> dict[str, Any]:
    """A generation task's response lengths, as the ledger line carries them."""
    return {
        "response_tokens": measured["response_tokens"],
        "length_capped_rate": measured["length_capped_rate"],
        "unterminated_rate": measured.get("unterminated_rate"),  # null without think_end
    }


def _devices(first: str | None, computed: list[str]) -> list[str]:
    """The devices that computed a result: the job's own first (it is `device`), then any that
    helped it (a task spread over idle devices)."""
    head = [first] if first else []
    return head + sorted(set(computed) - set(head))


def _run_relative(path: str | None, ledger_dir: Path, job: Any) -> str | None:
    """A worker's output file, relative to the run's ledger folder, so the folder can move."""
    if not path:
        return None
    try:
        return str(Path(path).relative_to((ledger_dir / job.run_path).resolve()))
    except ValueError:
        return path


@dataclass
class ReadReport:
    lines: list[dict[str, Any]]
    skipped: int  # torn or unparseable lines


def ledger_path(ledger_dir: Path, run_path: str) -> Path:
    return ledger_dir / run_path / LEDGER_NAME


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
    """The run path of every ledger under `ledger_dir` (at any depth), sorted."""
    if not ledger_dir.is_dir():
        return
    for path in sorted(ledger_dir.rglob(LEDGER_NAME)):
        if path.is_file():
            yield path.parent.relative_to(ledger_dir).as_posix()


def append(ledger_dir: Path, line: dict[str, Any]) -> Path:
    """Append one line durably: write, flush, fsync (and fsync the folder on first creation)."""
    path = ledger_path(ledger_dir, line_run_path(line))
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


def writable(ledger_dir: Path) -> str | None:
    """None if a new file can be created, written and synced in `ledger_dir`, as the first
    append of a run does; else why not, as the system said it (a full disk, a quota, a
    read-only mount, an NFS error)."""
    try:
        ledger_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".watcher-probe-", dir=ledger_dir)
        try:
            os.write(fd, b"\n" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as e:
        return e.strerror or str(e)
    return None


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


class LedgerIndex:
    """What the ledgers already hold, loaded from every run's ledger: `ok` identities, the first
    `ok` line per content (for reuse), and pre-fingerprint `ok` lines by location."""

    def __init__(self, ledger_dir: Path) -> None:
        self.ledger_dir = ledger_dir
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # told of each line written
        self.ok: set[Identity] = set()
        self.by_content: dict[ContentKey, dict[str, Any]] = {}
        # the parts of entries with several results (OLMES), by the entry's identity / content
        self.parts: dict[Identity, dict[str, dict[str, Any]]] = {}
        self.content_parts: dict[ContentKey, list[dict[str, Any]]] = {}
        self.legacy: set[LegacyKey] = set()
        self.failed_lines = 0
        self.durations: dict[tuple[str, int | None], list[float]] = {}

    def load(self, each: Callable[[dict[str, Any]], None] | None = None) -> LedgerIndex:
        """Index every ledger under ledger_dir; `each` also sees every line read (once)."""
        for run_path in iter_runs(self.ledger_dir):
            for line in read_lines(ledger_path(self.ledger_dir, run_path)).lines:
                self._note(line)
                if each is not None:
                    each(line)
        return self

    def _note(self, line: dict[str, Any]) -> None:
        if line.get("status") != "ok":
            self.failed_lines += line.get("status") == "failed"
            return
        self.ok.add(line_identity(line))
        if line.get("entry"):  # a part of an entry: the entry is done once all its parts are
            whole = (*line_identity(line)[:2], line["entry"], *line_identity(line)[3:])
            parts = self.parts.setdefault(whole, {})
            parts[line["task"]] = line
            if len(parts) >= int(line.get("entry_parts") or 1):
                self.ok.add(whole)
                fp = line.get("fingerprint")
                if fp:
                    key = (
                        fp,
                        line["entry"],
                        line.get("num_fewshot"),
                        line.get("settings_hash", ""),
                    )
                    self.content_parts.setdefault(key, list(parts.values()))
        task, shots, settings = line["task"], line.get("num_fewshot"), line.get("settings_hash", "")
        fp = line.get("fingerprint")
        if fp:
            self.by_content.setdefault((fp, task, shots, settings), line)
        else:
            self.legacy.add((line.get("checkpoint", ""), task, shots, settings))
        if isinstance(line.get("duration_s"), int | float):
            self.durations.setdefault((task, shots), []).append(float(line["duration_s"]))

    def append(self, line: dict[str, Any]) -> bool:
        """Append unless an `ok` line with the same identity exists; True if written."""
        if line.get("status") == "ok" and line_identity(line) in self.ok:
            log.info(
                "ledger.duplicate_skipped",
                run_path=line_run_path(line),
                step=line.get("step"),
                task=line["task"],
                fingerprint=line.get("fingerprint"),
            )
            return False
        append(self.ledger_dir, line)
        self._note(line)
        for listener in self.listeners:
            listener(line)
        return True

    def listen(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Tell `listener` of every line appended from now on (on the appending thread)."""
        self.listeners.append(listener)

    def estimate(self, task: str, num_fewshot: int | None, default: float = 60.0) -> float:
        """Typical duration of a task from earlier results (median of the last 20)."""
        seen = self.durations.get((task, num_fewshot))
        if not seen:
            return default
        recent = sorted(seen[-20:])
        return recent[len(recent) // 2]

    def done(self, subject: Subject, task: dict[str, Any], settings: str) -> bool:
        """Has this checkpoint version an `ok` line for the task (or a pre-fingerprint one)?"""
        if subject.identity(task, settings) in self.ok:
            return True
        own = task_settings_hash(settings, task)
        legacy = (subject.location, task["task"], task["num_fewshot"], own)
        return subject.legacy_ok and legacy in self.legacy

    def due(
        self, subject: Subject, tasks: list[dict[str, Any]], settings: str
    ) -> list[dict[str, Any]]:
        """The task entries of a checkpoint version that have no `ok` line yet."""
        return [t for t in tasks if not self.done(subject, t, settings)]

    def plan(self, subject: Subject, tasks: list[dict[str, Any]], settings: str) -> TaskPlan:
        """Per task: done (left out), reusable (a line to append, copied from the same content
        evaluated elsewhere with these settings), or due."""
        out = TaskPlan()
        for t in self.due(subject, tasks, settings):
            first = None
            if subject.fingerprint:
                own = task_settings_hash(settings, t)
                key = (subject.fingerprint, t["task"], t["num_fewshot"], own)
                parts = self.content_parts.get(key)
                if parts:
                    out.reuse += [reused_line(p, subject, self.ledger_dir) for p in parts]
                    continue
                first = self.by_content.get(key)
            if first is None:
                out.due.append(t)
            else:
                out.reuse.append(reused_line(first, subject, self.ledger_dir))
        return out


def reused_line(first: dict[str, Any], subject: Subject, ledger_dir: Path) -> dict[str, Any]:
    """A copy of `first` (an `ok` line on the same content) filed under `subject`."""
    line = dict(first)
    line.update(
        run=subject.run,
        run_path=subject.run_path,
        step=subject.step,
        label=subject.label,
        checkpoint=subject.location,
        reused_from=first.get("reused_from") or first["checkpoint"],
    )
    if subject.run_path == BASELINE_RUN:  # the base model is no step of a run
        line.pop("no_op", None)
    elif line_run_path(first) == BASELINE_RUN:
        line["no_op"] = (
            f"its content is the baseline's ({first['checkpoint']}), by fingerprint: "
            "the model is the base"
        )
    origin = ledger_dir / line_run_path(first)
    for key in ("results_file", "samples_file"):
        if first.get(key):  # still relative to the ledger's own folder
            line[key] = os.path.relpath(origin / first[key], ledger_dir / subject.run_path)
    return line
