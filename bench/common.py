"""Shared set-up for the benchmarks: a trained tiny checkpoint, task files, configs, timing."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BIN = Path(sys.executable).parent
WATCHER = [sys.executable, "-m", "ckpt_watcher"]

# Qwen3-0.6B's shape (its config's sizes): the real model size the benches build, randomly
# initialised (no model hub here)
QWEN3_0_6B: dict = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def fake_checkpoint(folder: Path) -> None:
    """A complete checkpoint-shaped folder with one tiny tensor and a tokenizer config (not
    loadable by a model)."""
    folder.mkdir(parents=True)
    # its path in its config: two fakes are two contents (the watcher reuses results across copies)
    (folder / "config.json").write_text(json.dumps({"_name_or_path": str(folder)}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    (folder / "tokenizer_config.json").write_text(
        "{}"
    )  # an eval loads one: the watcher waits for it


def distinct_copy(src: Path, dest: Path) -> Path:
    """Copy a checkpoint as if trained further: its config names the copy, so its content
    fingerprint differs (an exact copy would get its results reused, not evaluated)."""
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "_name_or_path": str(dest)}))
    return dest


def trained_checkpoint(work: Path, steps: int = 300) -> Path:
    """Train the demo model once per work folder (cached) and return its checkpoint, in the
    shape vLLM's CPU attention serves (2 heads of size 64)."""
    from ckpt_watcher.demo.tiny import VLLM_HEADS
    from ckpt_watcher.demo.train import train

    path = work / "trained" / f"bench_step{steps}"
    if not (path / "model.safetensors").exists():
        shutil.rmtree(work / "trained", ignore_errors=True)
        (path,) = train(
            work / "trained", run="bench", steps=steps, save_every=steps, heads=VLLM_HEADS
        )
    return path


def task_folder(work: Path, copies: int = 1) -> tuple[Path, list[str]]:
    """The addition task plus `copies - 1` identical copies under other names."""
    from ckpt_watcher.demo.tiny import write_task

    folder = write_task(work / "tasks")
    text = (folder / "addition.yaml").read_text()
    names = ["addition"]
    for i in range(1, copies):
        name = f"addition_copy{i}"
        (folder / f"{name}.yaml").write_text(text.replace("task: addition", f"task: {name}"))
        names.append(name)
    return folder, names


def sampled_task(samples: int) -> dict[str, Any]:
    """The addition task, `samples` responses a document at temperature 0.8, pass@1 and
    pass@`samples`."""
    return {
        "task": "addition",
        "num_fewshot": 0,
        "samples": samples,
        "gen_kwargs": {"temperature": 0.8},
        "pass_at": [1, samples],
    }


def config(
    path: Path, root: Path, watch: Path, tasks_dir: Path, tasks: list[str], **over: Any
) -> Path:
    ev = {
        "backend": "hf",
        "model_args": {"dtype": "float32", "max_model_len": 64},
        "include_path": str(tasks_dir),
        "tasks": [{"task": t, "num_fewshot": 0} for t in tasks],
    }
    ev.update(over.pop("eval", {}))
    data = {
        "state_dir": str(root / "state"),
        "ledger_dir": str(root / "ledgers"),
        "sources": [{"kind": "local", "path": str(watch), "poll_seconds": 5}],
        "devices": {"gpus": [], "cpu_slots": 1},
        "eval": ev,
        **over,
    }
    path.write_text(yaml.safe_dump(data))
    return path


def timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return dt


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f}  min {min(values):.3f}  max {max(values):.3f}  (n={len(values)})"
