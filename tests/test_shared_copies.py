"""A copy the jobs of one checkpoint share (its conversion): made once, by the first job; used by
the others; removed by the last to end; never read half-made, whatever was killed when. Each
`Shared` here is one job's use (its own open files: flock treats them as another process's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_watcher.shared_copies import Shared, sweep_unused


def test_the_first_job_makes_the_copy_the_others_use_it_and_the_last_removes_it(
    tmp_path: Path,
) -> None:
    made: list[Path] = []

    def make(into: Path) -> None:
        made.append(into)
        (into / "model.safetensors").write_bytes(b"w")

    first, second = Shared(tmp_path, "k"), Shared(tmp_path, "k")
    path, by_first = first.get(make)
    again, by_second = second.get(make)
    assert (by_first, by_second) == (True, False) and path == again and len(made) == 1
    first.release()
    assert (path / "model.safetensors").is_file()  # the second job still reads it
    second.release()
    assert not path.exists()


def test_a_copy_half_made_by_a_killed_worker_is_never_read_and_the_next_job_makes_it_again(
    tmp_path: Path,
) -> None:
    # a worker killed -9 while converting: its partial folder and nothing else
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    half = tmp_path / f"k.partial-{dead.stdout.strip()}"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"cut")

    job = Shared(tmp_path, "k")
    path, made = job.get(lambda into: (into / "model.safetensors").write_bytes(b"whole"))
    assert made and (path / "model.safetensors").read_bytes() == b"whole"
    assert not half.exists()
    job.release()

    def fails(into: Path) -> None:
        (into / "model.safetensors").write_bytes(b"cut")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        Shared(tmp_path, "k").get(fails)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == []  # nothing half-made


def test_the_daemons_start_removes_copies_no_job_uses(tmp_path: Path) -> None:
    used, left = Shared(tmp_path, "used"), Shared(tmp_path, "left")
    used.get(lambda into: None)
    left.get(lambda into: None)
    left._use.close()  # type: ignore[union-attr]  # its worker was killed: the kernel drops the lock
    left._use = None
    sweep_unused(tmp_path)
    assert (tmp_path / "used").is_dir() and not (tmp_path / "left").exists()
    used.release()
    assert not (tmp_path / "used").exists()
