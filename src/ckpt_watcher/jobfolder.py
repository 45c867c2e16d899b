"""The job folder: the one contract between the daemon and a worker process.

The daemon and its workers share nothing but files under `<state_dir>/jobs/`, and this module is
the only place that names them. Both sides import it; nothing else spells a file name of a job
folder. One attempt of one job has its own folder, `jobs/<job id>/attempt-<n>/`
(a helper of that attempt, a worker on another device that joins its tasks, has
`attempt-<n>-help-<device>/`, with the same files):

| file                 | written by | what                                                         |
|----------------------|------------|--------------------------------------------------------------|
| `spec.json`          | daemon     | the `JobSpec`: which checkpoint, device, tasks and settings  |
| `outcome-<i>.json`   | worker     | task i's `TaskOutcome`, as soon as that task ends            |
| `crash.json`         | worker     | what stopped the whole job (staging, loading the model)      |
| `progress.json`      | worker     | the task being evaluated: units done of its total (`Progress`) |
| `exit.json`          | worker     | the job's exit code, written last (`EXIT_*`)                 |
| `worker.log`         | worker     | its log (stdout and stderr); the daemon quotes its tail      |

Every file is written whole (tmp + fsync + rename), so a reader never sees half of one, and a
worker killed after task i keeps the outcomes of tasks 0..i. The worker's exit code says how
the job ended (`EXIT_*`; negative: killed by that signal); the exit file says it too, for a
daemon that did not start the worker (one that adopted it after a restart) and so cannot wait
for it. A worker that died without one was killed.

A warm worker (one per device, `jobs/_warm/<device>/`) takes job folders one after another: it
reads one folder per line on its stdin and reports each job's exit code as a status line
(`status_line`) on the file descriptor named by `STATUS_FD_ENV`; `engine.json` in its home says
what engine it holds, for `watcher status`. A line `prepare <folder>` instead asks it to start an
engine before its first checkpoint's weights exist (`PREPARE_DIR` in its home holds that
request's `spec.json`, whose checkpoint is the folder of the model's config and tokenizer, and
whose job id is the run); its status line, once the engine is up or has failed, names that
folder (0: ready), and then it takes the next line.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_watcher.checkpoints.naming import safe_component
from ckpt_watcher.durable import write_json_atomic
from ckpt_watcher.journal import JournalRef

# `python -m WORKER_MODULE JOB_DIR` runs one job; recovery recognises our workers by it
WORKER_MODULE = "ckpt_watcher.worker"
WORKER_NAME = "watcher-worker"  # every worker process's name (proctable.set_name)
STARTER_NAME = "watcher-starter"  # the worker starter's: its workers share its command line

EXIT_OK = 0  # every task ok
EXIT_TASK_FAILED = 3  # some task failed (its outcome says why)
EXIT_CRASH = 4  # the job stopped as a whole (crash.json says why, where the worker could say)
EXIT_CHANGED = 5  # the checkpoint's files are not those it was judged with: nothing more read

STATUS_FD_ENV = "CKPT_WATCHER_STATUS_FD"  # a warm worker's status pipe
DIE_WITH_PARENT_ENV = "CKPT_WATCHER_DIE_WITH"  # a worker SIGKILLed when this pid (its parent) dies
ENGINE_FILE = "engine.json"  # in a warm worker's home: the engine it holds
KILLED_FILE = "killed"  # in a warm worker's home: the pid the daemon killed on purpose
PREPARE_DIR = "prepare"  # in a warm worker's home: what its early engine is started for
PLACEHOLDER_DIR = "placeholder"  # in a warm worker's home: the early engine's config and tokenizer
# an S3 step's files an early engine starts on, as fetched: in the daemon's state_dir
# (jobs/early.py), and on a Ray node in the warm worker's home they were sent to (node_agent.py)
EARLY_META_DIR = "early-meta"
PREPARE_PREFIX = "prepare "  # a warm worker's stdin line that asks for an early engine
# Distinct jobs in a row that crashed on one device's warm workers (or died with one) before
# `watcher status` calls that warm engine failing (degraded). One bad checkpoint is retried on
# the same device: only different jobs tell an engine's problem from a checkpoint's.
WARM_FAILING_JOBS = 3

SPEC_FILE = "spec.json"
CRASH_FILE = "crash.json"
EXIT_FILE = "exit.json"
PROGRESS_FILE = "progress.json"
LOG_FILE = "worker.log"
_OUTCOME_GLOB = "outcome-*.json"
LOG_TAIL_LINES = 25
_WARM_FOLDER = "_warm"


# --- what the daemon asks ------------------------------------------------------------------
@dataclass(frozen=True)
class TaskRun:
    """One task entry as the worker runs it."""

    task: str
    num_fewshot: int | None
    name: str | None = None  # the entry's own name (one task twice with other settings)
    allow_code_execution: bool = False
    samples: int = 1
    gen_kwargs: dict[str, Any] | None = None
    pass_at: list[int] | None = None  # set: a sampled task
    apply_chat_template: bool = False
    think_end: str | None = None  # the end-of-thinking marker (lm-eval's think_end_token)
    unterminated: str | None = None  # as_is | wrong: a response that never wrote think_end
    journal: JournalRef | None = None  # where finished units are kept (None: not kept)
    harness: str = "lm-eval"  # lm-eval, or another harness (olmes, verifiers, command)
    harness_version: str = ""  # another harness's version, as probed in its interpreter
    spec: dict[str, Any] | None = None  # another harness's entry (harnesses/entries.py)
    sandbox: dict[str, Any] | None = None  # a code task's sandbox (config.SandboxConfig)

    @property
    def sampled(self) -> bool:
        return self.pass_at is not None

    @property
    def key(self) -> tuple[str, int | None]:
        """(name or task, num_fewshot): how outcomes and ledger lines tell entries apart."""
        return (self.name or self.task, self.num_fewshot)

    @classmethod
    def from_entry(cls, entry: dict[str, Any], journal: JournalRef | None = None) -> TaskRun:
        """From a task entry as the config dumps it (keys this version does not know dropped)."""
        known = {f.name for f in dataclasses.fields(cls)} - {"journal"}
        return cls(**{k: v for k, v in entry.items() if k in known}, journal=journal)


@dataclass
class EvalRequest:
    """Everything a worker needs to evaluate one checkpoint."""

    checkpoint: str
    backend: str
    model_args: dict[str, Any]
    tasks: list[TaskRun]
    seed: int
    gen_kwargs: dict[str, Any]
    max_gen_toks: int | None
    include_path: str | None
    batch_size: int | str | None  # None: the backend's own default (hf 1, vllm auto)
    limit: float | None
    results_dir: str
    device: str  # "cpu", "cuda", or "auto" (a Ray slot: whatever the node has)
    tensor_parallel_size: int = 1
    helps: str | None = None  # set: this worker joins that job's journaled tasks (see resume.py)
    compile_cache: str | None = (
        None  # where compiled kernels are kept (evaluators/compile_cache.py)
    )
    adapter_base: str | None = None  # the source's `adapter_base` (worker/merge.py)
    convert: list[str] | None = None  # the source's converter (formats/command.py)
    serve_adapters: bool = True  # eval.serve_adapters: an adapter served on vLLM, not merged
    # set by the worker only: the LoRA adapter served on `checkpoint` (then its base model)
    lora: str | None = None


@dataclass(frozen=True)
class Stage:
    """Where a worker stages a remote (S3) checkpoint before loading it."""

    location: str
    cache_dir: str
    endpoint_url: str | None = None
    request_timeout: float = 30.0


@dataclass
class JobSpec:
    """`spec.json`: one attempt of one job."""

    job_id: str
    device_label: str
    request: EvalRequest
    stage: Stage | None = None
    # the write mark of the files the job's fingerprint was taken from: the worker reads those
    # or nothing (checkpoints/files.check_unchanged)
    write_mark: str | None = None
    # the job's fingerprint: an adapter's merge checks its base is still the one it covers
    fingerprint: str | None = None
    run_path: str = ""  # the run's path under its source (a warm worker's engine is that run's)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        raw = json.loads(text)
        request = dict(raw["request"])
        request["tasks"] = [
            TaskRun.from_entry(t, JournalRef(**t["journal"]) if t.get("journal") else None)
            for t in request["tasks"]
        ]
        stage = raw.get("stage")
        return cls(
            job_id=raw["job_id"],
            device_label=raw["device_label"],
            request=EvalRequest(**request),
            stage=Stage(**stage) if stage else None,
            write_mark=raw.get("write_mark"),
            run_path=raw.get("run_path") or "",
            fingerprint=raw.get("fingerprint"),
        )


# --- what the worker answers ---------------------------------------------------------------
@dataclass
class TaskOutcome:
    """`outcome-<i>.json`: how task i of the job ended."""

    task: str
    num_fewshot: int | None
    status: str  # ok | failed | helped (a helper's part of another job's task is journaled)
    metrics: dict[str, Any] = field(default_factory=dict)
    n_samples: int | None = None
    clamped_requests: int = 0
    truncated_prompts: int = 0
    started_at: str = ""
    finished_at: str = ""
    results_file: str | None = None
    samples_file: str | None = None
    error: str | None = None
    heals: bool = True  # False: failing again as is is certain (evaluators/failures.py)
    lm_eval_version: str = ""
    engine: str | None = None  # cold: loaded for this job; warm: swapped into a kept engine
    engine_seconds: float | None = None  # to have the model ready for this job
    resumed: int = 0  # units of work taken from the task's journal instead of computed again
    devices: list[str] = field(default_factory=list)  # that computed its units (journaled tasks)
    name: str | None = None  # the task entry's name, where it has one
    lengths: dict[str, Any] | None = (
        None  # a generation task's response lengths (evaluators/lengths)
    )
    harness: str = "lm-eval"
    harness_version: str = ""
    # an entry that yields several results (OLMES: one per OLMES task): each part's task,
    # metrics, n_samples and files; `metrics` is then empty
    parts: list[dict[str, Any]] | None = None
    source_format: str | None = None  # the trainer's own format it was converted from
    convert_seconds: float | None = None
    # a LoRA/PEFT adapter saved alone, evaluated "served" on its base by vLLM (LoRA enabled)
    # or "merged" into a copy of its base (worker/merge.py)
    adapter: str | None = None
    no_op: str | None = None  # why the checkpoint is its base model (checkpoints/noop.py)

    @property
    def key(self) -> tuple[str, int | None]:
        return (self.name or self.task, self.num_fewshot)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TaskOutcome:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


@dataclass(frozen=True)
class Progress:
    """`progress.json`: how far the task being evaluated is."""

    task: str
    done: int  # units done (responses of a generation task, requests of a likelihood task)
    total: int
    unit: str  # "responses" | "requests"
    since: float  # when the worker began the task (Unix time)
    done_since: int  # units already done then (taken from the journal)
    at: float  # when this was written

    def eta_s(self) -> float | None:
        """Seconds left at the rate since the task began (None until there is a rate)."""
        made, took = self.done - self.done_since, self.at - self.since
        if made <= 0 or took <= 0:
            return None
        return round((self.total - self.done) * took / made, 1)


@dataclass(frozen=True)
class Crash:
    """`crash.json`: what stopped the whole job, classified like a task's error; `changed`:
    the checkpoint's files changed under it (it is judged again, no attempt spent)."""

    error: str
    heals: bool
    changed: bool = False


