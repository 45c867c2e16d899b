"""End to end on the hf backend: a trainer writes checkpoints while `watcher run` watches."""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from .conftest import base_config, read_ledger, reshard_in_two, write_config
from .helpers import lm_eval_cli, status_json, trainer_command, wait_for, watcher_run

pytestmark = pytest.mark.e2e


def split_in_two_shards(ckpt: Path) -> Path:
    """Re-save a checkpoint's weights as a 2-shard series with its index; return shard 2."""
    return ckpt / reshard_in_two(ckpt)[1]


def test_trainer_and_watcher_side_by_side_match_lm_eval(
    tmp_path: Path, addition_tasks: Path
) -> None:
    watch = tmp_path / "ckpts"
    watch.mkdir()
    tasks = [{"task": "addition", "num_fewshot": 0}, {"task": "addition", "num_fewshot": 2}]
    # batch size 4: the journal asks the engine for 32 responses at a time (4 chunks of the
    # 100 documents), in lm-eval's own order, so the numbers must still equal lm_eval's
    cfg = write_config(
        tmp_path / "w.yaml",
        base_config(tmp_path, watch, addition_tasks, tasks=tasks, batch_size=4),
    )
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        wait_for(lambda: status_json(cfg)[0] == 0, 60, "the daemon to be up", daemon, log)
        trainer = subprocess.run(
            trainer_command(watch, "e2e", 150, 50),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert trainer.returncode == 0, trainer.stderr[-2000:]
        wait_for(
            lambda: len(read_ledger(tmp_path / "ledgers", "e2e")) >= 6,
            400,
            "6 ledger lines (3 checkpoints x 2 tasks)",
            daemon,
            log,
        )
        # the ledger line is written before the state's mark (the crash-safe order): wait for it
        code, status = wait_for(
            lambda: (s := status_json(cfg))[1] and s[1]["checkpoint_counts"].get("done") == 3 and s,
            30, "3 checkpoints done", daemon, log,
        )  # fmt: skip
        assert code == 0 and status is not None
        assert status["daemon"]["alive"] and status["checkpoint_counts"].get("done") == 3
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    assert status_json(cfg)[0] == 3  # down now

    lines = read_ledger(tmp_path / "ledgers", "e2e")
    assert all(ln["status"] == "ok" for ln in lines)
    counts = Counter((ln["step"], ln["task"], ln["num_fewshot"]) for ln in lines)
    assert counts == {(s, "addition", k): 1 for s in (50, 100, 150) for k in (0, 2)}
    for ln in lines:
        assert ln["device"] == "cpu:0" and ln["backend"] == "hf" and ln["seed"] == 42
        assert ln["n_samples"] == 100 and ln["clamped_requests"] == 0 and ln["resumed"] == 0
        assert (tmp_path / "ledgers" / "e2e" / ln["results_file"]).is_file()
        assert Path(ln["checkpoint"], "model-00001-of-00001.safetensors").exists()  # naming fix

    # fidelity: the same numbers as lm_eval itself, run directly on the same checkpoint with
    # 2 shots (the task's own default is 0 shots: a 0 lost on the way would still read 0, so a
    # direct 0-shot run would show nothing more; the two settings do score differently)
    direct = lm_eval_cli(
        watch / "e2e_step150", addition_tasks, "addition", 2, tmp_path / "direct2", batch_size="4"
    )
    at150 = {ln["num_fewshot"]: ln for ln in lines if ln["step"] == 150}
    expected = {k: v for k, v in direct["results"]["addition"].items() if "," in k}
    assert at150[2]["metrics"] == expected
    assert at150[0]["metrics"] != at150[2]["metrics"]
    assert any(
        ln["metrics"]["exact_match,none"] > 0 for ln in lines
    )  # the comparison is not 0 == 0


def test_half_written_checkpoints_are_held_back_then_evaluated(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    watch = tmp_path / "ckpts"
    truncated = copy_checkpoint(watch / "hb_step1")
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    no_shard = copy_checkpoint(watch / "hb_step2")
    shard2 = split_in_two_shards(no_shard)
    shard2_bytes = shard2.read_bytes()
    shard2.unlink()  # the trainer has not written the second shard yet
    no_config = copy_checkpoint(watch / "hb_step3")
    config = (no_config / "config.json").read_bytes()
    (no_config / "config.json").unlink()

    cfg = write_config(tmp_path / "w.yaml", base_config(tmp_path, watch, addition_tasks))
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:

        def three_waiting():
            _, st = status_json(cfg)
            return (
                st
                and st["checkpoint_counts"].get("incomplete") == 3
                and st["sources"][0]["last_scan_age_s"] is not None
                and st
            )

        st = wait_for(three_waiting, 60, "3 incomplete checkpoints", daemon, log)
        reasons = {c["label"]: c["reason"] for c in st["checkpoints"]}
        assert "bytes written" in reasons["hb_step1"]
        assert reasons["hb_step2"] == "1 of 2 shards present"
        assert reasons["hb_step3"] == "config.json not written yet"
        scans = st["sources"][0]["last_scan_at"]
        wait_for(
            lambda: status_json(cfg)[1]["sources"][0]["last_scan_at"] != scans, 10, "another scan"
        )
        assert read_ledger(tmp_path / "ledgers", "hb") == []
        assert not list((tmp_path / "state").glob("jobs/*"))  # nothing was started

        (truncated / "model.safetensors").write_bytes(weights)
        shard2.write_bytes(shard2_bytes)
        (no_config / "config.json").write_bytes(config)
        wait_for(
            lambda: len(read_ledger(tmp_path / "ledgers", "hb")) >= 3, 300, "3 results", daemon, log
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    lines = read_ledger(tmp_path / "ledgers", "hb")
    assert sorted((ln["step"], ln["status"]) for ln in lines) == [(1, "ok"), (2, "ok"), (3, "ok")]
