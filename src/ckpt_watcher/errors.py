"""Every exception the watcher raises on purpose, in one flat module.

Messages say what happened and what to do next; the CLI prints them as one line.
"""

from __future__ import annotations


class WatcherError(Exception):
    """Base class: an expected failure with a message meant for the user."""


class ConfigError(WatcherError):
    """The config file or a --set override is invalid (CLI exit code 2)."""


class CheckpointError(WatcherError):
    """A checkpoint directory cannot be used as it is (bad name, bad files)."""


class HeaderUnreadable(CheckpointError):
    """A safetensors header is missing or cut short (maybe still being written), or, with
    `corrupt`, complete but impossible (a length no writer produces, JSON that does not parse)."""

    def __init__(self, message: str, corrupt: bool = False) -> None:
        super().__init__(message)
        self.corrupt = corrupt


class NamingFixError(CheckpointError):
    """The safetensors naming fix could not be applied safely."""


class AdapterError(CheckpointError):
    """A LoRA/PEFT adapter saved alone whose base model is not to be found here, or that
    cannot be merged into it."""


class NativeFormatError(CheckpointError):
    """A trainer's own checkpoint format (verl's FSDP shards, ...) that cannot be converted as
    it is: a rank missing or cut short, shards that do not make the tensor they claim, content
    that is not weights."""


class CheckpointChanged(CheckpointError):
    """The files an eval reads are no longer those the checkpoint was judged ready (and
    fingerprinted) with: it must be judged again before anything reads it."""


class LedgerError(WatcherError):
    """The ledger cannot be read or appended."""


class StateError(WatcherError):
    """The daemon's state database cannot be opened or is held by another daemon."""


class DaemonAlreadyRunning(StateError):
    """Another live daemon already owns this state_dir."""


class EvalError(WatcherError):
    """An evaluation failed inside the worker (bad task, backend refusal, crash)."""


class AdapterNotServed(EvalError):
    """vLLM refused to load a LoRA adapter on its base: the worker merges it instead.
    `base_refused`: vLLM cannot serve adapters on that base at all (its architecture)."""

    def __init__(self, message: str, base_refused: bool = False) -> None:
        super().__init__(message)
        self.base_refused = base_refused


class ResultsNotWritten(EvalError):
    """A task's results could not be written into the ledger folder (full, read-only, an NFS
    error): the task failed, but a retry resumes from its journal."""


class TaskSetupError(EvalError):
    """A task entry that cannot run as configured (e.g. samples on a multiple-choice task)."""


class BackendUnavailable(EvalError):
    """An optional backend is not installed; the message names the pip install line."""


class S3Error(WatcherError):
    """S3 refused for a reason retrying cannot fix (credentials, bucket, permissions)."""


class StagingError(WatcherError):
    """A checkpoint could not be staged safely (bad key, or a file that does not verify)."""


class ServerLost(EvalError):
    """The model server of a served harness died, or stopped making progress, mid-run: the
    attempt fails, and the next one starts a new server and resumes from the journal."""


class SwapError(EvalError):
    """A checkpoint's weights could not be swapped into a warm engine; the job loads cold."""