class JobFolder:
    """One attempt's folder, as both sides read and write it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def of(cls, state_dir: Path, job_id: str, attempt: int) -> JobFolder:
        return cls(jobs_root(state_dir) / job_id / f"attempt-{attempt}")

    @classmethod
    def helper(cls, state_dir: Path, job_id: str, attempt: int, device_label: str) -> JobFolder:
        """A helper's folder: a worker on another device that joins the attempt's tasks."""
        return cls(
            jobs_root(state_dir) / job_id / f"attempt-{attempt}-help-{safe_component(device_label)}"
        )

    def __str__(self) -> str:
        return str(self.path)

    @property
    def log(self) -> Path:
        return self.path / LOG_FILE

    # --- the daemon writes, the worker reads -------------------------------------------------
    def write_spec(self, spec: JobSpec) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path / SPEC_FILE, json.loads(spec.to_json()))

    def read_spec(self) -> JobSpec:
        return JobSpec.from_json((self.path / SPEC_FILE).read_text(encoding="utf-8"))

    def spec_text(self) -> str:
        """The spec as written (for executors that ship it elsewhere, Ray)."""
        return (self.path / SPEC_FILE).read_text(encoding="utf-8")

    # --- the worker writes, the daemon reads -------------------------------------------------
    def write_outcome(self, index: int, outcome: TaskOutcome) -> None:
        write_json_atomic(
            self.path / f"outcome-{index}.json",
            dataclasses.asdict(outcome),
            default=str,
            indent=None,
        )

    def outcomes(self) -> tuple[list[TaskOutcome], list[str]]:
        """Every outcome written so far, and the files that could not be read (each renamed into
        place whole, so that is a disk fault, never a torn write)."""
        out, unreadable = [], []
        for p in sorted(self.path.glob(_OUTCOME_GLOB)):
            try:
                out.append(TaskOutcome.from_dict(json.loads(p.read_text(encoding="utf-8"))))
            except (OSError, ValueError, TypeError) as e:
                unreadable.append(f"{p}: {e}")
        return out, unreadable

    def write_crash(self, crash: Crash) -> None:
        write_json_atomic(self.path / CRASH_FILE, dataclasses.asdict(crash))

    def crash(self) -> Crash | None:
        try:
            data = json.loads((self.path / CRASH_FILE).read_text(encoding="utf-8"))
            return Crash(str(data["error"]), bool(data["heals"]), bool(data.get("changed")))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write_progress(self, progress: Progress) -> None:
        write_json_atomic(self.path / PROGRESS_FILE, dataclasses.asdict(progress), indent=None)

    def progress(self) -> Progress | None:
        try:
            raw = json.loads((self.path / PROGRESS_FILE).read_text(encoding="utf-8"))
            return Progress(**raw)
        except (OSError, ValueError, TypeError):
            return None

    def write_exit(self, rc: int) -> None:
        write_json_atomic(self.path / EXIT_FILE, {"rc": rc})

    def exit_code(self) -> int | None:
        """The job's exit code, once its worker has written it (None: still running, or died
        before it could say)."""
        try:
            return int(json.loads((self.path / EXIT_FILE).read_text(encoding="utf-8"))["rc"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # --- files the worker sends back when it ran elsewhere (Ray) ------------------------------
    def results(self) -> dict[str, str]:
        """The worker's answer files by name (outcomes and crash), as text."""
        files = [*self.path.glob(_OUTCOME_GLOB), self.path / CRASH_FILE, self.path / EXIT_FILE]
        return {p.name: p.read_text(encoding="utf-8") for p in files if p.is_file()}

    def put_results(self, files: dict[str, str]) -> None:
        """Write back what `results` returned on another node."""
        for name, text in files.items():
            if Path(name).name != name or name == SPEC_FILE:
                raise ValueError(f"not a worker's answer file: {name!r}")
            (self.path / name).write_text(text, encoding="utf-8")


# --- where folders live ----------------------------------------------------------------------
def jobs_root(state_dir: Path) -> Path:
    """Every job folder and warm worker home is under here (recovery looks for strays by it)."""
    return state_dir / "jobs"


def warm_root(state_dir: Path) -> Path:
    """Where warm workers live, one home per device."""
    return jobs_root(state_dir) / _WARM_FOLDER


def warm_home(state_dir: Path, device_label: str) -> Path:
    return warm_root(state_dir) / safe_component(device_label)


def engine_files(state_dir: Path) -> list[dict[str, Any]]:
    """Each warm worker's `engine.json` as it last wrote it, by device; unreadable ones left out."""
    out = []
    for path in sorted(warm_root(state_dir).glob(f"*/{ENGINE_FILE}")):
        try:
            out.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return out


# --- a warm worker's status pipe ---------------------------------------------------------------
def status_line(rc: int, folder: Path) -> bytes:
    """What a warm worker writes on its status pipe when a job ends."""
    return f"{rc} {folder}\n".encode()


def parse_status_line(raw: bytes) -> tuple[int, str]:
    """(exit code, job folder) from a `status_line`."""
    rc, _, folder = raw.decode().strip().partition(" ")
    return int(rc), folder
