"""Writers nobody here wrote: each checkpoint is evaluated once, on exactly the bytes its
fingerprint names, whatever order its writer writes in.

The rules (checkpoints/completeness.py): everything an eval reads is there and whole (shards,
index, config, a tokenizer, an HF Trainer's last file), then unchanged for `settle_seconds`
across two looks; a pin holds only the files the checkpoint was judged with (pins.py). Here:
the rules on real files and a real S3 API with the clock in hand, then the real transformers
Trainer and two hand-written writers beside `watcher run`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.checkpoints import completeness
from ckpt_watcher.checkpoints.files import LocalFiles, eval_mark
from ckpt_watcher.checkpoints.fingerprint import fingerprint
from ckpt_watcher.devices import cpu_slots
from ckpt_watcher.discovery import Discovery
from ckpt_watcher.errors import CheckpointChanged
from ckpt_watcher.pins import PIN_FOLDER, Pins, pin_path
from ckpt_watcher.s3client import Retry, make_client
from ckpt_watcher.sources.local import LocalSource
from ckpt_watcher.sources.s3 import S3Source
from ckpt_watcher.state import Job, State

from .conftest import (
    base_config,
    derived_checkpoints,
    read_ledger,
    reshard_in_two,
    write_config,
    write_fake_checkpoint,
    write_safetensors,
    write_two_shards,
)
from .helpers import status_json, wait_for, watcher_run

HERE = Path(__file__).parent


class Clock:
    """The daemon's clock, in the test's hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def look(discovery: Discovery, clock: Clock, advance: float = 0.0) -> None:
    """Let `advance` seconds pass, then one tick that starts what is due and applies it."""
    clock.t += advance
    discovery.tick(clock.t, polls=False)
    deadline = time.monotonic() + 30
    while discovery.scanning():
        assert time.monotonic() < deadline, "scan did not finish"
        time.sleep(0.01)
        discovery.tick(clock.t, polls=False)


def first_look(discovery: Discovery, clock: Clock) -> None:
    clock.t += 0.01
    discovery.tick(clock.t, force=True, polls=False)
    look(discovery, clock)


# --- the rules, one look at a time ------------------------------------------------------------
def test_a_checkpoint_is_ready_only_once_its_files_stay_unchanged_for_the_settle_time(
    tmp_path: Path,
) -> None:
    ck = write_fake_checkpoint(tmp_path / "r_step1")

    def at(now: float, **kw: Any) -> completeness.Completeness:  # one look: a fresh listing
        return completeness.check(LocalFiles(ck), now=now, stable_seconds=60, **kw)

    first = at(10.0, settle_seconds=0.5)
    assert first.state == "incomplete" and "settling" in first.reason
    assert first.recheck_in == 0.5
    again = dict(previous_mark=first.write_mark, unchanged_since=10.0)
    early = at(10.3, settle_seconds=0.5, **again)
    assert early.state == "incomplete" and early.recheck_in == pytest.approx(0.2)
    assert at(10.5, **again).ready
    # a file an eval reads changes in the window: the window starts again
    (ck / "generation_config.json").write_text("{}")
    moved = at(10.6, **again)
    assert moved.state == "incomplete" and moved.write_mark != first.write_mark
    # 0 trusts the first look
    assert at(10.6, settle_seconds=0).ready


def test_the_tokenizer_and_an_hf_trainers_last_file_are_waited_for(tmp_path: Path) -> None:
    def verdict(ck: Path, **kw: Any) -> completeness.Completeness:
        return completeness.check(LocalFiles(ck), now=0, stable_seconds=60, settle_seconds=0, **kw)

    bare = write_fake_checkpoint(tmp_path / "r_step1", tokenizer=False)
    v = verdict(bare)
    assert v.state == "incomplete" and "tokenizer" in v.reason
    assert "eval.model_args.tokenizer" in v.reason  # what to do when none ever comes
    assert verdict(bare, tokenizer_required=False).ready  # the config names one elsewhere
    # the HF Trainer writes optimizer/scheduler/RNG states before trainer_state.json: a
    # `checkpoint-N` folder with them waits for it, as does any folder with training_args.bin
    hf = write_fake_checkpoint(tmp_path / "out" / "checkpoint-20")
    (hf / "optimizer.pt").write_bytes(b"o" * 100)
    v = verdict(hf, folder_name="checkpoint-20")
    assert v.state == "incomplete" and "trainer_state.json" in v.reason
    (hf / "trainer_state.json").write_text(json.dumps({"global_step": 20}))
    assert verdict(hf, folder_name="checkpoint-20").ready
    # a custom trainer that keeps its optimizer beside the model under its own naming never
    # writes trainer_state.json: not waited for
    custom = write_fake_checkpoint(tmp_path / "mine_step5")
    (custom / "optimizer.pt").write_bytes(b"o" * 100)
    assert verdict(custom, folder_name="mine_step5").ready
    args = write_fake_checkpoint(tmp_path / "mine_step6")
    (args / "training_args.bin").write_bytes(b"a")
    assert "trainer_state.json" in verdict(args, folder_name="mine_step6").reason


