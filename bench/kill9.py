"""Kill -9 run: `watcher run` is SIGKILLed at random moments (seeded) while it evaluates several
checkpoints x 2 tasks, and restarted each time; then it runs to the end. Reports kills survived,
jobs lost and jobs duplicated (targets: all survived, 0, 0). The test suite runs this too.

Usage: python bench/kill9.py [--kills 20] [--seed 20261121] [--work /tmp/bench-kill9]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from common import WATCHER, config, distinct_copy, task_folder, trained_checkpoint

from ckpt_watcher.errors import WatcherError
from ckpt_watcher.state import State

CHECKPOINTS = (100, 200, 300)


def _ledger(root: Path) -> list[dict[str, Any]]:
    path = root / "ledgers" / "k9" / "ledger.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a torn line: the ledger reader skips it too
    return out


def _serving(root: Path, pid: int) -> bool:
    """True once the daemon `pid` has taken over the state (its signal handlers are in place)."""
    try:
        state = State(root / "state", readonly=True)
    except WatcherError:
        return False
    try:
        return bool(state.get_meta("daemon_pid") == pid)
    finally:
        state.close()


def _ok_count(root: Path) -> int:
    return sum(1 for x in _ledger(root) if x["status"] == "ok")


def _sleep_then_kill_moment(
    rng: random.Random, root: Path, after_append: float, expected: int
) -> bool:
    """Wait for the moment of the next kill; True if it follows a fresh ledger append.

    Most kills come 0.2-4 s after a start (start-up, recovery, scans, planning, model loading).
    A share `after_append` come 0-0.3 s after the ledger gains an ok line: while the daemon is
    between appending that line and committing the job, or appending the job's next line.
    """
    before = _ok_count(root)
    if rng.random() < after_append and before < expected:
        deadline = time.monotonic() + 90
        while _ok_count(root) == before and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.3))
        return _ok_count(root) > before
    time.sleep(rng.uniform(0.2, 4))
    return False


def _workers_of(root: Path) -> list[int]:
    """Worker processes (one-shot or warm) still alive for this state folder."""
    r = subprocess.run(
        ["pgrep", "-f", f"ckpt_watcher.worker .*{root / 'state'}"], capture_output=True, text=True
    )
    return [int(x) for x in r.stdout.split()]


def fault_run(
    work: Path, ckpt: Path, kills: int, seed: int, after_append: float = 0.25, warm: bool = False
) -> dict[str, Any]:
    """Run the kill loop; return the figures (and the ledger lines, for assertions). `warm`:
    jobs go to warm workers (one per device, kept across jobs). A worker outlives its daemon's
    kill -9 (its own session) and the next daemon adopts it; an idle warm worker exits by
    itself, its stdin closed."""
    rng = random.Random(seed)
    root = work / f"seed{seed}{'-warm' if warm else ''}"
    shutil.rmtree(root, ignore_errors=True)
    watch = root / "ckpts"
    for step in CHECKPOINTS:
        distinct_copy(ckpt, watch / f"k9_step{step}")
    tasks_dir, _ = task_folder(work)
    cfg = config(
        root / "w.yaml",
        root,
        watch,
        tasks_dir,
        ["addition"],
        eval={
            "tasks": [
                {"task": "addition", "num_fewshot": 0},
                {"task": "addition", "num_fewshot": 1},
            ],
            "retry_backoff_seconds": 0.5,
            "warm_engine": warm,  # and the default max_attempts: kills of the daemon fail nothing
        },
    )
    log = open(root / "daemon.log", "ab")
    started = time.monotonic()
    survived = 0
    after_appends = 0
    try:
        for _ in range(kills):
            proc = subprocess.Popen(
                [*WATCHER, "--log-json", "run", "-c", str(cfg)], stdout=log, stderr=log
            )
            after_appends += _sleep_then_kill_moment(rng, root, after_append, len(CHECKPOINTS) * 2)
            alive_before = proc.poll() is None
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            survived += int(
                alive_before
            )  # it was still serving when killed: not a crash of its own
        ok_during_kills = _ok_count(root)
        proc = subprocess.Popen(
            [*WATCHER, "--log-json", "run", "-c", str(cfg)], stdout=log, stderr=log
        )
        expected = len(CHECKPOINTS) * 2
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not _serving(root, proc.pid):
            time.sleep(0.1)  # a SIGTERM before the daemon's handlers exist would just kill it
        while time.monotonic() < deadline and _ok_count(root) < expected:
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        clean_exit = proc.wait(timeout=120) == 0
        time.sleep(1)
        workers_left = _workers_of(root)
    finally:
        log.close()
    lines = _ledger(root)
    state = State(root / "state", readonly=True)
    try:
        deaths = max((j.daemon_deaths for j in state.jobs()), default=0)
    finally:
        state.close()
    ok = Counter((x["step"], x["num_fewshot"]) for x in lines if x["status"] == "ok")
    want = {(s, k) for s in CHECKPOINTS for k in (0, 1)}
    return {
        "seed": seed,
        "kills": kills,
        "kills_survived": survived,
        "kills_right_after_a_ledger_append": after_appends,
        "jobs_expected": len(want),
        "jobs_lost": len(want - set(ok)),
        "jobs_duplicated": sum(n - 1 for n in ok.values() if n > 1),
        "ok_lines_before_final_run": ok_during_kills,
        "failed_lines": sum(1 for x in lines if x["status"] != "ok"),
        "most_daemon_deaths_under_one_job": deaths,
        "adoptions": (root / "daemon.log").read_text().count('"event": "recovery.adopted"'),
        "clean_exit": clean_exit,
        "workers_left": workers_left,
        "engines": dict(Counter(str(x.get("engine")) for x in lines if x["status"] == "ok")),
        "seconds": round(time.monotonic() - started, 1),
        "lines": lines,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=20261121)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-kill9"))
    ap.add_argument("--warm", action="store_true", help="warm workers (eval.warm_engine: true)")
    args = ap.parse_args()
    figures = fault_run(
        args.work, trained_checkpoint(args.work), args.kills, args.seed, warm=args.warm
    )
    figures.pop("lines")
    for k, v in figures.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
