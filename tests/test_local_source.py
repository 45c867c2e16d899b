"""The local source: what a scan finds, what it refuses to follow, and inotify wake-ups."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ckpt_watcher.sources.base import diff
from ckpt_watcher.sources.local import LocalSource

from .conftest import write_fake_checkpoint


def test_scan_finds_checkpoints_at_depth_and_reports_the_unrecognised(tmp_path: Path) -> None:
    write_fake_checkpoint(tmp_path / "run1_step100")
    write_fake_checkpoint(tmp_path / "proj" / "grpo" / "checkpoint-20")
    write_fake_checkpoint(tmp_path / "proj" / "latest")  # model files, no known name
    (tmp_path / "proj" / "logs").mkdir()
    found = {Path(f.location).name: f for f in LocalSource(tmp_path).scan()}
    assert found["run1_step100"].ident is not None and found["run1_step100"].ident.step == 100
    assert found["checkpoint-20"].ident is not None and found["checkpoint-20"].ident.run == "grpo"
    assert found["latest"].ident is None and "follows no pattern" in found["latest"].note
    assert "logs" not in found
    # run paths: the run's path under the root, so two jobs reusing a run name stay apart
    assert found["run1_step100"].ident.run_path == "run1"
    assert found["checkpoint-20"].ident.run_path == "proj/grpo"


def test_run_paths_keep_reused_run_names_apart_and_odd_folder_names_safe(tmp_path: Path) -> None:
    write_fake_checkpoint(tmp_path / "jobA" / "mix_step100")
    write_fake_checkpoint(tmp_path / "jobB" / "mix_step100")
    write_fake_checkpoint(tmp_path / "my job" / ".hidden" / "out_final")
    write_fake_checkpoint(tmp_path / "qwen3" / "checkpoint-7")
    paths = sorted(f.ident.run_path for f in LocalSource(tmp_path).scan() if f.ident)
    assert paths == ["jobA/mix", "jobB/mix", "my_job/_.hidden/out", "qwen3"]
    root_is_run = tmp_path / "qwen3"  # a source rooted at the run's own folder
    assert [f.ident.run_path for f in LocalSource(root_is_run).scan() if f.ident] == ["qwen3"]


def test_symlinks_are_never_followed(tmp_path: Path) -> None:
    outside = write_fake_checkpoint(tmp_path / "outside" / "secret_step1")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / "run_step5")
    os.symlink(tmp_path / "outside", root / "escape")
    found = LocalSource(root).scan()
    assert [(Path(f.location).name, f.ident, f.note) for f in found] == [
        ("run_step5", None, "symlink: not followed")
    ]


def test_hostile_names_are_reported_not_parsed(tmp_path: Path) -> None:
    names = ["run; rm -rf ~_step1", "$(touch pwned)_step2", "new\nline_step3", "quote'\"_step4"]
    for n in names:
        write_fake_checkpoint(tmp_path / n)
    raw = os.fsencode(tmp_path) + b"/bad\xff_step5"
    os.mkdir(raw)
    (Path(os.fsdecode(raw)) / "config.json").write_text("{}")
    found = LocalSource(tmp_path).scan()
    assert len(found) == 5
    assert all(f.ident is None for f in found)
    for f in found:
        f.location.encode("utf-8")  # always storable and printable
    assert not (tmp_path / "pwned").exists()


def test_diff_of_snapshots(tmp_path: Path) -> None:
    src = LocalSource(tmp_path)
    write_fake_checkpoint(tmp_path / "r_step1")
    a = {f.location: f for f in src.scan()}
    write_fake_checkpoint(tmp_path / "r_step2")
    import shutil

    shutil.rmtree(tmp_path / "r_step1")
    b = {f.location: f for f in src.scan()}
    added, removed = diff(a, b)
    assert [Path(f.location).name for f in added] == ["r_step2"]
    assert [Path(f.location).name for f in removed] == ["r_step1"]


def test_inotify_wakes_on_a_closed_write(tmp_path: Path) -> None:
    src = LocalSource(tmp_path)
    woke = threading.Event()
    assert src.watch(woke.set)
    try:
        (tmp_path / "run_step1").mkdir()
        assert woke.wait(5)
    finally:
        src.close()


def test_missing_root_is_an_error_the_daemon_reports(tmp_path: Path) -> None:
    import pytest

    with pytest.raises(FileNotFoundError, match="does not exist"):
        LocalSource(tmp_path / "nope").scan()


def test_verl_steps_are_found_by_their_hugging_face_folder_and_never_through_a_link(
    tmp_path: Path,
) -> None:
    """verl saves step N as `global_step_N/`: its RL trainers with the model's Hugging Face copy
    in `actor/huggingface/` (with `hf_model` saved), else the FSDP shards in `actor/`; its SFT
    trainer in `huggingface/`. That folder is the checkpoint (what an eval loads, converted
    where it is shards); run and step come from `global_step_N` and the folder above it."""
    ppo = tmp_path / "verl_grpo" / "qwen3-grpo"
    write_fake_checkpoint(ppo / "global_step_20" / "actor" / "huggingface")
    (ppo / "global_step_20" / "actor" / "model_world_size_2_rank_0.pt").write_bytes(b"shard")
    (ppo / "global_step_20" / "data.pt").write_bytes(b"loader")
    (ppo / "global_step_40" / "actor").mkdir(parents=True)  # its save has just begun
    (ppo / "global_step_0").mkdir()  # keep-last-k deleted its actor/, leaving its data.pt
    (ppo / "global_step_0" / "data.pt").write_bytes(b"loader")
    (ppo / "global_step_0" / "critic" / "huggingface").mkdir(parents=True)
    (ppo / "global_step_0" / "critic" / "huggingface" / "config.json").write_text("{}")
    write_fake_checkpoint(tmp_path / "sft" / "qwen3-sft" / "global_step_5" / "huggingface")
    write_fake_checkpoint(tmp_path / "plain" / "global_step_7")  # a model in the folder itself
    outside = write_fake_checkpoint(tmp_path.parent / f"{tmp_path.name}-outside" / "hf")
    (ppo / "global_step_60").mkdir()
    os.symlink(outside.parent, ppo / "global_step_60" / "actor")  # never followed
    found = {f.location.removeprefix(str(tmp_path) + "/"): f for f in LocalSource(tmp_path).scan()}
    step20 = found["verl_grpo/qwen3-grpo/global_step_20/actor/huggingface"]
    assert step20.ident is not None and step20.path == ppo / "global_step_20/actor/huggingface"
    assert (step20.ident.run, step20.ident.step, step20.ident.label) == (
        "qwen3-grpo",
        20,
        "global_step_20",
    )
    assert step20.ident.run_path == "verl_grpo/qwen3-grpo"
    step40 = found["verl_grpo/qwen3-grpo/global_step_40/actor"]  # its shards, once written
    assert step40.ident is not None and step40.ident.step == 40
    sft = found["sft/qwen3-sft/global_step_5/huggingface"]
    assert sft.ident is not None and (sft.ident.run, sft.ident.step) == ("qwen3-sft", 5)
    plain = found["plain/global_step_7"]
    assert plain.ident is not None and (plain.ident.run, plain.ident.step) == ("plain", 7)
    linked = found["verl_grpo/qwen3-grpo/global_step_60/actor"]
    assert (linked.ident, linked.path, linked.note) == (None, None, "symlink: not followed")
    # nothing of global_step_0 (its model is gone; its critic is no checkpoint of the run)
    assert len(found) == 5, sorted(found)


def test_openrlhf_hugging_face_copies_are_its_checkpoints_and_its_deepspeed_states_without_one(
    tmp_path: Path,
) -> None:
    """OpenRLHF with `--ckpt.save_hf` saves step N's model as `<ckpt.path>/global_step{N}_hf`,
    beside its DeepSpeed states under `_actor/global_step{N}`: the copy is the step's checkpoint.
    A step with its states alone is that (converted with the source's base model)."""
    ckpt = tmp_path / "checkpoints_ppo"
    write_fake_checkpoint(ckpt / "global_step30_hf")
    for step in (30, 40):
        states = ckpt / "_actor" / f"global_step{step}"
        states.mkdir(parents=True)
        (states / "mp_rank_00_model_states.pt").write_bytes(b"ds")
    # a DeepSpeed tag folder that does hold a model: of the run above it, not a run `global`
    write_fake_checkpoint(tmp_path / "ds" / "global_step9")
    found = {f.location.removeprefix(f"{tmp_path}/"): f.ident for f in LocalSource(tmp_path).scan()}
    assert set(found) == {
        "checkpoints_ppo/global_step30_hf",
        "checkpoints_ppo/_actor/global_step40",
        "ds/global_step9",
    }
    states40 = found["checkpoints_ppo/_actor/global_step40"]
    assert states40 is not None and (states40.run, states40.step) == ("checkpoints_ppo", 40)
    hf, ds = found["checkpoints_ppo/global_step30_hf"], found["ds/global_step9"]
    assert hf is not None and (hf.run, hf.step, hf.label) == (
        "checkpoints_ppo",
        30,
        "global_step30_hf",
    )
    assert ds is not None and (ds.run, ds.step, ds.run_path) == ("ds", 9, "ds")


def test_areal_and_skyrl_hugging_face_folders_are_steps_of_their_runs(tmp_path: Path) -> None:
    """AReaL names a step's Hugging Face folder `epoch{E}epochstep{S}globalstep{G}` (step G);
    SkyRL's export puts it in `global_step_N/policy/`, where its FSDP shards would be."""
    write_fake_checkpoint(tmp_path / "areal" / "exp1" / "epoch1epochstep20globalstep120")
    write_fake_checkpoint(tmp_path / "skyrl" / "exp2" / "global_step_30" / "policy")
    found = {f.location.removeprefix(f"{tmp_path}/"): f.ident for f in LocalSource(tmp_path).scan()}
    areal = found["areal/exp1/epoch1epochstep20globalstep120"]
    assert areal is not None and (areal.run, areal.step) == ("exp1", 120), areal
    skyrl = found["skyrl/exp2/global_step_30/policy"]
    assert skyrl is not None and (skyrl.run, skyrl.step) == ("exp2", 30), skyrl
    assert len(found) == 2, found