def test_files_an_eval_does_not_read_are_no_change_to_the_checkpoint(tmp_path: Path) -> None:
    ck = write_fake_checkpoint(tmp_path / "checkpoint-7")
    mark = eval_mark(LocalFiles(ck))
    (ck / "optimizer.pt").write_bytes(b"o" * 1000)  # the trainer goes on writing its own files
    (ck / "trainer_state.json").write_text("{}")
    (ck / "global_step7").mkdir()
    (ck / "global_step7" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"z")
    assert eval_mark(LocalFiles(ck)) == mark
    (ck / "tokenizer_config.json").write_text("{}")  # one it does read
    assert eval_mark(LocalFiles(ck)) != mark


def test_a_marker_does_not_vouch_for_missing_or_cut_shards(tmp_path: Path) -> None:
    ck = write_fake_checkpoint(tmp_path / "r_step1")
    (ck / ".checkpoint_complete").write_text("")  # written first, as a parallel upload may
    write_safetensors(ck / "model.safetensors", {"a.weight": 16, "b.weight": 8}, truncate_by=8)
    v = completeness.check(LocalFiles(ck), now=0, stable_seconds=60, settle_seconds=0)
    assert v.state == "incomplete" and "bytes written" in v.reason
    write_safetensors(ck / "model.safetensors", {"a.weight": 16, "b.weight": 8})
    v = completeness.check(LocalFiles(ck), now=0, stable_seconds=60, settle_seconds=0)
    assert v.ready and ".checkpoint_complete" in v.reason


# --- discovery: looks again when the window ends, with no poll and no write -------------------
def test_weights_first_and_the_tokenizer_2s_later_is_ready_once_settled_after_the_tokenizer(
    tmp_path: Path,
) -> None:
    watch = tmp_path / "ckpts"
    ck = write_fake_checkpoint(watch / "r_step1", tokenizer=False)
    state = State(tmp_path / "state")
    clock = Clock()
    source = LocalSource(watch, poll_seconds=1000, inotify=False)
    discovery = Discovery([source], state, 60, wake=lambda: None, clock=clock)
    try:
        first_look(discovery, clock)
        row = state.checkpoint(str(ck))
        assert row is not None and "tokenizer" in row.reason
        assert not discovery.settling()  # nothing to look at again until a write
        look(discovery, clock, 2.0)  # still no tokenizer (no poll is due: nothing looked)
        (ck / "tokenizer_config.json").write_text("{}")
        (ck / "tokenizer.json").write_text("{}")
        discovery.tick(clock.t, force=True, polls=False)  # the write's inotify wake-up
        look(discovery, clock)
        row = state.checkpoint(str(ck))
        assert row is not None and row.state == "incomplete" and "settling" in row.reason
        assert discovery.settling()
        deadline = discovery.next_deadline(polls=False)
        assert deadline is not None and deadline == pytest.approx(clock.t + 0.5, abs=0.05)
        look(discovery, clock, 0.3)  # not yet due: nothing looks
        assert state.checkpoint(str(ck)).state == "incomplete"  # type: ignore[union-attr]
        look(discovery, clock, 0.3)  # the window's end: the source looks by itself
        row = state.checkpoint(str(ck))
        assert row is not None and row.state == "ready" and not discovery.settling()
        assert row.fingerprint == fingerprint(LocalFiles(ck))  # the tokenizer is in it
    finally:
        discovery.close()
        state.close()


