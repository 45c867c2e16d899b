"""14 kill -9s of `watcher run` at random (seeded) moments across several checkpoints x 2 tasks,
each followed by a restart, with the default settings (warm workers, max_attempts 3): nothing
lost, nothing duplicated, nothing failed. With one-shot workers, 8 kills. (`bench/kill9.py`
runs longer loops: docs/benchmarks.md.)

Replay a failure with CKPT_WATCHER_FAULT_SEED=<the seed in the assertion message>.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "warm, kills", [(False, 8), (True, 14)], ids=["one-shot workers", "warm workers"]
)
def test_random_kill_9s_lose_duplicate_and_fail_nothing(
    tmp_path: Path, trained_checkpoint: Path, warm: bool, kills: int
) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import kill9
    finally:
        sys.path.pop(0)
    seed = int(os.environ.get("CKPT_WATCHER_FAULT_SEED", "20261121"))
    figures = kill9.fault_run(tmp_path, trained_checkpoint, kills=kills, seed=seed, warm=warm)
    lines = figures.pop("lines")
    assert figures["jobs_lost"] == 0, figures
    assert figures["jobs_duplicated"] == 0, figures
    assert figures["failed_lines"] == 0, figures
    assert figures["clean_exit"], figures
    assert figures["workers_left"] == [], figures
    assert figures["kills_survived"] == kills, figures
    assert len(lines) == 6
    # the seed puts some kills right after an append (the moment a duplicate would be made)
    assert figures["kills_right_after_a_ledger_append"] >= 1, figures
