"""Trainers' own checkpoints, evaluated as they write them: verl's FSDP shards (its
`FSDPCheckpointManager`, run here on gloo CPU ranks by tests/writers/verl_fsdp.py, with verl's
default `save_contents`: no Hugging Face weights), DeepSpeed's engine states (its own
`save_checkpoint`, tests/writers/deepspeed_save.py, as OpenRLHF saves) and NeMo-RL's sharded
safetensors (torch's own HuggingFaceStorageWriter, tests/writers/nemo_rl.py) and accelerate's
FSDP2 distributed checkpoints (torch's DCP save, tests/writers/accelerate_fsdp2.py) are judged
complete by their own files,
converted in the worker's scratch (never in the trainer's folders) and scored as the same
weights saved as a Hugging Face folder; the conversion equals verl's own merger; a shard that is
cut short, missing or not weights is never read as a model.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.checkpoints import completeness
from ckpt_watcher.checkpoints.files import LocalFiles, needed_files
from ckpt_watcher.checkpoints.naming import model_folder
from ckpt_watcher.errors import NativeFormatError
from ckpt_watcher.formats import detect
from ckpt_watcher.formats.torchzip import read_index
from ckpt_watcher.sources.local import LocalSource

from .conftest import (
    HF_FILES,
    base_config,
    hf_copy,
    read_ledger,
    s3_source,
    saved,
    verl_command,
    write_config,
)
from .helpers import Throttle, running_job, status_json, wait_for, watcher_once, watcher_run

DS_WRITER = Path(__file__).parent / "writers" / "deepspeed_save.py"
NEMO_WRITER = Path(__file__).parent / "writers" / "nemo_rl.py"
ACCELERATE_WRITER = Path(__file__).parent / "writers" / "accelerate_fsdp2.py"


def verl_save(model: Path, out: Path, step: int, ranks: int, *extra: str) -> Path:
    saved(verl_command(model, out, step, ranks, *extra))
    return out / f"global_step_{step}" / "actor"


def listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` (the watcher's pins aside): its size and mtime."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".ckpt-watcher-pins" not in p.parts
    }


def judge(files: LocalFiles, **kw: Any) -> completeness.Completeness:
    """completeness.check as discovery asks it: with the trainer's format its files are in."""
    return completeness.check(files, native=detect(files.files), **kw)


