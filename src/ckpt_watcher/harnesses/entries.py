"""Task entries of the harnesses other than lm-eval: OLMES, verifiers, any command.

An entry names its `harness:` (lm-eval entries, `config.TaskSpec`, need not) and a `name:`
(the ledger's `task`). Each runs on one checkpoint on one device inside the job's worker, in an
interpreter of the user's choosing (`venv:` or `python:`); the watcher never imports anything of
that environment (`harnesses/run.py` starts it as a subprocess).

As the rest of the watcher sees it, an entry is a dict (`entry()`) like an lm-eval entry's:
`task` is its name, `num_fewshot` null, and `harness`, `harness_version` and `spec` (every
setting of the entry) say how to run it. The settings hash covers all three
(`config.task_settings_hash`), so a new harness version or a changed setting re-evaluates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.@+-]*$"
HARNESSES = ("lm-eval", "olmes", "verifiers", "command")
# the distribution each harness's version is read from, in its own interpreter
DISTRIBUTIONS = {"olmes": "ai2-olmes", "verifiers": "verifiers"}
# settings that say where and how long a harness runs, never what it scores
UNSCORED_KEYS = frozenset({"venv", "python", "env", "timeout_seconds", "stall_seconds"})
PLACEHOLDERS = ("checkpoint", "device", "output_dir", "url", "model", "limit")


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True)

    name: str = Field(min_length=1, pattern=NAME_PATTERN)
    """The ledger's `task` for this entry (tables, plots, alerts and `--task` use it)."""
    venv: Path | None = None
    """The harness's own virtualenv: its `bin` leads PATH and its `python` runs the harness."""
    python: Path | None = None
    """The interpreter, instead of `venv` (its folder leads PATH). Neither: the watcher's own."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment for the harness (offline variables, API keys' names, ...)."""
    timeout_seconds: float | None = Field(None, gt=0)
    """This entry alone may run this long (default: the job's `eval.timeout_seconds`)."""

    @field_validator("venv", "python")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return v.expanduser() if v is not None else None

    @model_validator(mode="after")
    def _one_interpreter(self) -> _Entry:
        if self.venv is not None and self.python is not None:
            raise ValueError(f"entry {self.name!r}: give venv or python, not both")
        return self

    def interpreter(self) -> str | None:
        """The python that runs this harness (None: the watcher's own)."""
        if self.python is not None:
            return str(self.python)
        if self.venv is not None:
            return str(self.venv / "bin" / "python")
        return None

    def spec(self) -> dict[str, Any]:
        """Every setting of the entry but its name, as plain data (the worker's copy)."""
        return self.model_dump(mode="json", exclude={"name", "harness"})

    def scored(self) -> dict[str, Any]:
        """The settings that can change a score (`spec` less where and how long it runs)."""
        return {k: v for k, v in self.spec().items() if k not in UNSCORED_KEYS}

    def entry(self, version: str = "") -> dict[str, Any]:
        """This entry as the rest of the watcher handles task entries (see the module doc)."""
        return {
            "task": self.name,
            "num_fewshot": None,
            "harness": self.harness,  # type: ignore[attr-defined]
            "harness_version": version,
            "spec": self.spec(),
        }


class OlmesTask(_Entry):
    """An OLMES run (`olmes`, AI2's evaluation system) on every checkpoint."""

    harness: Literal["olmes"]
    task: list[str] = Field(min_length=1)
    """OLMES task specs as `olmes --task` takes them: names (`gsm8k::tulu`), suites
    (`tulu_3_dev`), JSON objects, or the path of a `.jsonl` file of task configs."""
    model_type: Literal["hf", "vllm"] = "hf"
    """OLMES's backend; either sees exactly one GPU, the job's."""
    model_args: dict[str, Any] = Field(default_factory=dict)
    """Merged over `{"model_path": <checkpoint>}` (e.g. `max_length`, `chat_template`)."""
    limit: int | None = Field(None, ge=1)
    """`olmes --limit`: the first N instances of each task."""
    task_args: dict[str, Any] | None = None
    """`olmes --task-args`, merged over every task's config."""

    @field_validator("task", mode="before")
    @classmethod
    def _listed(cls, v: Any) -> Any:
        import json

        one = [v] if isinstance(v, str | dict) else v
        # a JSON object (a task config merged over a named one) is passed as its text
        return [json.dumps(x, sort_keys=True) if isinstance(x, dict) else x for x in one or []]

    @model_validator(mode="after")
    def _checkpoint_is_ours(self) -> OlmesTask:
        if "model_path" in self.model_args:
            raise ValueError(
                f"entry {self.name!r}: model_args.model_path is set by the watcher to each "
                "checkpoint; remove it"
            )
        return self


