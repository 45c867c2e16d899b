"""What a sandbox is given and what it answers: a program, its limits, its verdict."""

from __future__ import annotations

from dataclasses import dataclass, field

STATUSES = ("passed", "failed", "timeout", "memory", "runtime_error", "syntax_error")


@dataclass(frozen=True)
class Limits:
    """What one program may use (`eval.sandbox`'s keys)."""

    cpu_seconds: float = 10.0
    wall_seconds: float = 60.0
    memory_mb: int = 2048
    processes: int = 1
    file_size_mb: int = 16
    open_files: int = 64
    tmp_mb: int = 64


@dataclass(frozen=True)
class Program:
    """A model-written program: its source, its stdin, and how it runs: as lm-eval's
    `code_eval` runs one (`as_main` false: an empty namespace, output swallowed, the same
    guard), as a script (`as_main`: `__name__ == "__main__"`, its stdout kept), or against
    `tests`, each with the CPU limit on its own (LiveCodeBench's protocol)."""

    source: str
    stdin: str = ""
    as_main: bool = False
    # judged against these tests instead ({"input", "output"} each; runner.py's protocol):
    # `call` names the function (or Solution's method) each test calls; None: stdin/stdout
    tests: tuple[dict[str, str], ...] | None = None
    call: str | None = None


@dataclass(frozen=True)
class Verdict:
    status: str  # one of STATUSES
    error: str = ""  # the first lines of what went wrong
    stdout: str = ""  # what an `as_main` program printed (capped)
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class SandboxUnavailable(Exception):
    """The sandbox cannot run here: the message says why and what to do."""


class SandboxFailure(Exception):
    """The sandbox itself failed on one program (not the program): no verdict was reached."""
