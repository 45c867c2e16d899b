"""Checkpoint directory name -> (run, step, label), by the contract's rules only; never guessed."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
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


def parse_name(
    name: str, parent: str, trainer_state: Callable[[], bytes | None]
) -> CheckpointId | None:
    """Identify a checkpoint by its folder name (and its parent's); None if no pattern fits.

    `{run}_step{N}`, `{run}_final` (step from trainer_state.json, read through `trainer_state`,
    if present), or `checkpoint-{N}` / `global_step_{N}` / `step_{N}` with the parent as run.
    """
    if m := _RUN_STEP.match(name):
        return CheckpointId(run=m["run"], step=int(m["step"]), label=name)
    if m := _RUN_FINAL.match(name):
        return CheckpointId(run=m["run"], step=final_step(trainer_state()), label=name, final=True)
    if m := _PARENT_STEP.match(name):
        if not _SAFE_RUN.match(parent):
            return None
        return CheckpointId(run=parent, step=int(m["step"]), label=name)
    return None


def parse_checkpoint_dir(path: Path) -> CheckpointId | None:
    """Identify a local checkpoint directory by name."""

    def trainer_state() -> bytes | None:
        try:
            return (path / "trainer_state.json").read_bytes()
        except OSError:
            return None

    return parse_name(path.name, path.parent.name, trainer_state)


def final_step(trainer_state: bytes | None) -> int | None:
    """The global step recorded in a trainer_state.json, if any."""
    if trainer_state is None:
        return None
    try:
        state = json.loads(trainer_state)
    except ValueError:
        return None
    step = state.get("global_step") if isinstance(state, dict) else None
    return step if isinstance(step, int) and step >= 0 else None