def tensors(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


# --- what the shards are, by their files -------------------------------------------------------


def test_a_verl_steps_model_is_its_hugging_face_weights_else_its_shards_else_its_adapter() -> None:
    def holds(*paths: str) -> Any:
        return lambda p: p in {*paths, *(q.rsplit("/", 1)[0] for q in paths if "/" in q)}

    assert model_folder("global_step_5", holds("actor/model_world_size_2_rank_0.pt")) == "actor"
    weights = holds("actor/model_world_size_2_rank_0.pt", "actor/huggingface/model.safetensors")
    assert model_folder("global_step_5", weights) == "actor/huggingface"
    lora = holds("actor/x.pt", "actor/lora_adapter/adapter_config.json")
    assert model_folder("global_step_5", lora) == "actor/lora_adapter"
    assert model_folder("global_step_5", holds("policy/model_world_size_1_rank_0.pt")) == "policy"
    # verl's SFT trainer: the shards and huggingface/ in the step's folder itself
    assert model_folder("global_step_5", holds("huggingface/config.json")) == ""
    assert model_folder("global_step_5", holds("data.pt")) is None


def test_rank_files_that_disagree_or_never_come_are_invalid_and_one_being_written_waits(
    tmp_path: Path,
) -> None:
    actor = tmp_path / "global_step_5" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    (actor / "huggingface" / "config.json").write_text("{}")
    (actor / "huggingface" / "tokenizer.json").write_text("{}")
    whole = b"x" * 100 + b"PK\x05\x06" + bytes(18)  # a zip's end record: torch.save is done
    (actor / "model_world_size_2_rank_0.pt").write_bytes(whole)
    (actor / "optim_world_size_2_rank_0.pt").write_bytes(b"o" * 50)

    def judge_now(quiet_for: float | None = None) -> completeness.Completeness:
        view = LocalFiles(actor)
        said = judge(view, now=0.0, stable_seconds=30, settle_seconds=0)
        if quiet_for is None:
            return said
        return judge(
            view,
            now=quiet_for,
            stable_seconds=30,
            settle_seconds=0,
            unchanged_since=0.0,
            previous_mark=said.write_mark,
        )

    said = judge_now()
    assert said.state == "incomplete" and "1 of 2 ranks" in said.reason, said
    said = judge_now(quiet_for=31)  # rank 1 never came: a broken save, not a model
    assert said.state == "invalid" and "not whole" in said.reason, said
    (actor / "model_world_size_2_rank_1.pt").write_bytes(b"x" * 100)  # no end record yet
    said = judge_now()
    assert said.state == "incomplete" and "rank_1.pt: being written" in said.reason, said
    (actor / "model_world_size_2_rank_1.pt").write_bytes(whole)
    said = judge_now()
    assert said.ready and said.reason == "verl FSDP shards: 2 of 2 ranks whole", said
    # the files a conversion reads: never the optimizer's
    assert needed_files(LocalFiles(actor).files) == [
        "huggingface/config.json",
        "huggingface/tokenizer.json",
        "model_world_size_2_rank_0.pt",
        "model_world_size_2_rank_1.pt",
    ]
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    said = judge_now()
    assert said.state == "invalid" and "world_size 4, the files 2" in said.reason, said
    (actor / "fsdp_config.json").unlink()
    (actor / "model_world_size_4_rank_2.pt").write_bytes(whole)
    said = judge_now()
    assert said.state == "invalid" and "world sizes [2, 4]" in said.reason, said


def test_a_shard_that_would_run_code_is_refused_without_running_it(tmp_path: Path) -> None:
    """A `.pt` file is a pickle: loaded with torch.load(weights_only=False), as verl's merger
    loads it, it can run anything. Ours reads tensors and DTensors only."""
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {ran}",))

    path = tmp_path / "model_world_size_1_rank_0.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"w": Payload()}, protocol=2))
        zf.writestr("archive/byteorder", "little")
    with pytest.raises(NativeFormatError, match=r"holds a (posix|os)\.system.*not loaded"):
        read_index(path)
    assert not ran.exists()


def crafted_pt(path: Path, shape: tuple[int, ...], state: dict[str, Any] | None = None) -> None:
    """A `model_world_size_1_rank_0.pt` by hand: one float tensor `w` of `shape` over a storage
    of 4 floats, its record given `state` by pickle's BUILD (what torch.save never writes)."""
    import collections

    import torch

    storage = object()

    class Tensor:
        def __reduce__(self) -> tuple[Any, ...]:
            args = (storage, 0, shape, tuple(1 for _ in shape), False, collections.OrderedDict())
            return (torch._utils._rebuild_tensor_v2, args, *([state] if state else []))

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return ("storage", torch.FloatStorage, "0", "cpu", 4) if obj is storage else None

    raw = __import__("io").BytesIO()
    Pickler(raw, protocol=2).dump({"w": Tensor()})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", raw.getvalue())
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/data/0", bytes(16))
        zf.writestr("archive/data/1", b"neighbour" * 8)


def test_a_crafted_pt_can_neither_point_a_tensor_at_a_host_file_nor_outrun_its_storage(
    tmp_path: Path,
) -> None:
    """pickle's BUILD would rewrite a tensor record's fields behind its frozen dataclass (its
    path: any file the daemon can read, copied into model.safetensors); a declared shape larger
    than its storage would read the next member, or ask torch for any allocation first. Each is
    refused before a byte of tensor data is read."""
    secret = tmp_path / "host-secret"
    secret.write_bytes(b"AWS_SECRET=" + b"s" * 64)
    path = tmp_path / "model_world_size_1_rank_0.pt"
    crafted_pt(path, (4,), {"path": secret, "member": "", "at": 0, "storage_bytes": 1 << 20})
    with pytest.raises(NativeFormatError, match="sets the state of a LazyTensor.*crafted"):
        read_index(path)
    crafted_pt(path, (4,))
    assert read_index(path)["w"].read().tolist() == [0.0] * 4  # the honest file reads
    crafted_pt(path, (8,))  # 32 bytes from a storage of 16: the neighbouring member's
    (w,) = read_index(path).values()
    with pytest.raises(NativeFormatError, match="needs 32 bytes of its storage.*which has 16"):
        w.read()
    crafted_pt(path, (1 << 40,))  # 4 TiB declared: refused, never allocated
    (w,) = read_index(path).values()
    with pytest.raises(NativeFormatError, match="which has 16"):
        next(w.blocks(1 << 20))
    crafted_pt(path, (-4,))
    with pytest.raises(NativeFormatError, match="not a tensor"):
        read_index(path)


def test_a_rank_files_few_fields_are_read_without_its_tensors(tmp_path: Path) -> None:
    """DeepSpeed's completeness asks rank 0's model states for the world size at every look
    (from S3: at every scan); with frozen parameters (LoRA under ZeRO-3) that file is the base
    model's size. Its zip directory and pickle are read in ranges, never its tensors."""
    import torch

    from ckpt_watcher.formats.torchzip import read_index_at

    path = tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save({"dp_world_size": 8, "frozen": torch.zeros(4_000_000)}, path)
    size, reads = path.stat().st_size, []

    def read_at(start: int, length: int) -> bytes:
        reads.append(length)
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(length)

    index = read_index_at(path.name, size, read_at)
    assert index["dp_world_size"] == 8 and index["frozen"].shape == (4_000_000,)
    assert sum(reads) < 64 * 1024 < size // 100, (sum(reads), size)


# --- verl's own files -------------------------------------------------------------------------


@pytest.mark.e2e
def test_verl_shards_convert_to_the_weights_saved_and_to_what_verls_merger_writes(
    verl_run: Path, tmp_path: Path
) -> None:
    import torch

    actor = verl_run / "verl" / "grpo" / "global_step_300" / "actor"
    fmt = detect(LocalFiles(actor).files)
    assert fmt is not None and fmt.name == "verl-fsdp"
    seen: list[tuple[int, int]] = []
    (tmp_path / "fp32").mkdir()
    fmt.convert(actor, tmp_path / "fp32", None, lambda done, total: seen.append((done, total)))
    saved = tensors(verl_run / "hf" / "ref_step300")
    ours = tensors(tmp_path / "fp32")
    assert set(ours) == set(saved) and all(torch.equal(ours[k], saved[k]) for k in saved)
    assert {t.dtype for t in ours.values()} == {torch.float32}  # as saved: fp32 stays fp32
    assert seen[-1][0] == seen[-1][1] == sum(t.nbytes for t in ours.values())
    assert sorted(p.name for p in (tmp_path / "fp32").iterdir()) == sorted(
        [*HF_FILES, "model.safetensors"]
    )
    # verl's own merger (bf16 always) on the same folder: the same tensors, cast
    merged = tmp_path / "merger"
    r = subprocess.run(
        [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp"]
        + ["--local_dir", str(actor), "--target_dir", str(merged)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (tmp_path / "bf16").mkdir()
    fmt.convert(actor, tmp_path / "bf16", "bfloat16", lambda done, total: None)
    theirs, ours = tensors(merged), tensors(tmp_path / "bf16")
    assert set(theirs) == set(ours) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.e2e
def test_hsdp_shards_and_inconsistent_sets(
    trained_checkpoint: Path, verl_run: Path, tmp_path: Path
) -> None:
    """Under HSDP (`[Replicate(), Shard(0)]` over a 2x2 mesh) one replica's ranks make the
    model. A set mixing ranks of two saves is refused, never read as a partial model."""
    import torch

    hf = hf_copy(trained_checkpoint, tmp_path / "hf")
    actor = verl_save(hf, tmp_path / "hsdp", 300, 4, "--replicas", "2")
    fmt = detect(LocalFiles(actor).files)
    assert fmt is not None
    (tmp_path / "out").mkdir()
    fmt.convert(actor, tmp_path / "out", None, lambda done, total: None)
    saved, ours = tensors(hf), tensors(tmp_path / "out")
    assert set(ours) == set(saved) and all(torch.equal(ours[k], saved[k]) for k in saved)

    plain = tmp_path / "fsdp" / "actor"
    shutil.copytree(verl_run / "verl" / "grpo" / "global_step_300" / "actor", plain)
    shutil.copyfile(actor / "model_world_size_4_rank_1.pt", plain / "model_world_size_2_rank_1.pt")
    with pytest.raises(NativeFormatError, match="placed otherwise on rank 1"):
        fmt.convert(plain, tmp_path / "out", None, lambda done, total: None)


@pytest.mark.e2e
def test_a_worker_killed_mid_conversion_leaves_nothing_half_written_and_the_next_converts(
    tmp_path: Path, addition_tasks: Path
) -> None:
    """`watcher status` shows the job converting, with the MiB written; the worker is killed -9
    there (the OOM killer, a preemption): nothing it half wrote is read, the next attempt
    converts again and files the step once, and no copy is left behind."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ckpt_watcher.demo.tiny import build_tokenizer
    from ckpt_watcher.scratch import CONVERTED, PREFIX

    # a model big enough (130 MiB of fp32 shards) that a slowed conversion lasts seconds
    hf = tmp_path / "hf"
    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=64,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(hf)
    tok.save_pretrained(hf)
    watch = tmp_path / "ckpts"
    verl_save(hf, watch / "big", 7, 2)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    cfg = write_config(
        tmp_path / "w.yaml", base_config(tmp_path, watch, addition_tasks, limit=4, batch_size=4)
    )
    log = tmp_path / "daemon.log"
    env = {**os.environ, "TMPDIR": str(scratch)}

    def converting() -> dict[str, Any] | None:
        for path in (tmp_path / "state").glob("jobs/*/attempt-1/progress.json"):
            try:
                p = dict(json.loads(path.read_text()))
            except ValueError:
                return None
            assert p["task"] == "converting" and p["done"] < p["total"], p
            return p
        return None

    with watcher_run(cfg, log, env=env) as daemon:
        job = wait_for(
            lambda: running_job(tmp_path / "state"), 120, "a worker", daemon, log, every=0.02
        )
        assert job.pid is not None
        throttle = Throttle(job.pid, share=0.1)
        try:
            wait_for(converting, 120, "the conversion part way", daemon, log, every=0.02)
        finally:
            throttle.stop()  # frozen part way
        code, status = status_json(cfg)
        assert code == 0 and status is not None
        progress = status["running"][0]["progress"]
        assert progress["task"] == "converting" and progress["unit"] == "MiB", progress
        assert 0 < progress["done"] < progress["total"] >= 100, progress
        half = [p for p in scratch.rglob("*.partial")]
        assert half, sorted(scratch.rglob("*"))  # a safetensors file being written, unnamed
        os.killpg(job.pid, signal.SIGKILL)
        lines = wait_for(
            lambda: read_ledger(tmp_path / "ledgers", "big") or None, 300, "a line", daemon, log
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    (line,) = lines
    assert line["status"] == "ok" and line["attempt"] == 2 and line["source_format"] == "verl-fsdp"
    # the killed worker's scratch and half-made copy are gone; so is the second's finished one
    assert not [p for p in scratch.iterdir() if p.name.startswith(PREFIX)], list(scratch.iterdir())
    assert not [p for p in (scratch / CONVERTED).iterdir() if p.is_dir()]


# --- DeepSpeed's own files (OpenRLHF's default) ----------------------------------------------


def deepspeed_command(model: Path, out: Path, step: int, stage: int) -> list[str]:
    """DeepSpeed's own save of `model` (ZeRO `stage`, bf16, 2 ranks) as OpenRLHF lays it out:
    `out/_actor/global_step<step>`."""
    return [sys.executable, str(DS_WRITER), str(model), str(out), str(step), str(stage), "2"]


def test_deepspeed_states_wait_for_a_base_model_model_parallel_ones_are_refused_and_a_lora_copy_wins(
    tmp_path: Path,
) -> None:
    whole = b"x" * 100 + b"PK\x05\x06" + bytes(18)
    tag = tmp_path / "ckpt" / "_actor" / "global_step5"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(whole)
    (tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(whole)
    said = judge(LocalFiles(tag), now=0.0, stable_seconds=0, settle_seconds=0)
    assert said.state == "incomplete" and "set the source's base_model" in said.reason, said
    # found as the step of the run above `_actor` (OpenRLHF's layout), not a run `_actor`
    (found,) = LocalSource(tmp_path).scan()
    assert found.location == str(tag) and found.ident is not None
    assert (found.ident.run, found.ident.step) == ("ckpt", 5), found.ident
    assert needed_files(LocalFiles(tag).files) == ["mp_rank_00_model_states.pt"]  # no optimizer
    (tag / "mp_rank_01_model_states.pt").write_bytes(whole)
    said = judge(LocalFiles(tag), now=0.0, stable_seconds=0, settle_seconds=0)
    assert said.state == "invalid" and "model-parallel" in said.reason, said
    # with LoRA under ZeRO-3 and --ckpt.save_hf, OpenRLHF's copy is the adapter alone, its
    # tensors in adapter_model.bin: that copy is the step (an adapter, merged into its base)
    copy = tmp_path / "ckpt" / "global_step5_hf"
    copy.mkdir()
    (copy / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (copy / "adapter_model.bin").write_bytes(whole)
    (copy / "tokenizer.json").write_text("{}")
    (found,) = LocalSource(tmp_path).scan()
    assert found.location == str(copy) and found.ident is not None
    assert (found.ident.run, found.ident.step) == ("ckpt", 5), found.ident
    said = judge(LocalFiles(copy), now=0.0, stable_seconds=0, settle_seconds=0)
    assert said.ready and "LoRA/PEFT adapter" in said.reason, said


# --- NeMo-RL's DTensor policy (torch's own Hugging Face storage writer) --------------------


def test_a_nemo_rl_steps_model_is_its_policys_shards_or_its_consolidated_copy(
    tmp_path: Path,
) -> None:
    def holds(*paths: str) -> Any:
        every = {p.rsplit("/", i)[0] for p in paths for i in range(p.count("/") + 1)}
        return lambda p: p in every

    shards = "policy/weights/model/shard-00001-model-00001-of-00001.safetensors"
    assert model_folder("step_40", holds(shards)) == "policy"
    both = holds(shards, "policy/weights/model/consolidated/config.json")
    assert model_folder("step_40", both) == "policy/weights/model/consolidated"
    assert model_folder("step_40", holds("config.json", "model.safetensors")) == ""  # prime-rl's
    # a step being written (`tmp_step_N`, renamed once whole) is not looked into
    (tmp_path / "run" / "tmp_step_50" / "policy" / "weights" / "model" / ".hf_metadata").mkdir(
        parents=True
    )
    (
        tmp_path
        / "run"
        / "tmp_step_50"
        / "policy"
        / "weights"
        / "model"
        / ".hf_metadata"
        / "config.json"
    ).write_text("{}")
    assert LocalSource(tmp_path).scan() == []


# --- formats only the trainer's converter reads: the source's convert command -----------------


def dcp_save(state_dict: dict[str, Any], folder: Path) -> None:
    """torch's own DCP save, in this process (one writer, no process group)."""
    import torch.distributed.checkpoint as dist_cp

    dist_cp.save(state_dict, storage_writer=dist_cp.FileSystemWriter(str(folder)), no_dist=True)


def test_a_dcp_of_a_models_hugging_face_names_is_read_and_one_of_other_names_needs_a_converter(
    tmp_path: Path,
) -> None:
    """accelerate's layout (`{"model": state_dict}` in `pytorch_model_fsdp_0/`, the config and
    tokenizer beside it) converts to the very tensors saved, with no convert command; torchtitan's
    (its own names at the top level) is invalid, naming the converters, until the source sets
    one; a data file cut short waits, then is invalid; a `.metadata` that would run code is
    refused without running it."""
    import torch

    weights = {
        "model.embed_tokens.weight": torch.randn(18, 8),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8).bfloat16(),
        "model.norm.weight": torch.ones(8),
    }
    ckpt = tmp_path / "sft" / "checkpoint-5"
    ckpt.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "trainer_state.json"):
        (ckpt / name).write_text("{}")
    dcp_save({"model": weights}, ckpt / "pytorch_model_fsdp_0")
    fmt = detect(LocalFiles(ckpt).files)
    assert fmt is not None and fmt.name == "dcp"
    said = judge(LocalFiles(ckpt), now=0.0, stable_seconds=0, settle_seconds=0)
    assert said.ready and "Hugging Face names under `model.`" in said.reason, said
    (tmp_path / "out").mkdir()
    fmt.convert(ckpt, tmp_path / "out", None, lambda done, total: None)
    got = tensors(tmp_path / "out")
    assert set(got) == set(weights) and all(torch.equal(got[k], weights[k]) for k in weights)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
        ckpt / "tokenizer.json"
    ).read_bytes()

    data = next((ckpt / "pytorch_model_fsdp_0").glob("*.distcp"))
    whole = data.read_bytes()
    data.write_bytes(whole[: len(whole) // 2])
    said = judge(LocalFiles(ckpt), now=0.0, stable_seconds=5, settle_seconds=0)
    assert said.state == "incomplete" and "places pieces up to byte" in said.reason, said
    mark = said.write_mark
    said = judge(
        LocalFiles(ckpt), now=9.0, stable_seconds=5, settle_seconds=0, previous_mark=mark,
        unchanged_since=0.0,
    )  # fmt: skip
    assert said.state == "invalid", said

    titan = tmp_path / "titan" / "step-5"
    dcp_save({f"layers.{k}": v for k, v in weights.items()}, titan)
    said = judge(LocalFiles(titan), now=0.0, stable_seconds=0, settle_seconds=0)
    assert said.state == "invalid" and "accelerate merge-weights" in said.reason, said
    assert "no model state dict under `model.`" in said.reason, said
    said = judge(
        LocalFiles(titan), now=0.0, stable_seconds=0, settle_seconds=0, convert=["x", "{output}"]
    )
    assert said.ready and "by the source's convert command" in said.reason, said

    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {ran}",))

    (titan / ".metadata").write_bytes(pickle.dumps(Payload(), protocol=2))
    said = judge(LocalFiles(titan), now=0.0, stable_seconds=0, settle_seconds=0)
    assert said.state == "invalid" and "not loaded" in said.reason and not ran.exists(), said


# --- every format in one daemon, as a deployment runs them ------------------------------------


@pytest.mark.e2e
def test_every_trainers_format_local_and_on_s3_in_one_daemon_scores_as_its_hugging_face_copy(
    verl_run: Path,
    trained_checkpoint: Path,
    tmp_path: Path,
    addition_tasks: Path,
    s3_endpoint: str,
    bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One daemon over three folders and an S3 prefix, each step as its trainer writes it by
    default: verl's shards (step 100 in a folder; step 300 on S3, uploaded with its optimizer
    states), NeMo-RL's slices, DeepSpeed's ZeRO-2 and ZeRO-3 states (OpenRLHF's layout, with the
    source's base_model), accelerate's FSDP2 DCP (read as it is; step 100's through the
    source's convert command: accelerate's own merge-weights), and step 300's weights as a
    Hugging Face folder. Every
    native step is converted and filed with its format; each of step 300 scores as the Hugging
    Face copy; the trainers' files are untouched; only the model's shards are staged; ZeRO-3's
    tensors are those of DeepSpeed's own zero_to_fp32.py."""
    import torch
    from safetensors.torch import load_file, save_file

    from ckpt_watcher.s3client import make_client
    from ckpt_watcher.scratch import shared_root

    logs_before = set(shared_root().glob("*convert.log"))  # an older version's, on this machine
    hf = verl_run / "hf" / "ref_step300"
    base = hf_copy(trained_checkpoint, tmp_path / "base")
    watch, ds, trl = tmp_path / "ckpts", tmp_path / "ds", tmp_path / "trl"
    shutil.copytree(
        verl_run / "verl" / "grpo" / "global_step_100", watch / "grpo" / "global_step_100"
    )
    shutil.copytree(hf, watch / "ref_step300")
    bf16 = hf_copy(trained_checkpoint, watch / "bf16_step300")  # what bf16 keeps, in fp32
    weights = load_file(bf16 / "model.safetensors")
    save_file({k: v.bfloat16().float() for k, v in weights.items()}, bf16 / "model.safetensors")
    saved(
        [sys.executable, str(NEMO_WRITER), str(hf), str(watch / "nemo"), "300", "2"],
        [sys.executable, str(ACCELERATE_WRITER), str(hf), str(trl / "sft"), "300", "2"],
        [sys.executable, str(ACCELERATE_WRITER), str(verl_run / "hf" / "ref_step100")]
        + [str(tmp_path / "trl_cmd" / "sft_cmd"), "100", "2"],
        deepspeed_command(base, ds / "oprl", 300, 2),
        deepspeed_command(base, tmp_path / "z3", 301, 3),
    )
    zero3 = ds / "oprl" / "_actor" / "global_step301"
    shutil.copytree(tmp_path / "z3" / "_actor" / zero3.name, zero3)  # one save per folder
    client = make_client(s3_endpoint)
    step300 = verl_run / "verl" / "grpo" / "global_step_300"
    for f in sorted(step300.rglob("*")):
        if f.is_file():
            key = f"remote/grpo_s3/global_step_300/{f.relative_to(step300).as_posix()}"
            client.upload_file(str(f), bucket, key)
    before = {root: listing(root) for root in (watch / "grpo", watch / "nemo", ds, trl)}

    cfg = base_config(tmp_path, watch, addition_tasks)
    accelerate = str(Path(sys.executable).parent / "accelerate")
    merge = [accelerate, "merge-weights", "{input}/pytorch_model_fsdp_0", "{output}"]
    cache = tmp_path / "cache"
    cfg["sources"] += [
        {"kind": "local", "path": str(ds), "poll_seconds": 1, "base_model": str(base)},
        {"kind": "local", "path": str(trl), "poll_seconds": 1},
        {"kind": "local", "path": str(tmp_path / "trl_cmd"), "poll_seconds": 1, "convert": merge},
        s3_source(f"s3://{bucket}/remote/", cache, keep_staged=True),
    ]
    ledgers = tmp_path / "ledgers"
    watcher_once(write_config(tmp_path / "w.yaml", cfg), ledgers, "grpo")
    (ref,) = read_ledger(ledgers, "ref")
    (ref_bf16,) = read_ledger(ledgers, "bf16")
    assert "source_format" not in ref
    (local,) = read_ledger(ledgers, "grpo")
    lines = {
        "grpo_s3": ("verl-fsdp", ref),
        "nemo": ("nemo-rl", ref),
        "sft": ("dcp", ref),
        "oprl": ("deepspeed", ref_bf16),
    }
    for run, (source_format, expected) in lines.items():
        for line in read_ledger(ledgers, run):
            assert line["status"] == "ok" and line["source_format"] == source_format, line
            assert line["convert_seconds"] > 0 and "reused_from" not in line, line
            assert line["metrics"] == expected["metrics"], (line, expected)  # the same weights
    assert sorted(ln["step"] for ln in read_ledger(ledgers, "oprl")) == [300, 301]
    assert local["source_format"] == "verl-fsdp" and local["status"] == "ok", local
    assert local["metrics"] != ref["metrics"]  # step 100: another checkpoint, its own
    (cmd,) = read_ledger(ledgers, "sft_cmd")  # step 100's weights, through accelerate's converter
    assert cmd["source_format"] == "dcp" and cmd["metrics"] == local["metrics"], cmd
    assert cmd["convert_seconds"] > 0 and "reused_from" not in cmd, cmd
    assert {root: listing(root) for root in before} == before  # not one byte or time
    staged = {p.name for p in cache.rglob("*") if p.is_file() and not p.name.startswith(".")}
    assert staged == {
        "fsdp_config.json",
        *HF_FILES,
        "model_world_size_2_rank_0.pt",
        "model_world_size_2_rank_1.pt",
    }, staged  # never the optimizer's or the RNG's
    # ZeRO-3: what DeepSpeed's own script reassembles, tensor for tensor
    fmt = detect(LocalFiles(zero3).files)
    assert fmt is not None and fmt.name == "deepspeed"
    (tmp_path / "ours").mkdir()
    fmt.convert(zero3, tmp_path / "ours", None, lambda done, total: None, base)
    r = subprocess.run(
        [sys.executable, str(zero3.parent / "zero_to_fp32.py"), str(zero3.parent)]
        + [str(tmp_path / "theirs"), "--tag", zero3.name, "--safe_serialization"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ours, theirs = tensors(tmp_path / "ours"), tensors(tmp_path / "theirs")
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # the convert command's output went to the worker's log: nothing left beside the copies
    assert set(shared_root().glob("*convert.log")) <= logs_before, sorted(shared_root().iterdir())

    # the same real saves, not finished or not ours to read: see the helpers below
    nemo_with_a_rank_missing(watch / "nemo" / "step_300", tmp_path / "nemo_cut")
    zero3_judged_and_converted_by_what_it_holds(zero3, base, tmp_path / "z3_more", monkeypatch)


def nemo_with_a_rank_missing(step: Path, copies: Path) -> None:
    """NeMo-RL's 2 ranks, one of them still uploading: `-of-N` counts a rank's own files, so
    nothing in the names says a rank is missing. The last rank missing leaves every tensor short
    of rows (the embeddings short of the config's vocab_size); the first missing leaves a gap.
    Incomplete while files may still come, invalid once quiet; never converted into a smaller
    model."""
    for gone, why in (("00002", "of the config's"), ("00001", "rank 1's shard files not there")):
        cut = copies / gone / "step_300"
        shutil.copytree(step, cut)
        (shard,) = (cut / "policy" / "weights" / "model").glob(f"shard-{gone}-*.safetensors")
        shard.unlink()
        policy = LocalFiles(cut / "policy")
        said = judge(policy, now=0.0, stable_seconds=30, settle_seconds=0)
        assert said.state == "incomplete" and why in said.reason, said
        quiet = judge(
            policy, now=31.0, stable_seconds=30, settle_seconds=0, unchanged_since=0.0,
            previous_mark=said.write_mark,
        )  # fmt: skip
        assert quiet.state == "invalid", quiet
        fmt = detect(policy.files)
        assert fmt is not None and fmt.name == "nemo-rl"
        (copies / gone / "out").mkdir()
        with pytest.raises(NativeFormatError, match="rows|not as"):
            fmt.convert(cut / "policy", copies / gone / "out", None, lambda d, t: None)
        assert not list((copies / gone / "out").glob("*.safetensors"))


def zero3_judged_and_converted_by_what_it_holds(
    zero3: Path, base: Path, work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed ZeRO-3 (2 ranks): its completeness reads rank 0's directory and pickle, not
    the file; with a second model-parallel rank it goes to the convert command (never
    converted from mp_rank_00 alone); its room is what it writes (4 bytes a parameter here),
    not the optimizer states it reads (12 and more)."""
    from ckpt_watcher.worker.convert import converted

    class Counted(LocalFiles):
        read_bytes = 0

        def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
            got = super().read(name, start, length)
            Counted.read_bytes += len(got)
            return got

    view = Counted(zero3)
    said = judge(view, now=0.0, stable_seconds=0, settle_seconds=0, base_model=base)
    assert said.ready and "2 of 2 ranks" in said.reason, said
    rank0 = view.files["zero_pp_rank_0_mp_rank_00_model_states.pt"]
    assert 0 < Counted.read_bytes < rank0, (Counted.read_bytes, rank0)

    mp = work / "mp" / "global_step301"
    shutil.copytree(zero3, mp)
    for f in sorted(mp.glob("*mp_rank_00*")):
        shutil.copyfile(f, f.with_name(f.name.replace("mp_rank_00", "mp_rank_01")))
    fmt = detect(LocalFiles(mp).files)
    assert fmt is not None
    said = judge(LocalFiles(mp), now=0.0, stable_seconds=0, settle_seconds=0, base_model=base)
    assert said.state == "invalid" and "model-parallel" in said.reason, said
    (work / "refused").mkdir()
    with pytest.raises(NativeFormatError, match="model-parallel"):
        fmt.convert(mp, work / "refused", None, lambda d, t: None, base)
    copy = [sys.executable, "-c", "import shutil, sys; shutil.copytree(*sys.argv[1:3], "
            "dirs_exist_ok=True)", "{base_model}", "{output}"]  # fmt: skip
    (work / "by_command").mkdir()
    fmt.convert(mp, work / "by_command", None, lambda d, t: None, base, copy)
    assert tensors(work / "by_command").keys() == tensors(base).keys()  # the command's output

    written = sum(t.nbytes for t in tensors(work.parent / "ours").values())
    read = sum(f.stat().st_size for f in zero3.glob("*_optim_states.pt"))
    assert read > 2 * written, (read, written)
    usage = shutil.disk_usage(work)
    for free, fits in ((1.5 * written, True), (0.5 * written, False)):
        with monkeypatch.context() as m:
            m.setattr(shutil, "disk_usage", lambda _p, f=free: usage._replace(free=int(f)))
            if fits:
                done = converted(zero3, {}, lambda d, t: None, base=str(base))
                assert done is not None and tensors(done.path).keys() == tensors(base).keys()
                done.release()
            else:
                with pytest.raises(OSError, match="the converted copy needs about"):
                    converted(zero3, {}, lambda d, t: None, base=str(base))


def test_a_crafted_pickle_nested_deep_compressed_or_overlapping_is_refused_not_a_crash(
    tmp_path: Path,
) -> None:
    """What a completeness check reads in the daemon: a key nested a million tuples deep (a
    hash that recursed in C and killed the process), a compressed pickle (a decompression
    bomb), a tensor whose elements overlap (a few bytes read as any size): each refused."""
    from ckpt_watcher.formats.torchzip import read_index_at

    path = tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt"

    def zip_with(pkl: bytes, how: int = zipfile.ZIP_STORED) -> None:
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
            zf.writestr(zipfile.ZipInfo("archive/data.pkl"), pkl, compress_type=how)
            zf.writestr("archive/byteorder", "little")

    def read() -> Any:
        data = path.read_bytes()
        return read_index_at(path.name, len(data), lambda at, n: data[at : at + n])

    zip_with(b"\x80\x02}" + b")" + b"\x85" * 1_000_000 + b"Ns.")  # {((((...)))): None}
    with pytest.raises(NativeFormatError, match="nested past"):
        read()
    zip_with(pickle.dumps({"dp_world_size": 2, "pad": "x" * 100_000}), zipfile.ZIP_DEFLATED)
    with pytest.raises(NativeFormatError, match="compressed"):
        read()
    crafted_pt(path, (8192, 8192))  # stride (1, 1): 64 Mi elements over a storage of 4
    with pytest.raises(NativeFormatError, match="not a tensor a state dict holds"):
        read_index(path)


def nemo_step(root: Path, slices: dict[int, dict[str, tuple[list[int], list[int]]]],
              config: dict[str, Any]) -> LocalFiles:  # fmt: skip
    """A NeMo-RL `step_N/policy` as torch's writer lays it out: per rank, its slices (key ->
    (offsets, shape)) in a safetensors file with DCP_SHARDING_INFO; the config beside."""
    import torch
    from safetensors.torch import save_file

    model = root / "step_5" / "policy" / "weights" / "model"
    (model / ".hf_metadata").mkdir(parents=True)
    (model / ".hf_metadata" / "config.json").write_text(json.dumps(config))
    (root / "step_5" / "policy" / "tokenizer").mkdir()
    (root / "step_5" / "policy" / "tokenizer" / "tokenizer.json").write_text("{}")
    for rank, mine in slices.items():
        info = {k: {"saved_offsets": o} for k, (o, _) in mine.items()}
        save_file(
            {k: torch.zeros(shape) for k, (_, shape) in mine.items()},
            model / f"shard-{rank:05d}-model-00001-of-00001.safetensors",
            metadata={"DCP_SHARDING_INFO": json.dumps(info)},
        )
    return LocalFiles(root / "step_5" / "policy")


def test_nemo_rl_slices_that_overlap_lack_a_vocabulary_or_misnumber_are_judged_never_read_as_whole(
    tmp_path: Path,
) -> None:
    emb = "model.embed_tokens.weight"
    whole = {1: {emb: ([0, 0], [4, 2])}, 2: {emb: ([4, 0], [4, 2])}}
    cases = {
        "whole": (whole, {"vocab_size": 8}, "ready"),
        "vocab of its language model": (whole, {"llm_config": {"vocab_size": 8}}, "ready"),
        "short of the vocab": ({1: whole[1]}, {"vocab_size": 8}, "incomplete"),
        "no vocab to hold it to": (whole, {"hidden_size": 2}, "invalid"),
        "overlap": ({1: whole[1], 2: {emb: ([2, 0], [6, 2])}}, {"vocab_size": 8}, "invalid"),
        "a scalar in two": ({1: {emb: ([], [])}, 2: {emb: ([], [])}}, {"vocab_size": 8}, "invalid"),
    }
    for i, (name, (slices, config, state)) in enumerate(cases.items()):
        files = nemo_step(tmp_path / str(i), slices, config)
        said = judge(files, now=0.0, stable_seconds=30, settle_seconds=0)
        assert said.state == state, (name, said)
    files = nemo_step(tmp_path / "x", whole, {"vocab_size": 8})
    shard = next(n for n in files.files if n.startswith("weights/model/shard-00002"))
    (files.root / shard).rename(files.root / shard.replace("00001-of-00001", "00003-of-00001"))
    said = judge(LocalFiles(files.root), now=0.0, stable_seconds=30, settle_seconds=0)
    assert said.state == "invalid" and "number past 1" in said.reason, said


def test_a_deepspeed_world_size_past_its_files_is_judged_before_listing_it(tmp_path: Path) -> None:
    tag = tmp_path / "run" / "global_step5"
    tag.mkdir(parents=True)
    (tmp_path / "config.json").write_text("{}")  # the base model's
    for world, state in ((10**12, "invalid"), (4, "incomplete")):
        with zipfile.ZipFile(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt", "w") as zf:
            zf.writestr("archive/data.pkl", pickle.dumps({"dp_world_size": world}, protocol=2))
            zf.writestr("archive/byteorder", "little")
        said = judge(LocalFiles(tag), now=0.0, stable_seconds=30, settle_seconds=0,
                     base_model=tmp_path)  # fmt: skip
        assert said.state == state, (world, said)
