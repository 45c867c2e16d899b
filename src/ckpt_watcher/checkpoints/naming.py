"""Checkpoint directory name -> (run, step, label), by the contract's rules only; never guessed."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# Run names become folder names under ledger_dir: keep them to characters that are safe there.
_RUN_RE = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_RUN_STEP = re.compile(rf"^(?P<run>{_RUN_RE})_step(?P<step>\d{{1,12}})$")
_RUN_FINAL = re.compile(rf"^(?P<run>{_RUN_RE})_final$")
_PARENT_STEP = re.compile(r"^(?:checkpoint-|global_step_|step_)(?P<step>\d{1,12})$")
_SAFE_RUN = re.compile(rf"^{_RUN_RE}$")


@dataclass(frozen=True)
class CheckpointId:
    """Who a checkpoint is: its run, its step (None for a final without trainer_state), its label."""

    run: str
    step: int | None
    label: str
    final: bool = False


def looks_like_checkpoint_name(name: str) -> bool:
    """True if a directory name follows one of the contract's checkpoint patterns."""
    return bool(_RUN_STEP.match(name) or _RUN_FINAL.match(name) or _PARENT_STEP.match(name))


def parse_checkpoint_dir(path: Path) -> CheckpointId | None:
    """Identify a checkpoint directory by name; None if it follows no known pattern.

    `{run}_step{N}`, `{run}_final` (step from trainer_state.json if present), or
    `checkpoint-{N}` / `global_step_{N}` / `step_{N}` with the parent directory as run.
    """
    name = path.name
    if m := _RUN_STEP.match(name):
        return CheckpointId(run=m["run"], step=int(m["step"]), label=name)
    if m := _RUN_FINAL.match(name):
        return CheckpointId(run=m["run"], step=final_step(path), label=name, final=True)
    if m := _PARENT_STEP.match(name):
        run = path.parent.name
        if not _SAFE_RUN.match(run):
            return None
        return CheckpointId(run=run, step=int(m["step"]), label=name)
    return None


def final_step(path: Path) -> int | None:
    """The global step recorded in a final checkpoint's trainer_state.json, if any."""
    try:
        state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    step = state.get("global_step") if isinstance(state, dict) else None
    return step if isinstance(step, int) and step >= 0 else None
