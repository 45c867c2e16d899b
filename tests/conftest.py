"""Shared fixtures: offline Hugging Face, tiny self-built checkpoints, config helpers."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
WATCHER = [sys.executable, "-m", "ckpt_watcher"]


def write_safetensors(path: Path, tensors: dict[str, int], truncate_by: int = 0) -> int:
    """A real safetensors file with float32 tensors of the given element counts; returns its
    full size. `truncate_by` bytes are cut off the end (a half-written file)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, n in tensors.items():
        header[name] = {"dtype": "F32", "shape": [n], "data_offsets": [offset, offset + 4 * n]}
        offset += 4 * n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    data = struct.pack("<Q", len(blob)) + blob + b"\0" * offset
    path.write_bytes(data[: len(data) - truncate_by])
    return len(data)


def write_fake_checkpoint(folder: Path, *, naming_bug: bool = False, config: bool = True) -> Path:
    """A checkpoint-shaped folder with small synthetic weights (not loadable by a model)."""
    folder.mkdir(parents=True, exist_ok=True)
    if config:
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tensors = {"a.weight": 16, "b.weight": 8}
    write_safetensors(folder / "model.safetensors", tensors)
    if naming_bug:
        index = {"weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tiny Llama trained for 300 steps (about 12 s), saved with the naming bug."""
    from ckpt_watcher.demo.train import train

    out = tmp_path_factory.mktemp("trained")
    (path,) = train(out, run="fixture", steps=300, save_every=300)
    return path


@pytest.fixture
def copy_checkpoint(tmp_path: Path, trained_checkpoint: Path):
    """Copy the trained checkpoint into a new place under a new name (the copy is yours)."""

    def _copy(dest: Path) -> Path:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(trained_checkpoint, dest)
        return dest

    return _copy


@pytest.fixture(scope="session")
def addition_tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's addition task, plus `addition_long` that asks max_gen_toks: 32768."""
    from ckpt_watcher.demo.tiny import write_task

    folder = write_task(tmp_path_factory.mktemp("tasks"))
    text = (folder / "addition.yaml").read_text()
    long = text.replace("task: addition", "task: addition_long").replace(
        "max_gen_toks: 4", "max_gen_toks: 32768"
    )
    (folder / "addition_long.yaml").write_text(long)
    return folder


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def base_config(tmp: Path, watch: Path, tasks_dir: Path, **eval_over: Any) -> dict[str, Any]:
    """A config for the hf backend on one CPU slot over `watch`."""
    ev: dict[str, Any] = {
        "backend": "hf",
        "model_args": {"dtype": "float32", "max_model_len": 64},
        "batch_size": 32,
        "include_path": str(tasks_dir),
        "retry_backoff_seconds": 0.5,
        "tasks": [{"task": "addition", "num_fewshot": 0}],
    }
    ev.update(eval_over)
    return {
        "state_dir": str(tmp / "state"),
        "ledger_dir": str(tmp / "ledgers"),
        "stable_seconds": 1,
        "shutdown_grace_seconds": 30,
        "sources": [{"kind": "local", "path": str(watch), "poll_seconds": 1}],
        "devices": {"gpus": [], "cpu_slots": 1},
        "eval": ev,
    }


def idle_config(tmp: Path, **over: Any) -> Path:
    """A config over an empty folder `tmp/ckpts` (created), one CPU slot: a daemon with no work."""
    (tmp / "ckpts").mkdir(exist_ok=True)
    data: dict[str, Any] = {
        "state_dir": str(tmp / "s"),
        "ledger_dir": str(tmp / "l"),
        "sources": [{"kind": "local", "path": str(tmp / "ckpts")}],
        "devices": {"gpus": [], "cpu_slots": 1},
        "eval": {"tasks": [{"task": "addition"}]},
    }
    data.update(over)
    return write_config(tmp / "w.yaml", data)


def read_ledger(ledger_dir: Path, run: str) -> list[dict[str, Any]]:
    path = ledger_dir / run / "ledger.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
