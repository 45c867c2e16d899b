"""Checkpoint identity, completeness rules and the naming fix, on real files."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from ckpt_watcher.checkpoints import completeness
from ckpt_watcher.checkpoints.files import LocalFiles
from ckpt_watcher.checkpoints.namefix import apply_fix, plan_fix
from ckpt_watcher.checkpoints.naming import CheckpointId, parse_checkpoint_dir
from ckpt_watcher.checkpoints.safetensors_header import read_local_header
from ckpt_watcher.errors import NamingFixError
from ckpt_watcher.formats import detect

from .conftest import WATCHER, write_fake_checkpoint, write_safetensors


@pytest.mark.parametrize(
    "rel,expected",
    [
        ("x/run1_step600", CheckpointId("run1", 600, "run1_step600")),
        ("x/my.run-2_step0", CheckpointId("my.run-2", 0, "my.run-2_step0")),
        ("grpo/checkpoint-1200", CheckpointId("grpo", 1200, "checkpoint-1200")),
        ("grpo/global_step_30", CheckpointId("grpo", 30, "global_step_30")),
        ("grpo/step_7", CheckpointId("grpo", 7, "step_7")),
        ("x/run1_final", CheckpointId("run1", None, "run1_final", final=True)),
        ("x/latest", None),
        ("x/run1_step", None),
        ("x/run1_step12abc", None),
        ("x/checkpoint-12-old", None),
        ("x/run 1_step5", None),
        ("x/run;rm -rf_step5", None),
        ("bad name$(id)/checkpoint-5", None),
    ],
)
def test_names(tmp_path: Path, rel: str, expected: CheckpointId | None) -> None:
    assert parse_checkpoint_dir(tmp_path / rel) == expected


def test_final_step_comes_from_trainer_state(tmp_path: Path) -> None:
    ck = tmp_path / "run1_final"
    ck.mkdir()
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 900}))
    assert parse_checkpoint_dir(ck) == CheckpointId("run1", 900, "run1_final", final=True)


def check(path: Path, **kw: object) -> completeness.Completeness:
    """The verdict of one look (no settle window unless `settle_seconds` is given)."""
    args: dict = {"now": 1000.0, "stable_seconds": 60.0, "settle_seconds": 0.0} | kw
    view = LocalFiles(path)
    return completeness.check(view, native=detect(view.files), **args)


def test_header_gives_expected_size(tmp_path: Path) -> None:
    size = write_safetensors(tmp_path / "m.safetensors", {"w": 10, "v": 3})
    h = read_local_header(tmp_path / "m.safetensors")
    assert h.expected_size == size == (tmp_path / "m.safetensors").stat().st_size
    assert h.tensors == {"w", "v"}


def test_complete_single_file_checkpoint_is_ready(tmp_path: Path) -> None:
    assert check(write_fake_checkpoint(tmp_path / "r_step1")).state == "ready"


def test_truncated_safetensors_waits_then_becomes_ready(tmp_path: Path) -> None:
    ck = write_fake_checkpoint(tmp_path / "r_step1")
    full = write_safetensors(
        ck / "model.safetensors", {"a.weight": 16, "b.weight": 8}, truncate_by=20
    )
    v = check(ck)
    assert v.state == "incomplete" and f"of {full} bytes" in v.reason
    write_safetensors(ck / "model.safetensors", {"a.weight": 16, "b.weight": 8})
    assert check(ck).ready


@pytest.mark.parametrize("cut", [0, 3, 8, 12])
def test_file_cut_inside_the_header_is_incomplete(tmp_path: Path, cut: int) -> None:
    ck = write_fake_checkpoint(tmp_path / "r_step1")
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[:cut])
    assert check(ck).state == "incomplete"


def test_file_longer_than_its_header_is_invalid(tmp_path: Path) -> None:
    ck = write_fake_checkpoint(tmp_path / "r_step1")
    with open(ck / "model.safetensors", "ab") as f:
        f.write(b"junk")
    v = check(ck)
    assert v.state == "invalid" and "corrupt" in v.reason


def test_missing_config_json_waits(tmp_path: Path) -> None:
    ck = write_fake_checkpoint(tmp_path / "r_step1", config=False)
    assert check(ck).reason == "config.json not written yet"
    (ck / "config.json").write_text('{"model_ty')
    assert "does not parse" in check(ck).reason
    (ck / "config.json").write_text("{}")
    assert check(ck).ready


def test_missing_shard_of_a_series_waits(tmp_path: Path) -> None:
    ck = tmp_path / "r_step1"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    (ck / "tokenizer.json").write_text("{}")
    write_safetensors(ck / "model-00001-of-00002.safetensors", {"a": 4})
    v = check(ck)
    assert v.state == "incomplete" and "1 of 2 shards" in v.reason
    write_safetensors(ck / "model-00002-of-00002.safetensors", {"b": 4})
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    assert check(ck).ready


def test_index_naming_a_missing_file_nobody_can_stand_for_waits(tmp_path: Path) -> None:
    ck = write_fake_checkpoint(tmp_path / "r_step1")
    index = {"weight_map": {"a.weight": "model.safetensors", "z.weight": "model-extra.safetensors"}}
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    v = check(ck)
    assert v.state == "incomplete" and "model-extra.safetensors" in v.reason


def test_naming_bug_checkpoint_is_ready_because_the_fix_can_supply_the_name(tmp_path: Path) -> None:
    assert check(write_fake_checkpoint(tmp_path / "r_step1", naming_bug=True)).ready


def test_marker_wins_and_trainer_folder_waits_for_trainer_state(tmp_path: Path) -> None:
    ck = write_fake_checkpoint(tmp_path / "checkpoint-5")
    (ck / "training_args.bin").write_bytes(b"x")
    assert "trainer_state.json" in check(ck).reason
    (ck / "trainer_state.json").write_text("{}")
    assert check(ck).ready
    dcp = tmp_path / "step_9"  # a torch DCP: its .metadata comes last, and says who reads it
    dcp.mkdir()
    (dcp / "__0_0.distcp").write_bytes(b"x" * 10)
    (dcp / "config.json").write_text("{}")
    command = ["convert", "{input}", "{output}"]
    for convert in (None, command):
        v = check(dcp, convert=convert)
        assert v.state == "incomplete" and "no .metadata yet" in v.reason, v
    (dcp / ".metadata").write_bytes(b"m")  # not a model's state dict: the trainer's converter
    assert "set the source's convert command" in check(dcp).reason
    v = check(dcp, convert=command)
    assert v.ready and ".metadata" in v.reason


def test_other_formats_need_a_quiet_window(tmp_path: Path) -> None:
    ck = tmp_path / "r_step3"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    (ck / "tokenizer.json").write_text("{}")
    (ck / "pytorch_model.bin").write_bytes(b"x" * 100)
    first = check(ck, now=100.0)
    assert first.state == "incomplete" and first.write_mark
    same = check(ck, now=130.0, previous_mark=first.write_mark, unchanged_since=100.0)
    assert same.state == "incomplete" and "30s of 60s" in same.reason
    done = check(ck, now=161.0, previous_mark=first.write_mark, unchanged_since=100.0)
    assert done.ready
    (ck / "pytorch_model.bin").write_bytes(b"x" * 200)
    changed = check(ck, now=170.0, previous_mark=first.write_mark, unchanged_since=100.0)
    assert changed.state == "incomplete" and changed.write_mark != first.write_mark


def test_naming_fix_adds_a_hard_link_and_touches_nothing_else(tmp_path: Path) -> None:
    ck = write_fake_checkpoint(tmp_path / "r_step1", naming_bug=True)
    before = {p.name: (p.stat().st_ino, p.read_bytes()) for p in ck.iterdir()}
    dry = apply_fix(ck, dry_run=True)
    assert [a.describe() for a in dry] == [
        "would link model-00001-of-00001.safetensors -> model.safetensors"
    ]
    assert not (ck / "model-00001-of-00001.safetensors").exists()
    done = apply_fix(ck)
    assert [a.kind for a in done] == ["hardlink"]
    linked = ck / "model-00001-of-00001.safetensors"
    assert linked.stat().st_ino == (ck / "model.safetensors").stat().st_ino
    for name, (ino, data) in before.items():
        assert (ck / name).stat().st_ino == ino and (ck / name).read_bytes() == data
    assert apply_fix(ck) == []  # idempotent


def test_naming_fix_falls_back_to_a_relative_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = write_fake_checkpoint(tmp_path / "r_step1", naming_bug=True)

    def refuse(*_a: object, **_k: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", refuse)  # a filesystem that refuses hard links
    (action,) = apply_fix(ck)
    assert action.kind == "symlink"
    assert os.readlink(ck / "model-00001-of-00001.safetensors") == "model.safetensors"


def test_naming_fix_refuses_when_tensors_do_not_match(tmp_path: Path) -> None:
    ck = write_fake_checkpoint(tmp_path / "r_step1")
    index = {
        "weight_map": {
            "a.weight": "model-00001-of-00001.safetensors",
            "c.weight": "model-00001-of-00001.safetensors",
        }
    }
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(NamingFixError, match="no other safetensors file holds exactly"):
        plan_fix(LocalFiles(ck))
    write_safetensors(ck / "copy.safetensors", {"a.weight": 16, "c.weight": 8})
    write_safetensors(ck / "copy2.safetensors", {"a.weight": 16, "c.weight": 8})
    with pytest.raises(NamingFixError, match="2 files hold"):
        plan_fix(LocalFiles(ck))


def test_index_with_path_escaping_names_is_refused(tmp_path: Path) -> None:
    ck = write_fake_checkpoint(tmp_path / "r_step1")
    (ck / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": "../evil.safetensors"}})
    )
    with pytest.raises(NamingFixError, match="not a plain file name"):
        apply_fix(ck)
    assert not (tmp_path / "evil.safetensors").exists()


def test_fix_names_cli(tmp_path: Path) -> None:
    ck = write_fake_checkpoint(tmp_path / "r_step1", naming_bug=True)
    r = subprocess.run(
        [*WATCHER, "fix-names", str(ck), "--dry-run"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "would link" in r.stdout
    assert not (ck / "model-00001-of-00001.safetensors").exists()
    r = subprocess.run([*WATCHER, "fix-names", str(ck)], capture_output=True, text=True)
    assert r.returncode == 0 and "hard-linked" in r.stdout
    r = subprocess.run([*WATCHER, "fix-names", str(ck)], capture_output=True, text=True)
    assert r.returncode == 0 and "nothing to fix" in r.stdout
    bad = write_fake_checkpoint(tmp_path / "r_step2")
    (bad / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"zz": "other.safetensors"}})
    )
    r = subprocess.run([*WATCHER, "fix-names", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and "re-save the checkpoint" in r.stderr


@pytest.mark.parametrize(
    "header",
    [
        b"\xff" * 8 + b"{}",
        (5).to_bytes(8, "little") + b"nojs!",
        (2).to_bytes(8, "little") + b"[]",
        (39).to_bytes(8, "little") + b'{"w": {"data_offsets": [9, 3]}}        ',
    ],
    ids=["absurd-length", "not-json", "not-object", "bad-offsets"],
)
def test_corrupt_headers_are_invalid_not_waited_for(tmp_path: Path, header: bytes) -> None:
    ck = write_fake_checkpoint(tmp_path / "r_step1")
    (ck / "model.safetensors").write_bytes(header)
    v = check(ck)
    assert v.state == "invalid" and "corrupt safetensors header" in v.reason


def test_a_steps_model_is_known_once_its_config_and_tokenizer_are_whole(tmp_path: Path) -> None:
    """checkpoints/model_meta.py, what an engine started ahead of the weights reads: the config
    and a tokenizer, each whole (a half-written JSON is not yet), at the step's top or in verl's
    `actor/huggingface/`; weights or not."""
    from ckpt_watcher.checkpoints import model_meta

    step = tmp_path / "global_step_10"
    step.mkdir()
    assert model_meta.find(step) is None
    (step / "config.json").write_text('{"model_type": "llama", "hidden_size": 1')  # being written
    (step / "tokenizer_config.json").write_text("{}")
    assert model_meta.find(step) is None
    (step / "config.json").write_text('{"model_type": "llama"}')
    found = model_meta.find(step)
    assert found is not None and [p.name for p in found] == ["config.json", "tokenizer_config.json"]
    (step / "tokenizer_config.json").unlink()
    assert model_meta.find(step) is None  # no tokenizer: vLLM could not start
    assert model_meta.find(step, tokenizer_required=False) == [step / "config.json"]
    (step / "config.json").unlink()
    hf = step / "actor" / "huggingface"  # verl writes it before its ranks' files
    hf.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        (hf / name).write_text("{}")
    assert model_meta.find(step) == [
        hf / n for n in ("config.json", "generation_config.json", "tokenizer.json")
    ]
