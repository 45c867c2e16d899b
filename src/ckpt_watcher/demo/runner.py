"""`watcher demo`: train the tiny model in a subprocess while the real daemon evaluates each
checkpoint it writes (hf backend, one CPU slot), then return the results table."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ckpt_watcher import ledger as ledger_mod
from ckpt_watcher.config import WatcherConfig, apply_overrides, parse_config
from ckpt_watcher.daemon import Daemon
from ckpt_watcher.durable import write_atomic
from ckpt_watcher.report.table import metric_table, render
from ckpt_watcher.state import State

RUN = "demo"
TERMINAL = ("done", "failed", "invalid", "skipped", "missed")


CONFIG_NAME = "watcher.yaml"


def demo_config(workdir: Path, overrides: list[str] | None = None) -> WatcherConfig:
    """The demo's config: a local folder, one CPU slot, the bundled addition task. Written to
    `<workdir>/watcher.yaml` (with any --set overrides applied), for the user to edit and reuse."""
    from ckpt_watcher.demo.tiny import write_task

    tasks = write_task(workdir / "tasks")
    raw: dict[str, Any] = {
        "state_dir": str(workdir / "state"),
        "ledger_dir": str(workdir / "ledgers"),
        "stable_seconds": 5,
        "shutdown_grace_seconds": 30,
        "sources": [{"kind": "local", "path": str(workdir / "checkpoints"), "poll_seconds": 5}],
        "devices": {"gpus": [], "cpu_slots": 1},
        "eval": {
            "backend": "hf",
            "model_args": {"dtype": "float32", "max_model_len": 64},
            "batch_size": 32,
            "include_path": str(tasks),
            "retry_backoff_seconds": 2,
            "timeout_seconds": 600,
            "tasks": [{"task": "addition", "num_fewshot": 0}],
        },
    }
    raw = apply_overrides(raw, overrides or [])
    cfg = parse_config(raw)
    write_atomic(workdir / CONFIG_NAME, yaml.safe_dump(raw, sort_keys=False))
    return cfg


def _all_evaluated(cfg: WatcherConfig, written: int) -> bool:
    try:
        state = State(cfg.state_dir, readonly=True)
    except Exception:  # not created yet
        return False
    try:
        rows = state.checkpoints()
        mine = [r for r in rows if r.run == RUN]
        busy = state.jobs("queued", "running")
    finally:
        state.close()
    return len(mine) >= written and all(r.state in TERMINAL for r in mine) and not busy


def watcher_command() -> str:
    """How to call this watcher from the user's shell, so the commands it prints run as printed:
    `watcher` when that is on PATH and is this install, else the full path of this install's."""
    here = Path(sys.executable).parent / "watcher"
    found = shutil.which("watcher")
    if found and (not here.exists() or Path(found).resolve() == here.resolve()):
        return "watcher"
    if here.exists():
        return shlex.quote(str(here.absolute()))
    return f"{shlex.quote(sys.executable)} -m ckpt_watcher"


def run_demo(
    workdir: Path,
    echo: Callable[[str], None],
    steps: int = 600,
    save_every: int = 150,
    overrides: list[str] | None = None,
) -> int:
    """Train, watch, evaluate; echo progress; return 0 if every checkpoint got its result."""
    workdir = workdir.resolve()
    (workdir / "checkpoints").mkdir(parents=True, exist_ok=True)
    if ledger_mod.ledger_path(workdir / "ledgers", RUN).exists():
        echo(
            f"note: {workdir} holds an earlier demo: the model trains again; a checkpoint that "
            "comes out the same keeps its result, one that differs is evaluated again"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cfg = demo_config(workdir, overrides)
    echo(f"demo folder: {workdir}")
    echo(
        f"training a tiny Llama on 2-digit addition: {steps} steps, a checkpoint every {save_every}"
    )
    t0 = time.monotonic()
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ckpt_watcher.demo.train",
            "--out",
            str(workdir / "checkpoints"),
            "--run",
            RUN,
            "--steps",
            str(steps),
            "--save-every",
            str(save_every),
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    daemon = Daemon(cfg)
    daemon.install_signal_handlers()
    written = 0

    def follow_trainer() -> None:
        nonlocal written
        assert trainer.stdout is not None
        for line in trainer.stdout:
            if "saved" in line:
                written += 1
            echo(f"  [trainer {time.monotonic() - t0:5.1f}s] {line.strip()}")
        trainer.wait()
        while not daemon.stop_requests:
            if trainer.returncode != 0 or _all_evaluated(cfg, written):
                daemon.request_stop()
                return
            time.sleep(0.5)

    watcher = threading.Thread(target=follow_trainer, daemon=True)
    watcher.start()
    echo("watcher: evaluating each checkpoint as soon as it is completely written")
    try:
        daemon.run()
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    if trainer.returncode != 0:
        echo(f"the trainer failed (exit code {trainer.returncode})")
        return 1
    lines = ledger_mod.read_lines(ledger_mod.ledger_path(cfg.ledger_dir, RUN)).lines
    echo(
        f"\nresults ({time.monotonic() - t0:.0f}s in all), from {ledger_mod.ledger_path(cfg.ledger_dir, RUN)}:"
    )
    echo(render(metric_table(lines), "table"))
    config = workdir / CONFIG_NAME
    echo(f"\nthe demo's config is {config} (edit it, or point `sources` at your own checkpoints)")
    echo("next, try:")
    w = watcher_command()
    echo(f"  {w} status -c {config}")
    echo(f"  {w} results -c {config} {RUN} --format md")
    echo(f"  {w} plot -c {config} {RUN} -o {workdir / 'demo.png'}")
    echo(f"  {w} report -c {config} {RUN} -o {workdir / 'report.html'}   # open it in a browser")
    steps_done = sorted(ln["step"] for ln in lines if ln.get("status") == "ok")
    if len(steps_done) >= 2:
        echo(
            f"  {w} samples -c {config} {RUN} --step {steps_done[-1]} --task addition "
            f"--vs {steps_done[0]}   # the problems it learned"
        )
    echo(f"  {w} run -c {config}   # keep watching the folder (Ctrl-C stops it)")
    failed = [ln for ln in lines if ln.get("status") == "failed"]
    if failed:
        echo(f"{len(failed)} eval(s) failed; see `watcher status` and the ledger's error field")
        return 1
    return 0
