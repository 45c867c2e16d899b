"""The W&B sink (`sinks: [{kind: wandb}]`), with W&B in offline mode, read back from the files it
records: keys against train/step, the training run's id, a cursor that survives restarts, and a
W&B that cannot be reached, which holds nothing up and loses nothing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.config import WandbSink
from ckpt_watcher.ledger import append
from ckpt_watcher.sinks.wandb import WandbSinkWorker, own_run_id

from .helpers import wandb_rows

pytest.importorskip("wandb")

ACC = "exact_match,none"


def ok_line(step: int | None, value: float, run_path: str = "exp/r", **over: Any) -> dict[str, Any]:
    return {
        "run": run_path.rsplit("/", 1)[-1],
        "run_path": run_path,
        "step": step,
        "checkpoint": f"/nowhere/{run_path}/step_{step}",
        "task": "gsm8k",
        "num_fewshot": 8,
        "status": "ok",
        "metrics": {ACC: value, "exact_match_stderr,none": 0.01},
    } | over


def next_second() -> None:
    """W&B names an offline run's folder by the second it started: a run resumed within the
    same second would share (and overwrite) the first one's folder."""
    time.sleep(1.05 - time.time() % 1)


def sink(tmp_path: Path, **over: Any) -> WandbSinkWorker:
    fields: dict[str, Any] = {"project": "proj", "mode": "offline", "dir": tmp_path / "wb"}
    cfg = WandbSink(kind="wandb", **(fields | over))
    return WandbSinkWorker(cfg, tmp_path / "ledgers", tmp_path / "state")


def test_ok_lines_are_logged_against_train_step_once_across_restarts(tmp_path: Path) -> None:
    ledgers = tmp_path / "ledgers"
    append(ledgers, ok_line(200, 0.5))
    append(ledgers, ok_line(100, 0.25))  # evaluated newest first: logged out of step order
    append(ledgers, ok_line(300, 0.0, status="failed", metrics={}))
    append(ledgers, ok_line(None, 0.9, label="final"))  # no step: not on the step axis
    s = sink(tmp_path)
    s.request("exp/r")
    s.close(60)
    run_id = own_run_id("proj", "exp/r")
    rows = wandb_rows(tmp_path / "wb", run_id, 2)
    assert rows == [
        {"train/step": 200, "eval/gsm8k/8shot/exact_match,none": 0.5},
        {"train/step": 100, "eval/gsm8k/8shot/exact_match,none": 0.25},
    ]
    # a restart: only what was appended since is sent
    append(ledgers, ok_line(400, 0.75, num_fewshot=None))
    next_second()
    s = sink(tmp_path)
    s.request("exp/r")
    s.request("exp/r")
    s.close(60)
    rows = wandb_rows(tmp_path / "wb", run_id, 3)
    assert [r["train/step"] for r in rows] == [200, 100, 400]
    assert rows[-1] == {"train/step": 400, "eval/gsm8k/default/exact_match,none": 0.75}
    assert s.logged == 1


def test_logs_into_the_training_run_named_beside_the_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "ckpts" / "r"
    (run_dir / "r_step100").mkdir(parents=True)
    (run_dir / "wandb-run-id").write_text("train0042\n")
    append(tmp_path / "ledgers", ok_line(100, 0.5, checkpoint=str(run_dir / "r_step100")))
    s = sink(tmp_path)
    s.request("exp/r")
    s.close(60)
    assert wandb_rows(tmp_path / "wb", "train0042", 1) == [
        {"train/step": 100, "eval/gsm8k/8shot/exact_match,none": 0.5}
    ]
    # the config's run_id wins over the file
    append(tmp_path / "ledgers", ok_line(100, 0.5, run_path="exp/q"))
    s = sink(tmp_path, run_id="fixed77")
    s.request("exp/q")
    s.close(60)
    assert [r["train/step"] for r in wandb_rows(tmp_path / "wb", "fixed77", 1)] == [100]


def test_an_unreachable_wandb_blocks_nothing_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    append(tmp_path / "ledgers", ok_line(100, 0.5))
    down = sink(tmp_path, mode="online")
    down.request("exp/r")  # returns at once: the work is on the sink's thread
    deadline = time.monotonic() + 120
    while down.failed_attempts == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert down.failed_attempts >= 1  # it tried, failed, and waits out its back-off
    down.close(5)  # bounded, though the retry is still waiting
    assert down.logged == 0
    # W&B back (offline here): the next start sends what the failed attempts did not
    monkeypatch.delenv("WANDB_BASE_URL")
    next_second()
    up = sink(tmp_path)
    up.request("exp/r")
    up.close(60)
    assert wandb_rows(tmp_path / "wb", own_run_id("proj", "exp/r"), 1) == [
        {"train/step": 100, "eval/gsm8k/8shot/exact_match,none": 0.5}
    ]
