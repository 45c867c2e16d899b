"""Crash-safe writes (durable.py) by two writers at once: a task check's process outlives the
daemon killed -9 that started it and writes its cache while the next daemon's check writes the
same file (bench/kill9.py saw the second one fail: its temporary file renamed away)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from ckpt_watcher.durable import write_json_atomic


def test_two_writers_of_one_file_at_once_both_succeed(tmp_path: Path) -> None:
    target = tmp_path / "taskcheck.json"
    errors: list[BaseException] = []

    def write(who: int) -> None:
        try:
            for i in range(300):
                write_json_atomic(target, {"who": who, "i": i})
        except BaseException as e:  # noqa: BLE001 - the test reports any
            errors.append(e)

    threads = [threading.Thread(target=write, args=(w,)) for w in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(target.read_text())["i"] == 299  # whole, from one writer or the other
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taskcheck.json"]  # nothing left
