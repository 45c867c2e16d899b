"""Pins: a trainer that keeps only its last 2 checkpoints, beside a watcher slower than it (and
killed -9 part way), loses none of them to its deletes: each due checkpoint's files are held (hard links beside it) until
its results are in, and every pin is released after. Pins on a filesystem that takes no hard
links there: said once, nothing pinned, everything else as before."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from ckpt_watcher.checkpoints.namefix import apply_fix
from ckpt_watcher.pins import PIN_FOLDER, Pins, held_alone, pin_path
from ckpt_watcher.state import State

from .conftest import base_config, read_ledger, write_config, write_fake_checkpoint
from .helpers import status_json, trainer_command, wait_for, watcher_run


@pytest.mark.e2e
def test_a_keep_last_2_trainer_beside_a_slower_watcher_loses_no_checkpoint_even_across_a_kill_9(
    tmp_path: Path, addition_tasks: Path
) -> None:
    watch = tmp_path / "ckpts"
    watch.mkdir()
    tasks = [{"task": "addition", "num_fewshot": 0}, {"task": "addition", "num_fewshot": 2}]
    cfg = write_config(
        tmp_path / "w.yaml", base_config(tmp_path, watch, addition_tasks, tasks=tasks)
    )
    log = tmp_path / "daemon.log"
    ledger = tmp_path / "ledgers"
    with watcher_run(cfg, log) as daemon:
        wait_for(lambda: status_json(cfg)[0] == 0, 60, "the daemon to be up", daemon, log)
        trainer = subprocess.Popen(
            trainer_command(watch, "keep", 120, 20, "--keep-last", "2"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        # part way (a result in, more checkpoints pinned), the daemon is killed; the trainer
        # goes on deleting while no daemon runs
        wait_for(lambda: read_ledger(ledger, "keep"), 300, "a first result", daemon, log)
        assert status_json(cfg)[1]["pinned"], "nothing pinned while evals wait"
        daemon.kill()
        daemon.wait()
    with watcher_run(cfg, log) as daemon:
        out, _ = trainer.communicate(timeout=600)
        assert trainer.returncode == 0, out[-2000:]
        deleted = [line for line in out.splitlines() if line.startswith("deleted ")]
        assert len(deleted) == 4, out  # the trainer deleted steps 20-80 as it went
        wait_for(
            lambda: len(read_ledger(ledger, "keep")) >= 12,
            600,
            "12 ledger lines (6 checkpoints x 2 tasks)",
            daemon,
            log,
        )
        st = wait_for(
            lambda: (s := status_json(cfg)[1]) and not s["pinned"] and s, 30, "pins released"
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    lines = read_ledger(ledger, "keep")
    assert all(ln["status"] == "ok" for ln in lines), [ln.get("error") for ln in lines]
    counts = Counter((ln["step"], ln["num_fewshot"]) for ln in lines)
    assert counts == {(s, k): 1 for s in range(20, 121, 20) for k in (0, 2)}
    assert st["checkpoint_counts"].get("missed") is None, st["checkpoint_counts"]
    assert sorted(p.name for p in watch.iterdir()) == ["keep_step100", "keep_step120"]
    events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    assert any(e.get("event") == "checkpoint.deleted_pinned" for e in events), "never needed"


def test_a_filesystem_without_hard_links_there_is_said_once_and_nothing_is_pinned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    # the pin folder on another filesystem than the checkpoint: os.link answers EXDEV
    elsewhere = Path(__import__("tempfile").mkdtemp(dir=shm))
    monkeypatch.setattr("ckpt_watcher.pins.pin_path", lambda loc: elsewhere / Path(loc).name)
    state = State(tmp_path / "state")
    pins = Pins(state, max_bytes=None)
    a = write_fake_checkpoint(tmp_path / "ck" / "r_step1")
    b = write_fake_checkpoint(tmp_path / "ck" / "r_step2")
    assert pins.pin(str(a), "fa", 1.0) is None and pins.pin(str(b), "fb", 2.0) is None
    assert pins.refused and pins.all() == {}
    assert not elsewhere.exists() or not list(elsewhere.iterdir())
    state.close()


def test_a_pin_of_files_the_trainer_still_keeps_costs_no_budget_and_a_file_counts_once(
    tmp_path: Path,
) -> None:
    """Two pins of 140-GB-like checkpoints the trainer keeps hold no disk of their own; with the
    naming fix's second name for the weights, a deleted checkpoint's weights count once."""
    state = State(tmp_path / "state")
    pins = Pins(state, max_bytes=1)  # any byte held only by pins is over
    fixed = write_fake_checkpoint(tmp_path / "ck" / "r_step1", naming_bug=True)
    apply_fix(fixed)  # model-00001-of-00001.safetensors: a second name of model.safetensors
    other = write_fake_checkpoint(tmp_path / "ck" / "r_step2")
    for i, ck in enumerate((fixed, other)):
        assert pins.pin(str(ck), f"f{i}", float(i)) is not None
        assert pins.keep_within_budget(started=set()) == [], "nothing pinned costs any disk"
    assert pins.held_bytes() == 0
    shutil.rmtree(fixed)  # keep-last-k: the weights now live on in the pin alone, under 2 names
    files = list(pin_path(str(fixed)).iterdir())
    by_name = sum(p.stat().st_size for p in files)
    by_file = sum({(p.stat().st_ino): p.stat().st_size for p in files}.values())
    weights = (pin_path(str(fixed)) / "model.safetensors").stat().st_size
    assert by_file == by_name - weights  # the weights have two names in the pin
    assert held_alone(pins.all()) == {str(fixed): by_file, str(other): 0}
    assert pins.keep_within_budget(started=set()) == [str(fixed)]  # now over budget
    state.close()


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSYS])
def test_a_read_only_or_linkless_mount_is_said_once_and_nothing_is_pinned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """A trainer's folder mounted read-only (EROFS), or a FUSE filesystem with no link()
    (ENOSYS): one `pin.refused`, not a `pin.failed` for every checkpoint."""

    def refuse(src: object, dst: object, **kw: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("ckpt_watcher.pins.os.link", refuse)
    state = State(tmp_path / "state")
    pins = Pins(state, max_bytes=None)
    a = write_fake_checkpoint(tmp_path / "ck" / "r_step1")
    b = write_fake_checkpoint(tmp_path / "ck" / "r_step2")
    assert pins.pin(str(a), "fa", 1.0) is None
    assert len(pins.refused) == 1
    assert pins.pin(str(b), "fb", 2.0) is None and pins.all() == {}
    state.close()


def test_pins_hold_the_files_release_cleanly_and_keep_within_their_budget(tmp_path: Path) -> None:
    state = State(tmp_path / "state")
    pins = Pins(state, max_bytes=None)
    cks = [write_fake_checkpoint(tmp_path / "ck" / f"r_step{i}") for i in (1, 2, 3)]
    for i, ck in enumerate(cks[:2]):
        pin = pins.pin(str(ck), f"f{i}", float(i))
        assert pin is not None and Path(pin.path) == pin_path(str(ck))
        assert (Path(pin.path) / "model.safetensors").stat().st_ino == (
            ck / "model.safetensors"
        ).stat().st_ino  # the same data, no byte copied
    # the trainer deletes step 1: its pinned copy is whole
    data = (cks[0] / "model.safetensors").read_bytes()
    shutil.rmtree(cks[0])
    assert (pin_path(str(cks[0])) / "model.safetensors").read_bytes() == data
    assert pins.path(str(cks[0])) == str(pin_path(str(cks[0])))
    # the budget counts the disk only pins hold: step 1's files (the trainer deleted them),
    # not step 2's or step 3's, which the trainer still keeps (a pin of them costs nothing)
    assert pins.pin(str(cks[2]), "f2", 3.0) is not None
    alone = held_alone(pins.all())
    assert alone == {str(cks[0]): pins.all()[str(cks[0])].bytes, str(cks[1]): 0, str(cks[2]): 0}
    pins.max_bytes = alone[str(cks[0])]
    assert pins.keep_within_budget(started=set()) == []
    # the trainer deletes step 2 as well: over budget, the oldest not started (step 1) goes
    shutil.rmtree(cks[1])
    assert pins.keep_within_budget(started=set()) == [str(cks[0])]
    assert pins.path(str(cks[0])) is None and not pin_path(str(cks[0])).exists()
    # a rewrite in place is pinned again; a sweep releases what no job needs
    first = pins.all()[str(cks[2])]
    assert pins.pin(str(cks[2]), "f2-rewritten", 4.0).fingerprint == "f2-rewritten"  # type: ignore[union-attr]
    assert first.path == pins.all()[str(cks[2])].path
    pins.sweep(active={str(cks[2])})
    assert list(pins.all()) == [str(cks[2])]
    pins.sweep(active=set())
    assert pins.all() == {} and not (tmp_path / "ck" / PIN_FOLDER).exists()
    state.close()
