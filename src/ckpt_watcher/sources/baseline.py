"""The base model as a source of exactly one checkpoint: `baseline.checkpoint` (a folder or an
S3 prefix), run `baseline`, step 0.

It is evaluated like any checkpoint (same settings, identity, ledger, retries), once: its
results are in `<ledger_dir>/baseline/`, and `watcher results` compares every step with them.
Everything but the listing is the inner source's (a local or S3 source rooted at the folder's
parent), so completeness, the naming fix, staging and fingerprints work unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_watcher.checkpoints.files import CheckpointFiles
from ckpt_watcher.checkpoints.naming import CheckpointId
from ckpt_watcher.config import BASELINE_RUN
from ckpt_watcher.jobfolder import Stage
from ckpt_watcher.sources.base import Found, Source

BASELINE_ID = CheckpointId(run=BASELINE_RUN, step=0, label="baseline", run_path=BASELINE_RUN)


def source_name(location: str) -> str:
    """How `watcher status` names the baseline's source."""
    return f"baseline:{location}"


class BaselineSource:
    def __init__(self, inner: Source, location: str, path: Path | None) -> None:
        self.inner = inner
        self.location = location
        self.path = path
        self.name = source_name(location)
        self.poll_seconds = inner.poll_seconds
        self.fingerprint_mode = inner.fingerprint_mode
        self.recheck_per_scan = inner.recheck_per_scan
        self.adapter_base = inner.adapter_base
        self.convert = inner.convert

    def owns(self, location: str) -> bool:
        return location == self.location

    def scan(self) -> list[Found]:
        if not self.inner.exists(self.location):
            raise FileNotFoundError(
                f"baseline.checkpoint {self.location} does not exist (yet): fix the path, or "
                "remove `baseline.checkpoint` from the config"
            )
        return [Found(self.location, self.path, BASELINE_ID)]

    def view(self, location: str) -> CheckpointFiles:
        return self.inner.view(location)

    def exists(self, location: str) -> bool:
        return self.inner.exists(location)

    def prepare(self, location: str) -> list[str]:
        return self.inner.prepare(location)

    def stage_spec(self, location: str) -> Stage | None:
        return self.inner.stage_spec(location)

    def hold(self, location: str) -> None:
        return None  # the base model is nobody's to delete

    def held(self, location: str, write_mark: str | None = None) -> bool:
        return False

    def release(self, location: str) -> None:
        self.inner.release(location)

    def make_room(self, needed: list[str]) -> None:
        self.inner.make_room(needed)

    def watch(self, wake: Callable[[], None]) -> bool:
        return False  # one checkpoint that does not change: polling is plenty

    def close(self) -> None:
        self.inner.close()


def baseline_lines(cfg: Any) -> list[dict[str, Any]]:
    """The baseline checkpoint's ledger lines (none without one, or before its first)."""
    from ckpt_watcher import ledger as ledger_mod

    if cfg.baseline is None or cfg.baseline.checkpoint is None:
        return []
    where = ledger_mod.ledger_path(cfg.ledger_dir, BASELINE_RUN)
    return ledger_mod.read_lines(where).lines if where.exists() else []


@dataclass(frozen=True)
class RunBaseline:
    """What a run is compared with."""

    values: dict[str, Any] | None  # the baseline by column (`report.baseline_values`); None: none
    name: str  # its row's name
    waiting: Path | None  # the baseline's ledger while its checkpoint has no results yet
    pairing: Any = None  # `report.table.Pairing` against its records (None: Δ marks by stderr)


def run_baseline(cfg: Any, run_path: str) -> RunBaseline:
    """What `run_path` is compared with, from the config's baseline and the evaluated
    baseline's ledger (read once). `cfg` is a WatcherConfig."""
    from ckpt_watcher import ledger as ledger_mod
    from ckpt_watcher.report.samples import baseline_pairing
    from ckpt_watcher.report.table import baseline_values

    if cfg.baseline is None:
        return RunBaseline(None, "baseline", None)
    evaluated: list[dict[str, Any]] = []
    waiting = None
    if cfg.baseline.checkpoint is not None and run_path != BASELINE_RUN:
        evaluated = baseline_lines(cfg)
        if not any(ln.get("status") == "ok" for ln in evaluated):
            waiting = ledger_mod.ledger_path(cfg.ledger_dir, BASELINE_RUN)
    fixed = [(e.task, e.num_fewshot, e.metrics) for e in cfg.baseline.metrics]
    return RunBaseline(
        baseline_values(fixed, evaluated) or None,
        cfg.baseline.name,
        waiting,
        baseline_pairing(Path(cfg.ledger_dir), evaluated),
    )
