"""Which failures can heal by themselves, in one table.

A crash, a killed or timed-out worker, memory pressure or a flaky filesystem may not happen
again: the daemon retries those (`eval.max_attempts`). The failures below will happen the same
way every time until someone changes something, so they get one attempt and a `failed` line that
says what to change; `watcher requeue` runs them again afterwards. Classified in the worker,
where the exception itself is at hand; the daemon reads the verdict from the outcome files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ckpt_watcher.errors import AdapterError, NativeFormatError, TaskSetupError

REQUEUE = "then `watcher requeue`"


@dataclass(frozen=True)
class Failure:
    error: str  # "<ExceptionType>: message (what to do)"
    heals: bool  # True: worth retrying as is


def _text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


def _is(names: tuple[str, ...]) -> Callable[[BaseException], bool]:
    """Matches an exception whose class, or a base class, has one of these names (lets the
    table name jinja2's or datasets' exceptions without importing them)."""
    return lambda e: any(c.__name__ in names for c in type(e).__mro__)


# (what it is, does the exception match, what to do). First match wins; no match heals.
CANNOT_HEAL: list[tuple[str, Callable[[BaseException, str], bool], str]] = [
    (
        "task entry cannot run as configured",
        lambda e, t: isinstance(e, TaskSetupError),
        f"change the task's entry in eval.tasks; {REQUEUE}",
    ),
    (
        "unknown task",
        lambda e, t: isinstance(e, KeyError) and "is not a registered task" in t,
        f"check the task name; custom tasks need eval.include_path; {REQUEUE}",
    ),
    (
        "missing data file",
        lambda e, t: isinstance(e, FileNotFoundError) and "Unable to find" in t,
        f"create it, or fix dataset_kwargs.data_files in the task's YAML; {REQUEUE}",
    ),
    (
        "code execution not allowed",
        lambda e, t: "unsafe" in t.lower() and "code" in t.lower(),
        f"the task executes model-written code: set allow_code_execution: true on its entry; {REQUEUE}",
    ),
    (
        "task template names a missing field",
        lambda e, t: _is(("UndefinedError",))(e),
        f"fix the task's YAML (doc_to_text / doc_to_target); {REQUEUE}",
    ),
    (
        "adapter that cannot be merged into its base",
        lambda e, t: isinstance(e, AdapterError),
        f"as the error says; {REQUEUE}",
    ),
    (
        "trainer's shards that do not make a model",
        lambda e, t: isinstance(e, NativeFormatError),
        "as the error says: the trainer's save is not whole or not what its files claim; once "
        "it is saved again it is a new version of the checkpoint and is evaluated by itself",
    ),
    (
        "weights file truncated or corrupt",
        lambda e, t: _is(("SafetensorError",))(e),
        "a safetensors file of the checkpoint is truncated or corrupt: check that the trainer "
        "finished writing it (disk full? killed mid-save?); once rewritten it is a new version "
        "of the checkpoint and is evaluated by itself",
    ),
    (
        "checkpoint cannot be loaded",
        lambda e, t: (
            isinstance(e, OSError | ValueError)
            and any(
                s in t
                for s in (
                    "config.json",
                    "config file at",
                    "Unrecognized model",
                    "Can't load tokenizer",
                    "tokenizer",
                    "does not appear to have a file named",
                )
            )
        ),
        f"the checkpoint's config.json or tokenizer files cannot be loaded: re-save them; {REQUEUE}",
    ),
]


def classify(e: BaseException) -> Failure:
    """The error line for a failure, and whether retrying it as is can help."""
    text = _text(e)
    for _what, matches, todo in CANNOT_HEAL:
        if matches(e, text):
            return Failure(f"{text[:1800]} ({todo})", heals=False)
    return Failure(text[:2000], heals=True)
