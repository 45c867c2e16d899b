"""lm-eval tasks shipped with the watcher (YAML + utils, one folder per family). The worker puts
this folder on lm-eval's task path before `eval.include_path`, so their names work anywhere."""

from __future__ import annotations

from pathlib import Path

SHIPPED_TASKS = Path(__file__).resolve().parent


def task_paths(include_path: str | Path | None) -> list[str]:
    """lm-eval's `include_path` for the worker: the shipped tasks, then the user's folder."""
    return [str(SHIPPED_TASKS)] + ([str(include_path)] if include_path else [])
