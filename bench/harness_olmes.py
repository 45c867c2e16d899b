"""OLMES per checkpoint: the watcher (`watcher once` with a `harness: olmes` entry) vs the OLMES
CLI run by hand on the same checkpoint and task, alternated A B A B in one run; primary scores
compared. Needs a real OLMES venv (not on PyPI: built from its source, see docs/benchmarks.md)
and a task file (`.jsonl` of task configs with local data; see docs/benchmarks.md).

Target: wall ratio (watcher / by hand) at most 1.05, metrics equal.
Usage: python bench/harness_olmes.py --venv /tmp/olmes-venv --tasks tasks.jsonl [--rounds 2]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import yaml
from common import WATCHER, summary, trained_checkpoint

from ckpt_watcher.harnesses.olmes import for_transformers4

OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
}


def by_hand(ckpt: Path, venv: Path, tasks: Path, out: Path, limit: int) -> tuple[float, float]:
    view = for_transformers4(
        ckpt, out / "view"
    )  # as a team's script must for a transformers 5 save
    (tok,) = glob.glob(
        str(venv / "lib/python*/site-packages/litellm/litellm_core_utils/tokenizers")
    )
    env = dict(
        os.environ, PATH=f"{venv / 'bin'}:{os.environ['PATH']}", TIKTOKEN_CACHE_DIR=tok, **OFFLINE
    )
    argv = [
        str(venv / "bin" / "olmes"),
        "--model",
        "tiny",
        "--model-type",
        "hf",
        "--model-args",
        json.dumps({"model_path": str(view), "max_length": 64}),
        "--task",
        str(tasks),
        "--limit",
        str(limit),
        "--output-dir",
        str(out / "olmes"),
    ]
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True)
    took = time.perf_counter() - t0
    (line,) = [
        json.loads(x) for x in (out / "olmes" / "metrics-all.jsonl").read_text().splitlines()
    ]
    return took, line["metrics"]["primary_score"]


def through_watcher(
    ckpt: Path, venv: Path, tasks: Path, root: Path, limit: int
) -> tuple[float, float]:
    (root / "ckpts" / "run1").mkdir(parents=True)
    shutil.copytree(ckpt, root / "ckpts" / "run1" / "step_300")
    cfg = root / "w.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(root / "state"),
                "ledger_dir": str(root / "ledgers"),
                "settle_seconds": 0,
                "sources": [{"kind": "local", "path": str(root / "ckpts")}],
                "devices": {"gpus": [], "cpu_slots": 1},
                "eval": {
                    "backend": "hf",
                    "tasks": [
                        {
                            "harness": "olmes",
                            "name": "addition",
                            "venv": str(venv),
                            "task": [str(tasks)],
                            "model_type": "hf",
                            "model_args": {"max_length": 64},
                            "limit": limit,
                            "env": OFFLINE,
                        }
                    ],
                },
            }
        )
    )
    t0 = time.perf_counter()
    subprocess.run([*WATCHER, "once", "-c", str(cfg)], check=True, capture_output=True)
    took = time.perf_counter() - t0
    (line,) = [
        json.loads(x) for x in (root / "ledgers" / "run1" / "ledger.jsonl").read_text().splitlines()
    ]
    return took, line["metrics"]["primary_score"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--venv", type=Path, required=True)
    ap.add_argument("--tasks", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-harness-olmes"))
    args = ap.parse_args()
    ckpt = trained_checkpoint(args.work)
    ready = args.work / "ready"
    if not ready.exists():
        shutil.copytree(ckpt, ready)
        (ready / "model.safetensors.index.json").unlink(missing_ok=True)
    hand, ours = [], []
    for i in range(args.rounds):
        for d in ("hand", "ours"):
            shutil.rmtree(args.work / f"{d}{i}", ignore_errors=True)
            (args.work / f"{d}{i}").mkdir()
        t, s_hand = by_hand(ready, args.venv, args.tasks, args.work / f"hand{i}", args.limit)
        hand.append(t)
        t, s_ours = through_watcher(
            ready, args.venv, args.tasks, args.work / f"ours{i}", args.limit
        )
        ours.append(t)
        print(
            f"round {i}: by hand {hand[-1]:.1f}s  watcher {ours[-1]:.1f}s  primary_score {s_hand} vs {s_ours}: equal {s_hand == s_ours}"
        )
    print(f"by hand: {summary(hand)}")
    print(f"watcher: {summary(ours)}")
    print(
        f"ratio (median watcher / median by hand): {sorted(ours)[len(ours) // 2] / sorted(hand)[len(hand) // 2]:.3f}"
    )


if __name__ == "__main__":
    main()