def test_s3_uploads_in_any_order_are_ready_only_when_all_are_there_and_settled(
    s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    client = make_client(s3_endpoint)
    local = write_two_shards(tmp_path / "r_step1")
    (local / "STABLE").write_text("")
    source = S3Source(
        f"s3://{bucket}/c/", client=client, retry=Retry(attempts=3, initial=0, maximum=0)
    )
    source.poll_seconds = 1000
    state = State(tmp_path / "state")
    clock = Clock()
    discovery = Discovery([source], state, 60, wake=lambda: None, clock=clock)
    location = f"s3://{bucket}/c/r_step1/"
    order = [  # the marker first, a shard before its index, the tokenizer last
        "STABLE",
        "model-00002-of-00002.safetensors",
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "tokenizer.json",
    ]
    try:
        for i, name in enumerate(order):
            client.upload_file(str(local / name), bucket, f"c/r_step1/{name}")
            first_look(discovery, clock) if i == 0 else look(discovery, clock, 0.01)
            discovery.tick(clock.t, force=True, polls=False)  # a poll after every upload
            look(discovery, clock)
            row = state.checkpoint(location)
            assert row is not None and row.state == "incomplete", (name, row)
        assert "settling" in state.checkpoint(location).reason  # type: ignore[union-attr]
        look(discovery, clock, 0.6)  # the window's end: looked at again without a poll
        row = state.checkpoint(location)
        assert row is not None and row.state == "ready", row
        assert row.fingerprint == fingerprint(LocalFiles(local))
    finally:
        discovery.close()
        state.close()


# --- pins hold only what was judged ---------------------------------------------------------
def test_a_pin_of_files_that_changed_since_they_were_judged_holds_nothing(tmp_path: Path) -> None:
    ck = write_fake_checkpoint(tmp_path / "ck" / "r_step1")
    judged = eval_mark(LocalFiles(ck))
    state = State(tmp_path / "state")
    pins = Pins(state, max_bytes=None)
    try:
        # what was judged: pinned
        assert pins.pin(str(ck), "f1", 1.0, judged) is not None
        pins.release(str(ck), "done")
        # the writer added a file an eval reads after the judgement: no pin, nothing held
        (ck / "chat_template.jinja").write_text("{{ messages }}")
        with pytest.raises(CheckpointChanged, match="changed after it was judged"):
            pins.pin(str(ck), "f1", 2.0, judged)
        assert pins.all() == {} and not pin_path(str(ck)).exists()
        # a trainer's own files are no change: pinned
        (ck / "chat_template.jinja").unlink()
        (ck / "optimizer.pt").write_bytes(b"o" * 100)
        assert pins.pin(str(ck), "f1", 3.0, judged) is not None
    finally:
        state.close()


class Said:
    """Stands in for a module's structlog logger: what it was told, as dictionaries (a logger
    the CLI's configuration cached in this process ignores `structlog.testing.capture_logs`)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.events.append({"event": event, "level": level, **kw})


def test_a_queued_pinned_checkpoint_that_a_trainer_deletes_file_by_file_is_not_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keep-last-k's `rmtree` takes a file at a time: a scan in the middle sees the checkpoint's
    files changed. Its pin holds exactly what was judged, so its job stays and reads the pin
    (before: judged again, its pin released, and `missed` once the folder was gone). A write
    through the pin's links (in place) still sends it to be judged again."""
    watch = tmp_path / "ckpts"
    kept = write_fake_checkpoint(watch / "r_step1")
    written = write_fake_checkpoint(watch / "r_step2")
    state = State(tmp_path / "state")
    pins = Pins(state, max_bytes=None)
    clock = Clock()
    source = LocalSource(watch, poll_seconds=1000, inotify=False)
    discovery = Discovery(
        [source], state, 1, wake=lambda: None, clock=clock, settle_seconds=0, pin_of=pins.path
    )
    try:
        first_look(discovery, clock)
        look(discovery, clock, 1.5)
        for ck in (kept, written):  # what the planner does with a due checkpoint
            row = state.checkpoint(str(ck))
            assert row is not None and row.state == "ready", row
            state.upsert_checkpoint(str(ck), source.name, clock.t, state="planned")
            state.add_job(
                Job(
                    f"j{ck.name}",
                    str(ck),
                    "r",
                    row.step,
                    ck.name,
                    [{"task": "t"}],
                    "h",
                    clock.t,
                    0.0,
                    fingerprint=row.fingerprint,
                    write_mark=row.write_mark,
                )
            )
            assert pins.pin(str(ck), row.fingerprint, clock.t, row.write_mark) is not None
        (kept / "model.safetensors").unlink()  # the trainer's rmtree, half way
        (written / "config.json").write_text('{"model_type": "llama", "rewritten": 1}')
        said = Said()
        monkeypatch.setattr("ckpt_watcher.discovery.log", said)
        for _ in range(2):
            discovery.tick(clock.t, force=True, polls=False)
            look(discovery, clock, 0.1)
        shutil.rmtree(kept)  # and done
        discovery.tick(clock.t, force=True, polls=False)
        look(discovery, clock, 0.1)
        events = [(e["event"], Path(e["location"]).name) for e in said.events if "location" in e]
        assert events.count(("checkpoint.changed_held", "r_step1")) == 1, events
        assert ("checkpoint.deleted_pinned", "r_step1") in events
        assert state.checkpoint(str(kept)).state == "planned"  # type: ignore[union-attr]
        assert [j.id for j in state.jobs("queued")] == ["jr_step1"]
        assert pins.path(str(kept)) is not None
        # the one written in place through its pin: judged again, its job gone
        assert ("checkpoint.changed_before_eval", "r_step2") in events
        assert ("checkpoint.changed_held", "r_step2") not in events
    finally:
        discovery.close()
        state.close()


def test_an_evaluated_checkpoint_that_a_trainer_deletes_file_by_file_stays_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Evaluated, then deleted by keep-last-k a file at a time: a scan in the middle sees its
    files changed (a rewrite, checked again), the next finds it gone. It stays `done` (a suite
    run on CI found it `missed`, its results all in the ledger)."""
    watch = tmp_path / "ckpts"
    ck = write_fake_checkpoint(watch / "r_step1")
    state = State(tmp_path / "state")
    clock = Clock()
    source = LocalSource(watch, poll_seconds=1000, inotify=False)
    discovery = Discovery([source], state, 1, wake=lambda: None, clock=clock, settle_seconds=0)
    try:
        first_look(discovery, clock)
        look(discovery, clock, 1.5)
        row = state.checkpoint(str(ck))
        assert row is not None and row.state == "ready", row
        job = Job("j1", str(ck), "r", row.step, ck.name, [{"task": "t"}], "h", clock.t, 0.0)
        state.add_job(job)
        state.update_job("j1", state="ok")
        state.upsert_checkpoint(str(ck), source.name, clock.t, state="done")
        said = Said()
        monkeypatch.setattr("ckpt_watcher.discovery.log", said)
        (ck / "model.safetensors").unlink()  # the trainer's rmtree, half way
        discovery.tick(clock.t, force=True, polls=False)
        look(discovery, clock, 0.1)
        assert state.checkpoint(str(ck)).state == "incomplete"  # type: ignore[union-attr]
        shutil.rmtree(ck)  # and done
        discovery.tick(clock.t, force=True, polls=False)
        look(discovery, clock, 0.1)
        events = [e["event"] for e in said.events]
        assert "checkpoint.files_changed" in events and "checkpoint.missed" not in events, events
        assert state.checkpoint(str(ck)).state == "done"  # type: ignore[union-attr]
    finally:
        discovery.close()
        state.close()


def test_a_verl_lora_steps_model_is_its_adapter_though_its_config_folder_came_first(
    s3_endpoint: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With LoRA and no `hf_model`, verl saves (fsdp_workers.save_checkpoint) the actor's FSDP
    shards, `lora_train_meta.json` and `actor/huggingface/` with a config and tokenizer but no
    weights, then the adapter in `actor/lora_adapter/`: its tensors, then its config. A look in
    between sees the shards of a LoRA run, waiting for the adapter; then the step's model is the
    adapter: the same checkpoint, ready, never `missed` (a vanished checkpoint not evaluated).
    In a folder and on S3, in one daemon."""
    client = make_client(s3_endpoint)
    base = write_fake_checkpoint(tmp_path / "base")
    watch, remote = tmp_path / "ckpts", tmp_path / "remote"  # remote: uploaded as written

    def upload(folder: Path) -> None:
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                client.upload_file(str(f), bucket, f"c/{f.relative_to(remote).as_posix()}")

    steps = {  # where the step is written, what publishes a folder, a folder's location
        "local": (watch, lambda f: None, str),
        "s3": (remote, upload, lambda p: f"s3://{bucket}/c/{p.relative_to(remote).as_posix()}/"),
    }
    s3 = S3Source(f"s3://{bucket}/c/", client=client, retry=Retry(attempts=3, initial=0, maximum=0))
    s3.poll_seconds = 1000
    local = LocalSource(watch, poll_seconds=1000, inotify=False)
    state = State(tmp_path / "state")
    clock = Clock()
    discovery = Discovery([local, s3], state, 60, wake=lambda: None, clock=clock, settle_seconds=0)
    said = Said()
    monkeypatch.setattr("ckpt_watcher.discovery.log", said)
    try:
        first_look(discovery, clock)
        for root, publish, _ in steps.values():
            actor = root / "exp" / "global_step_10" / "actor"
            hf = write_fake_checkpoint(actor / "huggingface")
            (hf / "model.safetensors").unlink()
            (actor / "model_world_size_1_rank_0.pt").write_bytes(b"fsdp shard " * 100)
            (actor / "lora_train_meta.json").write_text('{"r": 8, "lora_alpha": 16}')
            publish(actor)
        discovery.tick(clock.t, force=True, polls=False)
        look(discovery, clock)
        for name, (root, publish, where) in steps.items():
            actor = root / "exp" / "global_step_10" / "actor"
            row = state.checkpoint(where(actor))
            assert row is not None and row.state == "incomplete", (name, row)
            assert "a LoRA run" in row.reason, row
            lora = actor / "lora_adapter"
            lora.mkdir()
            write_safetensors(lora / "adapter_model.safetensors", {"lora_A": 8, "lora_B": 8})
            config = {"peft_type": "LORA", "r": 8, "base_model_name_or_path": str(base)}
            (lora / "adapter_config.json").write_text(json.dumps(config))
            publish(lora)
        for _ in range(3):  # seen, judged, settled
            discovery.tick(clock.t, force=True, polls=False)
            look(discovery, clock, 0.5)
        for name, (root, _, where) in steps.items():
            actor = root / "exp" / "global_step_10" / "actor"
            assert state.checkpoint(where(actor)) is None, name  # forgotten, not missed
            row = state.checkpoint(where(actor / "lora_adapter"))
            assert row is not None and row.state == "ready", (name, row)
            assert (row.run, row.step, row.label) == ("exp", 10, "global_step_10"), row
            assert "LoRA/PEFT adapter" in (row.reason or ""), row
        assert state.checkpoint_counts() == {"ready": 2}, state.checkpoint_counts()
        events = [e["event"] for e in said.events]
        assert events.count("checkpoint.model_moved") == 2, said.events
        assert "checkpoint.missed" not in events, said.events
    finally:
        discovery.close()
        state.close()


def test_a_verl_lora_step_with_merged_weights_too_is_evaluated_once_on_what_was_judged(
    s3_endpoint: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl with LoRA and `hf_model` saves the step's model twice: the merged weights in
    `actor/huggingface/` and the adapter in `actor/lora_adapter/`. A sync to S3 can finish the
    small adapter before the merged weights (and a local copy can land in any order): the step
    is judged ready on its adapter, queued, and then its merged weights appear. It is one
    checkpoint: its job stays, nothing is `missed`, no second checkpoint is judged; in a folder
    (the model folder moves under a running daemon) and on S3 (a daemon started again decides
    afresh), in one daemon."""
    client = make_client(s3_endpoint)
    base = write_fake_checkpoint(tmp_path / "base")
    watch, remote = tmp_path / "ckpts", tmp_path / "remote"

    def upload(folder: Path) -> None:
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                client.upload_file(str(f), bucket, f"c/{f.relative_to(remote).as_posix()}")

    steps = {
        "local": (watch, lambda f: None, str),
        "s3": (remote, upload, lambda p: f"s3://{bucket}/c/{p.relative_to(remote).as_posix()}/"),
    }
    state = State(tmp_path / "state")
    clock = Clock()
    said = Said()
    monkeypatch.setattr("ckpt_watcher.discovery.log", said)

    def daemon() -> Discovery:
        s3 = S3Source(
            f"s3://{bucket}/c/", client=client, retry=Retry(attempts=3, initial=0, maximum=0)
        )
        s3.poll_seconds = 1000
        local = LocalSource(watch, poll_seconds=1000, inotify=False)
        return Discovery([local, s3], state, 60, wake=lambda: None, clock=clock, settle_seconds=0)

    def looks(discovery: Discovery) -> None:
        for _ in range(3):
            discovery.tick(clock.t, force=True, polls=False)
            look(discovery, clock, 0.5)

    discovery = daemon()
    try:
        first_look(discovery, clock)
        for root, publish, _ in steps.values():  # the config, then the adapter, uploaded whole
            actor = root / "exp" / "global_step_10" / "actor"
            hf = write_fake_checkpoint(actor / "huggingface")
            (hf / "model.safetensors").rename(tmp_path / f"{root.name}-merged.safetensors")
            lora = actor / "lora_adapter"
            lora.mkdir()
            write_safetensors(lora / "adapter_model.safetensors", {"lora_A": 8, "lora_B": 8})
            config = {"peft_type": "LORA", "r": 8, "base_model_name_or_path": str(base)}
            (lora / "adapter_config.json").write_text(json.dumps(config))
            publish(actor)
        looks(discovery)
        for name, (root, _, where) in steps.items():  # what the planner does with it
            lora = root / "exp" / "global_step_10" / "actor" / "lora_adapter"
            row = state.checkpoint(where(lora))
            assert row is not None and row.state == "ready", (name, row)
            state.upsert_checkpoint(row.location, row.source, clock.t, state="planned")
            state.add_job(
                Job(
                    f"j{name}",
                    row.location,
                    "exp",
                    10,
                    row.label,
                    [{"task": "t"}],
                    "h",
                    clock.t,
                    0.0,
                )
            )
        for root, publish, _ in steps.values():  # the merged weights land
            hf = root / "exp" / "global_step_10" / "actor" / "huggingface"
            (tmp_path / f"{root.name}-merged.safetensors").rename(hf / "model.safetensors")
            publish(hf)
        looks(discovery)
        rows = [(r.location, r.state) for r in state.checkpoints()]
        assert state.checkpoint_counts() == {"planned": 2}, rows
        kept = [e["location"] for e in said.events if e["event"] == "checkpoint.model_kept"]
        assert kept == [str(watch / "exp" / "global_step_10" / "actor" / "lora_adapter")], kept
        discovery.close()
        discovery = daemon()  # started again: S3's model folders are decided afresh
        first_look(discovery, clock)
        looks(discovery)
        rows = [(r.location, r.state) for r in state.checkpoints()]
        assert state.checkpoint_counts() == {"planned": 2}, rows
        assert sorted(j.id for j in state.jobs("queued")) == ["jlocal", "js3"]
        events = [e["event"] for e in said.events]
        assert events.count("checkpoint.model_kept") == 3, said.events  # local: once a start
        assert "checkpoint.missed" not in events, said.events
    finally:
        discovery.close()
        state.close()


def test_a_verl_step_whose_actor_keep_last_k_deleted_on_s3_is_missed_not_kept(
    s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    """verl's keep-last-k deletes a step's `actor/` and leaves the step's folder with its
    `data.pt`; a sync with deletions does the same in the bucket. The step's model is gone: a
    step not yet evaluated is *missed*, as in a folder (its model folder, once found, was kept
    in memory and the step was listed on as if still there: its job would have failed)."""
    client = make_client(s3_endpoint)
    remote = tmp_path / "remote"
    step = remote / "exp" / "global_step_10"
    write_fake_checkpoint(step / "actor" / "huggingface")
    (step / "data.pt").write_bytes(b"dataloader state")
    for f in sorted(step.rglob("*")):
        if f.is_file():
            client.upload_file(str(f), bucket, f"c/{f.relative_to(remote).as_posix()}")
    s3 = S3Source(f"s3://{bucket}/c/", client=client, retry=Retry(attempts=3, initial=0, maximum=0))
    s3.poll_seconds = 1000
    state = State(tmp_path / "state")
    clock = Clock()
    discovery = Discovery([s3], state, 60, wake=lambda: None, clock=clock, settle_seconds=0)
    hf = f"s3://{bucket}/c/exp/global_step_10/actor/huggingface/"
    try:
        first_look(discovery, clock)
        for _ in range(2):
            discovery.tick(clock.t, force=True, polls=False)
            look(discovery, clock, 0.5)
        row = state.checkpoint(hf)
        assert row is not None and row.state == "ready", row
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix="c/exp/global_step_10/actor/"
        ):
            for o in page.get("Contents", []):
                client.delete_object(Bucket=bucket, Key=o["Key"])
        discovery.tick(clock.t, force=True, polls=False)
        look(discovery, clock, 0.5)
        row = state.checkpoint(hf)
        assert row is not None and row.state == "missed", row
    finally:
        discovery.close()
        state.close()


def test_cpu_slots_share_the_cores_unless_the_environment_sets_threads() -> None:
    two = cpu_slots(2, cores=8)
    assert [d.threads for d in two] == [4, 4]
    env = two[0].worker_env(environ={})
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "4"
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert two[0].worker_env(environ={"OMP_NUM_THREADS": "2"}).get("OMP_NUM_THREADS") is None
    assert cpu_slots(3, cores=2)[0].threads == 1  # never none
    assert cpu_slots(1, cores=8)[0].threads == 8


# --- beside `watcher run` ---------------------------------------------------------------------
def _once_each_on_final_bytes(
    ledgers: Path, run: str, folders: dict[int, Path], log: Path, changed: bool = False
) -> None:
    """Every checkpoint of `run` has exactly one `ok` line, no other line, and the line's
    fingerprint is that of the folder as its writer left it. No checkpoint was seen changing
    after it was judged ready, unless `changed` (a rewrite the test makes): then that was seen
    before anything was filed on the old files."""
    lines = read_ledger(ledgers, run)
    ok = Counter(ln["step"] for ln in lines if ln["status"] == "ok")
    assert ok == Counter(dict.fromkeys(folders, 1)), (ok, [ln.get("error") for ln in lines])
    assert all(ln["status"] == "ok" for ln in lines), [ln.get("error") for ln in lines]
    for line in lines:
        assert line["fingerprint"] == fingerprint(LocalFiles(folders[line["step"]])), line["step"]
    events = [json.loads(x).get("event") for x in log.read_text().splitlines() if x.startswith("{")]
    assert "checkpoint.rewritten" not in events
    assert "checkpoint.files_changed" not in events
    assert ("checkpoint.changed_before_eval" in events) == changed


@pytest.mark.e2e
def test_hf_trainer_checkpoints_are_each_evaluated_once_on_their_final_bytes(
    tmp_path: Path, addition_tasks: Path
) -> None:
    watch = tmp_path / "ckpts"
    watch.mkdir()
    # a warm engine: 12 checkpoints, each a weight swap rather than a new worker
    data = base_config(tmp_path, watch, addition_tasks, limit=20, warm_engine=True)
    data["sources"][0]["poll_seconds"] = 30  # inotify and the settle window do the looking
    cfg = write_config(tmp_path / "w.yaml", data)
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        wait_for(lambda: status_json(cfg)[0] == 0, 60, "the daemon to be up", daemon, log)
        # 60 steps, a save every 5, 0.2 s a step: a save every second, each to a watcher idle
        # enough to look at once (before the settle rule: 3 of 12 evaluated twice, here)
        trainer = subprocess.run(
            [sys.executable, str(HERE / "hf_trainer.py"), str(watch / "hf"), "60", "5", "0.2"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert trainer.returncode == 0, trainer.stderr[-3000:]
        folders = {n: watch / "hf" / f"checkpoint-{n}" for n in range(5, 61, 5)}
        assert all((f / "trainer_state.json").exists() for f in folders.values())
        ledgers = tmp_path / "ledgers"
        wait_for(
            lambda: len({ln["step"] for ln in read_ledger(ledgers, "hf")}) == 12,
            300,
            "a result for each of the 12 checkpoints",
            daemon,
            log,
        )
        wait_for(lambda: status_json(cfg)[1]["pinned"] == [], 30, "pins released", daemon, log)
    _once_each_on_final_bytes(ledgers, "hf", folders, log)


def _verl_save(exp: Path, step: int, trained: Path) -> Path:
    """Step `step` written as verl writes it (fsdp_checkpoint_manager, ray_trainer): the actor's
    FSDP shards, then config and tokenizer in `actor/huggingface/`, a barrier while rank 0
    gathers the full weights, the weights, the dataloader's state, the run's step tracker."""
    actor = exp / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    (actor / "model_world_size_1_rank_0.pt").write_bytes(b"fsdp shard " * 100)
    hf = actor / "huggingface"
    hf.mkdir()
    config = json.loads((trained / "config.json").read_text())
    config["_name_or_path"] = str(hf)  # each step other content, as training makes it
    (hf / "config.json").write_text(json.dumps(config))
    for f in trained.iterdir():
        if f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, hf / f.name)
    time.sleep(1.5)  # the barrier and the gather
    for f in trained.glob("*.safetensors"):
        _copy_slowly(f, hf / f.name)
    (actor.parent / "data.pt").write_bytes(b"loader state")
    (exp / "latest_checkpointed_iteration.txt").write_text(str(step))
    return hf


def _pinned(log: Path, location: Path) -> bool:
    for raw in log.read_text().splitlines():
        line = json.loads(raw) if raw.startswith("{") else {}
        if line.get("event") == "pin.held" and line.get("location") == str(location):
            return True
    return False


@pytest.mark.e2e
def test_a_verl_run_is_evaluated_step_by_step_on_its_hugging_face_copy_despite_keep_last_k(
    tmp_path: Path, trained_checkpoint: Path, addition_tasks: Path
) -> None:
    """verl's layout (`global_step_N/actor/huggingface/`): each step evaluated once, on the bytes
    verl wrote, filed under the experiment's run and the step, even though verl's keep-last-k
    (`max_actor_ckpt_to_keep`) deletes the step's `actor/` before its eval has read it."""
    watch = tmp_path / "ckpts"
    exp = watch / "qwen3-grpo"  # verl: checkpoints/<project>/<experiment>/global_step_N
    exp.mkdir(parents=True)
    cfg = write_config(tmp_path / "w.yaml", base_config(tmp_path, watch, addition_tasks, limit=20))
    log = tmp_path / "daemon.log"
    prints = {}
    with watcher_run(cfg, log) as daemon:
        for step in (10, 20):
            hf = _verl_save(exp, step, trained_checkpoint)
            prints[step] = fingerprint(LocalFiles(hf))
            wait_for(lambda h=hf: _pinned(log, h), 120, f"step {step} pinned", daemon, log)
            shutil.rmtree(hf.parent)  # keep-last-k, before (or while) its eval reads it
        ledgers = tmp_path / "ledgers"
        wait_for(lambda: len(read_ledger(ledgers, "qwen3-grpo")) == 2, 300, "both", daemon, log)
        wait_for(lambda: status_json(cfg)[1]["pinned"] == [], 30, "pins released", daemon, log)
    lines = sorted(read_ledger(ledgers, "qwen3-grpo"), key=lambda ln: ln["step"])
    assert [(ln["step"], ln["status"]) for ln in lines] == [(10, "ok"), (20, "ok")], lines
    for line in lines:
        assert line["fingerprint"] == prints[line["step"]], line
        assert line["label"] == f"global_step_{line['step']}", line
        assert line["checkpoint"] == str(exp / line["label"] / "actor" / "huggingface"), line
        assert 0.0 < line["metrics"]["exact_match,none"] <= 1.0, line
    # the pins (beside the steps' folders, outside what keep-last-k deleted) are released
    assert not (exp / PIN_FOLDER).exists() or not any((exp / PIN_FOLDER).iterdir())


def _copy_slowly(src: Path, dest: Path, pieces: int = 4, pause: float = 0.1) -> None:
    """Write `src` to `dest` in place, a piece at a time (a reader sees it growing)."""
    data = src.read_bytes()
    step = -(-len(data) // pieces)
    with open(dest, "wb") as f:
        for i in range(0, len(data), step):
            f.write(data[i : i + step])
            f.flush()
            time.sleep(pause)


TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


@pytest.mark.e2e
def test_writers_that_pause_or_write_the_index_first_are_evaluated_once_on_the_complete_set(
    tmp_path: Path, trained_checkpoint: Path, addition_tasks: Path
) -> None:
    material = tmp_path / "material"
    late_src, index_src = derived_checkpoints(trained_checkpoint, material, "m", (1, 2))
    shards = reshard_in_two(index_src, material)
    watch = tmp_path / "ckpts"
    watch.mkdir()
    cfg = write_config(tmp_path / "w.yaml", base_config(tmp_path, watch, addition_tasks, limit=20))
    log = tmp_path / "daemon.log"
    late, indexed = watch / "late_step10", watch / "index_step10"

    def weights_then_tokenizer_2s_later() -> None:
        late.mkdir()
        shutil.copy(late_src / "config.json", late)
        shutil.copy(late_src / "generation_config.json", late)
        _copy_slowly(late_src / "model.safetensors", late / "model.safetensors")
        time.sleep(2.0)
        for name in TOKENIZER:
            shutil.copy(late_src / name, late)

    def index_before_its_shards() -> None:
        indexed.mkdir()
        shutil.copy(material / "model.safetensors.index.json", indexed)
        for name in ("config.json", "generation_config.json", *TOKENIZER):
            shutil.copy(index_src / name, indexed)
        _copy_slowly(material / shards[0], indexed / shards[0])
        time.sleep(1.5)
        _copy_slowly(material / shards[1], indexed / shards[1])

    seen: list[str] = []
    with watcher_run(cfg, log) as daemon:
        wait_for(lambda: status_json(cfg)[0] == 0, 60, "the daemon to be up", daemon, log)
        writers = [
            threading.Thread(target=weights_then_tokenizer_2s_later),
            threading.Thread(target=index_before_its_shards),
        ]
        for w in writers:
            w.start()

        def waiting_reasons() -> bool:  # what status says while the writers pause
            body = status_json(cfg)[1] or {}
            for c in body.get("checkpoints") or []:
                seen.append(f"{c['label']} {c['state']}: {c['reason']}")
            return not any(w.is_alive() for w in writers)

        wait_for(waiting_reasons, 60, "the writers to finish", daemon, log, every=0.2)
        ledgers = tmp_path / "ledgers"
        wait_for(
            lambda: read_ledger(ledgers, "late") and read_ledger(ledgers, "index"),
            180,
            "both results",
            daemon,
            log,
        )
    _once_each_on_final_bytes(ledgers, "late", {10: late}, log)
    _once_each_on_final_bytes(ledgers, "index", {10: indexed}, log)
    # each was started only after its writer's last file
    for folder, last in ((late, "tokenizer.json"), (indexed, shards[1])):
        (line,) = read_ledger(ledgers, folder.name.split("_")[0])
        written = (folder / last).stat().st_mtime
        started = datetime.fromisoformat(line["started_at"].replace("Z", "+00:00")).timestamp()
        assert started >= written, (folder.name, line["started_at"])
    assert any("late_step10" in s and "tokenizer" in s for s in seen), seen


@pytest.mark.e2e
def test_a_queued_checkpoint_rewritten_in_place_is_judged_again_and_evaluated_on_its_new_bytes(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    """A writer that writes into the same inode (a config rewritten in place, `torch.save` over
    `pytorch_model.bin`) writes through the hard-link pin: the job's worker finds the files
    other than judged before it loads anything, no attempt is spent, and the checkpoint is
    judged again and evaluated once, on what it holds now."""
    watch = tmp_path / "ckpts"
    first = copy_checkpoint(watch / "r_step100")
    queued = copy_checkpoint(watch / "r_step200")
    data = base_config(tmp_path, watch, addition_tasks, limit=20)
    data["policy"] = {"order": "oldest_first"}  # step 100 runs, step 200 waits (one slot)
    cfg = write_config(tmp_path / "w.yaml", data)
    log = tmp_path / "daemon.log"
    ledgers = tmp_path / "ledgers"
    with watcher_run(cfg, log) as daemon:

        def first_running_second_pinned() -> bool:
            body = status_json(cfg)[1] or {}
            running = [r.get("step") for r in body.get("running") or []]
            pinned = [p["location"] for p in body.get("pinned") or []]
            return running == [100] and str(queued) in pinned

        wait_for(first_running_second_pinned, 120, "step 100 running, 200 pinned", daemon, log)
        config = queued / "config.json"
        inode = config.stat().st_ino
        text = json.loads(config.read_text())
        with open(config, "r+") as f:  # in place: the pin's link sees it too
            f.write(json.dumps(text | {"_rewritten": True}))
            f.truncate()
        assert config.stat().st_ino == inode
        wait_for(
            lambda: {ln["step"] for ln in read_ledger(ledgers, "r")} == {100, 200},
            180,
            "both results",
            daemon,
            log,
        )
    _once_each_on_final_bytes(ledgers, "r", {100: first, 200: queued}, log, changed=True)
    (line,) = [ln for ln in read_ledger(ledgers, "r") if ln["step"] == 200]
    assert line["attempt"] == 1, line  # the refused start spent no attempt


def test_a_worker_reads_nothing_but_the_files_its_checkpoint_was_judged_with(
    tmp_path: Path,
) -> None:
    """The job's spec carries the write mark its fingerprint was taken with; a worker that finds
    the files other than that loads nothing, records nothing and says so (EXIT_CHANGED, a crash
    file marked `changed`): the daemon judges the checkpoint again, spending no attempt."""
    from ckpt_watcher.jobfolder import EXIT_CHANGED, EvalRequest, JobFolder, JobSpec, TaskRun

    ck = write_fake_checkpoint(tmp_path / "r_step1")
    judged = eval_mark(LocalFiles(ck))
    (ck / "config.json").write_text(json.dumps({"model_type": "llama", "rewritten": 1}))
    folder = JobFolder(tmp_path / "job" / "attempt-1")
    request = EvalRequest(
        str(ck), "hf", {}, [TaskRun("t1", 0)], 42, {}, None, None, None, None, str(tmp_path), "cpu"
    )
    folder.write_spec(JobSpec("j", "cpu:0", request, write_mark=judged))
    r = subprocess.run(
        [sys.executable, "-m", "ckpt_watcher.worker", str(folder.path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == EXIT_CHANGED, r.stdout[-2000:] + r.stderr[-2000:]
    crash = folder.crash()
    assert crash is not None and crash.changed and "changed after it was judged" in crash.error
    assert folder.outcomes() == ([], [])
    assert "torch" not in r.stdout  # refused before anything heavy was imported
