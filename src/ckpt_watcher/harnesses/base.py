"""What every harness adapter shares: the context it runs in, what it reads back, and the
interface it offers the runner (`run.py`). A leaf of the package: the adapters import it, the
runner imports the adapters, and nothing here imports either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

LOG_NAME = "harness.log"
LOG_TAIL_LINES = 15


@dataclass
class Context:
    """What a harness's command line and reader need to know."""

    spec: dict[str, Any]
    checkpoint: str
    output_dir: Path
    device: str  # the job's device label (`cpu-0`, `cuda:6`)
    compute: str  # cpu | cuda
    seed: int
    limit: float | None
    url: str = ""  # the loopback endpoint (served harnesses)
    model: str = ""
    started: float = 0.0  # when the harness's process started (time.time())


@dataclass
class Parsed:
    """What a harness's files say."""

    metrics: dict[str, Any]
    n_samples: int | None
    records: list[dict[str, Any]] = field(default_factory=list)  # watcher samples format
    parts: list[dict[str, Any]] | None = None  # OLMES: one per OLMES task
    error: str | None = None  # set: the result is failed, for this reason
    results_file: str | None = None


class Harness(Protocol):
    def served(self, spec: dict[str, Any]) -> bool: ...
    def argv(self, ctx: Context) -> list[str]: ...
    def environ(self, ctx: Context, env: dict[str, str]) -> dict[str, str]: ...
    def read(self, ctx: Context, returncode: int) -> Parsed: ...
    def total(self, ctx: Context) -> int | None: ...


def log_tail(ctx: Context) -> str:
    """The end of the harness's log, for an error that must say what it printed."""
    try:
        lines = (ctx.output_dir / LOG_NAME).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-LOG_TAIL_LINES:])