class VerifiersTask(_Entry):
    """A verifiers environment (`vf-eval`) against the checkpoint, served on loopback."""

    harness: Literal["verifiers"]
    env_id: str = Field(min_length=1)
    """The environment (taskset) id `vf-eval` takes: an importable module in the harness's env."""
    num_examples: int = Field(-1, ge=-1)
    """Examples to evaluate (`-n`; -1: all)."""
    rollouts: int = Field(1, ge=1)
    """Rollouts per example (`-r`); with 0/1 rewards, pass@k for k up to this."""
    sampling: dict[str, Any] = Field(default_factory=dict)
    """vf-eval's `sampling` (temperature, max_tokens, top_p, stop, ...; lists and tables kept
    as written: the watcher gives them in a config file, not as flags)."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """The environment's (taskset's) settings, vf-eval's `env.taskset`."""
    chat_template: Path | None = None
    """A chat template file for the served model, for checkpoints without one."""
    max_error_rate: float = Field(0.0, ge=0, le=1)
    """Above this share of errored rollouts the result is `failed`, naming the first error."""
    concurrency: int | None = Field(None, ge=1)
    """Requests in flight at once (`--max-concurrent`); default: vf-eval's."""
    extra_args: list[str] = Field(default_factory=list)
    """More `vf-eval` arguments, as given (after the watcher's `@ file`, so they win)."""
    stall_seconds: float = Field(600.0, gt=0)
    """A model server that computes no token and answers nothing for this long while requests
    wait is taken as hung: it is killed and the attempt retried, resuming from the journal."""


class CommandTask(_Entry):
    """Any other harness: a command per checkpoint, its metrics read from a results file."""

    harness: Literal["command"]
    argv: list[str] = Field(min_length=1)
    """The command, run without a shell; `{checkpoint}`, `{device}`, `{output_dir}`, `{url}`,
    `{model}` and `{limit}` (`eval.limit`: a count, or below 1 a fraction; required where
    `eval.limit` is set) are replaced inside their own argument, never re-split."""
    serve: bool = False
    """Serve the checkpoint on loopback (vLLM's OpenAI server) for `{url}` and `{model}`."""
    stall_seconds: float = Field(600.0, gt=0)
    """With `serve`: a model server that computes no token and answers nothing for this long
    while requests wait is taken as hung: it is killed and the attempt retried, resuming from
    the journal."""
    results: CommandResults
    """Where the command leaves its metrics."""
    samples: str | None = None
    """An optional per-sample JSON-lines file (placeholders allowed; a relative path is in the
    folder the command runs in), kept for `watcher samples`."""
    version: str = ""
    """Your harness's version, part of the settings hash: change it to re-evaluate."""

    def _fields(self) -> list[tuple[str, str]]:
        """Each placeholder its command line and file names use, with the string it is in."""
        import string

        return [
            (arg, field)
            for arg in [*self.argv, self.results.file, self.samples or ""]
            for _, field, _, _ in string.Formatter().parse(arg)
            if field is not None
        ]

    def placeholders(self) -> set[str]:
        """The placeholders its command line and file names use."""
        return {field for _, field in self._fields()}

    @model_validator(mode="after")
    def _placeholders(self) -> CommandTask:
        for arg, field in self._fields():
            if field not in PLACEHOLDERS:
                raise ValueError(
                    f"entry {self.name!r}: unknown placeholder {{{field}}} in {arg!r} "
                    f"(it has: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}; "
                    "write {{ and }} for braces)"
                )
            if field in ("url", "model") and not self.serve:
                raise ValueError(
                    f"entry {self.name!r}: {{{field}}} needs `serve: true` (a loopback "
                    "server of the checkpoint)"
                )
        return self


class CommandResults(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    file: str = Field(min_length=1)
    """The results file (JSON), placeholders allowed: `{output_dir}/results.json`. A relative
    path is read in the folder the command runs in (`{output_dir}`); a file last written before
    the command started is refused (it is not this checkpoint's)."""
    metrics: dict[str, str] = Field(min_length=1)
    """Metric name -> dotted path in that file (`scores.f1`, `results.0.acc`)."""


CommandTask.model_rebuild()

HarnessEntry = OlmesTask | VerifiersTask | CommandTask
ENTRY_MODELS: dict[str, type[_Entry]] = {
    "olmes": OlmesTask,
    "verifiers": VerifiersTask,
    "command": CommandTask,
}
