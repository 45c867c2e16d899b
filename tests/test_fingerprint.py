"""Content fingerprints: from bytes only, equal for a folder and its S3 copy, cheap by default."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckpt_watcher.checkpoints.files import LocalFiles
from ckpt_watcher.checkpoints.fingerprint import BLOCK, SAMPLED_BLOCKS, fingerprint
from ckpt_watcher.checkpoints.namefix import apply_fix
from ckpt_watcher.s3client import Retry, S3Files, make_client

from .conftest import upload_dir, write_safetensors

NO_WAIT = Retry(attempts=3, initial=0.0, maximum=0.0)


def checkpoint(folder: Path, elements: int = 3_000_000, naming_bug: bool = False) -> Path:
    """A 12 MB safetensors checkpoint (more than the sampled blocks cover)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenizer.json").write_text("{}")
    write_safetensors(folder / "model.safetensors", {"w": elements, "b": 8})
    if naming_bug:
        index = {
            "weight_map": {
                "w": "model-00001-of-00001.safetensors",
                "b": "model-00001-of-00001.safetensors",
            }
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def poke(path: Path, offset: int, data: bytes = b"\x7f") -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


class CountingFiles(LocalFiles):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.bytes_read = 0

    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        data = super().read(name, start, length)
        self.bytes_read += len(data)
        return data


def test_a_folder_and_its_s3_copy_get_the_same_fingerprint_in_both_modes(
    tmp_path: Path, s3_endpoint: str, bucket: str
) -> None:
    folder = checkpoint(tmp_path / "run_step100", naming_bug=True)
    client = make_client(s3_endpoint)
    upload_dir(client, folder, bucket, "ckpts/run_step100/")
    apply_fix(folder)  # the local naming fix adds a link; S3 is fixed only in staged copies
    assert (folder / "model-00001-of-00001.safetensors").exists()
    s3 = S3Files(client, NO_WAIT, bucket, "ckpts/run_step100/")
    for mode in ("sampled", "full"):
        local_fp = fingerprint(LocalFiles(folder), mode)
        assert local_fp == fingerprint(s3, mode) and local_fp.startswith(f"{mode}:")
    assert fingerprint(LocalFiles(folder), "sampled") != fingerprint(LocalFiles(folder), "full")


def test_sampled_reads_about_a_mebibyte_per_weight_file_and_full_reads_everything(
    tmp_path: Path,
) -> None:
    folder = checkpoint(tmp_path / "c")
    size = (folder / "model.safetensors").stat().st_size
    sampled = CountingFiles(folder)
    fingerprint(sampled, "sampled")
    assert sampled.bytes_read < SAMPLED_BLOCKS * BLOCK + 4096 < size / 10
    full = CountingFiles(folder)
    fingerprint(full, "full")
    assert full.bytes_read >= size


@pytest.mark.parametrize(
    "change, sampled_sees_it",
    [
        ("header", True),  # another tensor layout
        ("first_block", True),
        ("last_byte", True),
        ("config", True),
        ("between_blocks", False),  # what `full` is for
    ],
)
def test_what_each_mode_notices(tmp_path: Path, change: str, sampled_sees_it: bool) -> None:
    folder = checkpoint(tmp_path / "c")
    weights = folder / "model.safetensors"
    before = {m: fingerprint(LocalFiles(folder), m) for m in ("sampled", "full")}
    size = weights.stat().st_size
    if change == "header":
        poke(weights, 20, b"x")
    elif change == "first_block":
        poke(weights, 1000)
    elif change == "last_byte":
        poke(weights, size - 1)
    elif change == "config":
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    else:
        poke(weights, BLOCK + (size // (SAMPLED_BLOCKS - 1)) // 2)
    after = {m: fingerprint(LocalFiles(folder), m) for m in ("sampled", "full")}
    assert (after["sampled"] != before["sampled"]) is sampled_sees_it
    assert after["full"] != before["full"]


def test_what_an_eval_does_not_read_does_not_count(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "c")
    before = fingerprint(LocalFiles(folder))
    (folder / ".checkpoint_complete").write_text("")
    (folder / "optimizer.pt").write_bytes(os.urandom(1000))
    (folder / "trainer_state.json").write_text('{"global_step": 100}')
    assert fingerprint(LocalFiles(folder)) == before
    with pytest.raises(FileNotFoundError):
        fingerprint(LocalFiles(tmp_path / "empty"))
