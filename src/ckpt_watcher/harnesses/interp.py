"""The interpreter a harness runs in: its python, a PATH its `bin` leads, and its version.

A harness's own virtualenv can never share the watcher's (OLMES pins torch<2.9, numpy<2, an
older lm-eval): the watcher only starts programs there and reads the files they write.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ckpt_watcher.harnesses.entries import DISTRIBUTIONS

PROBE_TIMEOUT_SECONDS = 60.0


def python_of(spec: dict[str, Any]) -> str:
    """The python that runs an entry: its `python`, its `venv`'s, or the watcher's own."""
    if spec.get("python"):
        return str(spec["python"])
    if spec.get("venv"):
        return str(Path(spec["venv"]) / "bin" / "python")
    return sys.executable


def bin_dir(spec: dict[str, Any]) -> str:
    """The folder that leads PATH for the harness (OLMES runs `python -m ...` from PATH)."""
    if spec.get("venv"):
        return str(Path(spec["venv"]) / "bin")
    return str(Path(python_of(spec)).parent)


def environment(spec: dict[str, Any], base: dict[str, str] | None = None) -> dict[str, str]:
    """The harness's environment: the worker's (its device's variables included), the
    interpreter's `bin` leading PATH, `VIRTUAL_ENV` where it is a venv, the entry's `env`
    over all; nothing of the watcher's own venv on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env["PATH"] = bin_dir(spec) + os.pathsep + env.get("PATH", "")
    if spec.get("venv"):
        env["VIRTUAL_ENV"] = str(spec["venv"])
    env.pop("PYTHONHOME", None)
    env.update({k: str(v) for k, v in (spec.get("env") or {}).items()})
    return env


def program(spec: dict[str, Any], name: str) -> str:
    """A console script of the harness's interpreter (`olmes`, `vf-eval`), found in its bin
    folder first, then on the harness's PATH."""
    here = Path(bin_dir(spec)) / name
    if here.exists():
        return str(here)
    found = shutil.which(name, path=environment(spec).get("PATH"))
    if found is None:
        raise FileNotFoundError(f"{name} is not installed in {bin_dir(spec)}")
    return found


class InterpreterProblem(Exception):
    """The harness's interpreter is missing, does not run, or lacks the harness."""


def probe(harness: str, spec: dict[str, Any]) -> str:
    """The harness's version, read in its own interpreter (`""` for a command, which has no
    package); raises InterpreterProblem saying what to fix."""
    python = python_of(spec)
    where = f"venv {spec['venv']}" if spec.get("venv") else f"python {python}"
    if not Path(python).exists():
        raise InterpreterProblem(
            f"{where}: {python} does not exist; create the environment or fix the path"
        )
    dist = DISTRIBUTIONS.get(harness)
    code = "import importlib.metadata as m, sys; " + (
        f"print(m.version({dist!r}))" if dist else "print(sys.version.split()[0])"
    )
    try:
        r = subprocess.run(
            [python, "-c", code],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_SECONDS,
            env=environment(spec),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InterpreterProblem(f"{where}: {python} does not run ({e})") from e
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        if dist and "PackageNotFoundError" in r.stderr:
            raise InterpreterProblem(
                f"{where}: {dist} is not installed there (pip install it into that environment)"
            )
        raise InterpreterProblem(f"{where}: {python} failed: {last}")
    return r.stdout.strip() if dist else ""
