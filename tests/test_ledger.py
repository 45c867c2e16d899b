"""The ledger: durable appends, torn lines tolerated, one ok line per result identity."""

from __future__ import annotations

import json
from pathlib import Path

from ckpt_watcher.ledger import LedgerIndex, append, ledger_path, read_lines, result_key


def line(step: int, task: str = "gsm8k", status: str = "ok", settings: str = "h1") -> dict:
    return {
        "schema": 1,
        "run": "r",
        "step": step,
        "label": f"r_step{step}",
        "task": task,
        "num_fewshot": 8,
        "status": status,
        "metrics": {"acc,none": 0.5},
        "settings_hash": settings,
    }


def test_append_then_read_back(tmp_path: Path) -> None:
    append(tmp_path, line(1))
    append(tmp_path, line(2))
    rep = read_lines(ledger_path(tmp_path, "r"))
    assert [x["step"] for x in rep.lines] == [1, 2] and rep.skipped == 0


def test_torn_last_line_is_skipped_and_next_append_starts_clean(tmp_path: Path) -> None:
    append(tmp_path, line(1))
    path = ledger_path(tmp_path, "r")
    with open(path, "ab") as f:
        f.write(json.dumps(line(2)).encode()[:30])  # a crash in the middle of an append
    rep = read_lines(path)
    assert [x["step"] for x in rep.lines] == [1] and rep.skipped == 1
    append(tmp_path, line(3))
    rep = read_lines(path)
    assert [x["step"] for x in rep.lines] == [1, 3] and rep.skipped == 1


def test_index_refuses_a_second_ok_line_for_the_same_identity(tmp_path: Path) -> None:
    idx = LedgerIndex(tmp_path).load()
    assert idx.append(line(1))
    assert idx.append(line(1, status="failed"))  # failures are history, always appended
    assert not idx.append(line(1))
    assert idx.append(line(1, settings="h2"))  # other settings: another result
    reloaded = LedgerIndex(tmp_path).load()
    assert reloaded.is_ok(result_key("r", 1, "r_step1", "gsm8k", 8, "h1"))
    assert sum(1 for x in read_lines(ledger_path(tmp_path, "r")).lines if x["status"] == "ok") == 2
