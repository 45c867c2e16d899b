"""Beside a trainer that keeps its last 2 checkpoints: how many of them the watcher evaluates,
with pins and without.

The real daemon loop and a local source over a real folder; a simulated trainer (a thread) that
saves a checkpoint every T seconds and deletes all but its newest 2; a simulated executor whose
jobs take 2x or 4x T, and fail at once when their checkpoint folder is gone when they start (as
a worker that cannot load it). One device. Reported: the fraction of saved checkpoints that got
an `ok` line, with `policy.pin` on and off; the peak bytes pins held (against one checkpoint's
size); the lag from a checkpoint's save to its result; and with `policy.backlog` thin, which
steps were evaluated and which skipped.

Usage: python bench/keepup.py [--period 0.5] [--saves 12]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from common import fake_checkpoint

from ckpt_watcher.config import parse_config
from ckpt_watcher.daemon import Daemon
from ckpt_watcher.devices import FakeInventory
from ckpt_watcher.errors import StateError
from ckpt_watcher.executors.simulated import SimulatedExecutor
from ckpt_watcher.ledger import ledger_path, read_lines
from ckpt_watcher.logs import configure
from ckpt_watcher.pins import Pins
from ckpt_watcher.state import State


def _trainer(watch: Path, saves: int, period: float, saved: dict[int, float]) -> None:
    """Save `r_step{k}` every `period` seconds; keep the newest 2."""
    for k in range(1, saves + 1):
        time.sleep(period)
        tmp = watch.parent / f"r_step{k}.tmp"  # beside the watched folder: scans never see it
        fake_checkpoint(tmp)
        tmp.rename(watch / f"r_step{k}")  # an atomic save
        saved[k] = time.time()
        for old in range(1, k - 1):
            shutil.rmtree(watch / f"r_step{old}", ignore_errors=True)


def _open_state(folder: Path) -> State:
    """The daemon's state, read-only, once the daemon has created it."""
    while True:
        try:
            return State(folder, readonly=True)
        except (StateError, OSError):
            time.sleep(0.01)


def scenario(
    work: Path,
    saves: int,
    period: float,
    slower: float,
    pin: bool,
    backlog: dict[str, Any] | None = None,
) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    watch = work / "ckpts"
    watch.mkdir(parents=True)
    cfg = parse_config(
        {
            "state_dir": str(work / "state"),
            "ledger_dir": str(work / "ledgers"),
            "stable_seconds": 0,
            "sources": [{"kind": "local", "path": str(watch), "poll_seconds": period / 4}],
            "policy": {"pin": pin, "backlog": backlog or {}},
            "eval": {"tasks": [{"task": "t", "num_fewshot": 0}]},
        }
    )
    made: list[Daemon] = []

    def run() -> None:  # the daemon's state lives in the thread that runs it
        made.append(
            Daemon(
                cfg,
                inventory=FakeInventory(cpu=1),
                executor_factory=lambda cb: SimulatedExecutor(
                    cb, lambda t, k: slower * period, loads_checkpoint=True
                ),
            )
        )
        made[0].run()

    saved: dict[int, float] = {}
    peak = 0
    trainer = threading.Thread(target=_trainer, args=(watch, saves, period, saved))
    runner = threading.Thread(target=run)
    runner.start()
    trainer.start()
    state = _open_state(work / "state")
    pins = Pins(state, None)
    while trainer.is_alive() or state.jobs("queued", "running"):
        peak = max(peak, pins.held_bytes())
        time.sleep(period / 10)
    time.sleep(period)  # the last results' pins released
    state.close()
    made[0].request_stop()
    runner.join(timeout=60)
    lines = read_lines(ledger_path(cfg.ledger_dir, "r")).lines
    ok = {ln["step"]: ln for ln in lines if ln["status"] == "ok"}
    lag = [
        datetime.fromisoformat(ln["finished_at"].replace("Z", "+00:00")).timestamp() - saved[s]
        for s, ln in ok.items()
    ]
    one = sum(p.stat().st_size for p in (watch / f"r_step{saves}").iterdir())
    return {
        "steps": sorted(ok),
        "skipped": sorted({ln["step"] for ln in lines if ln["status"] == "skipped"}),
        "evaluated": len(ok),
        "saved": saves,
        "peak_pins": peak / one,
        "lag_median": statistics.median(lag) / period if lag else None,
        "left_pinned": len(list(watch.glob(".ckpt-watcher-pins/*"))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--period", type=float, default=0.5, help="seconds between saves (T)")
    ap.add_argument("--saves", type=int, default=12)
    args = ap.parse_args()
    configure("ERROR")
    with tempfile.TemporaryDirectory() as tmp:
        for slower in (2.0, 4.0):
            for pin in (False, True):
                r = scenario(Path(tmp) / "w", args.saves, args.period, slower, pin)
                lag = f"{r['lag_median']:.1f} T" if r["lag_median"] is not None else "-"
                print(
                    f"eval {slower:g}x T, pins {'on ' if pin else 'off'}: "
                    f"{r['evaluated']}/{r['saved']} evaluated "
                    f"({100 * r['evaluated'] / r['saved']:.0f}%), peak pins "
                    f"{r['peak_pins']:.1f} checkpoints' bytes, median lag {lag}, "
                    f"pins left {r['left_pinned']}"
                )
        thin = {"max_pending": 2, "overflow": "thin"}
        r = scenario(Path(tmp) / "w", args.saves, args.period, 4.0, True, thin)
        lag = f"{r['lag_median']:.1f} T" if r["lag_median"] is not None else "-"
        print(
            f"eval 4x T, pins on, backlog thin (max_pending 2): evaluated steps {r['steps']}, "
            f"skipped {r['skipped']}, peak pins {r['peak_pins']:.1f} checkpoints' bytes, "
            f"median lag {lag}"
        )


if __name__ == "__main__":
    main()
