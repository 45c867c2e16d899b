"""Model-written code, run where it can do no harm, judged by CPU time rather than the clock.

One interface turns programs into verdicts (`Sandbox.run`, `Sandbox.run_many`), whatever runs
them: `bwrap.py` (bubblewrap: namespaces, a read-only view of the interpreter, a private /tmp, no
network, no host process in sight, no new process, rlimits), the only real one; or, by an
explicit setting whose name says it (`eval.sandbox.run_model_code_unsandboxed`), the same runner
with its limits and no isolation. `open_sandbox` builds one from the config and proves it works
on this host first, else raises `SandboxUnavailable` saying why and what to do.

A program judged against tests (LiveCodeBench's) gets their inputs only and reports what it
gave; `judge.py` compares outside the sandbox, so the expected outputs are never within a
program's reach.

Each program runs in a process of its own, forked for it by a server kept in the sandbox
(`forkserver.py`, one per parallel slot: a program costs a fork, not a sandbox and an
interpreter; nothing a program does there reaches the next one's verdict), under `runner.py`,
which sets its limits and reports its verdict: `passed`, `failed` (an assertion), `timeout` (CPU time), `memory`, `runtime_error`
or `syntax_error`, with the first lines of its error. Limits are CPU seconds, so a correct
program passes on a busy host as on an idle one; the wall-clock limit is only a backstop
(a program that sleeps).
"""

from __future__ import annotations

from ckpt_watcher.sandbox.launch import Sandbox, open_sandbox
from ckpt_watcher.sandbox.program import (
    STATUSES,
    Limits,
    Program,
    SandboxFailure,
    SandboxUnavailable,
    Verdict,
)

__all__ = [
    "STATUSES",
    "Limits",
    "Program",
    "Sandbox",
    "SandboxFailure",
    "SandboxUnavailable",
    "Verdict",
    "open_sandbox",
]
