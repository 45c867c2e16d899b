"""Steps that change nothing (checkpoints/noop.py): LoRA adapters whose updates are all zero
(lora_alpha 0, B as initialized) and full checkpoints whose weights are their base's. Real peft
adapters of a tiny Llama; what changes the model (one trained module, modules_to_save, DoRA's
magnitudes, a per-module alpha) is never flagged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_watcher.checkpoints.noop import adapter_no_op, same_weights
from ckpt_watcher.demo.tiny import build_model


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("base")
    build_model(vocab_size=40, seed=0).save_pretrained(out, safe_serialization=True)
    return out


def lora(base: Path, out: Path, trained: tuple[str, ...] = (), **config: Any) -> Path:
    """peft's save of a LoRA adapter of `base`; the B matrices of the modules whose names end
    in one of `trained` get noise (peft starts every B at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(0)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]} | config
    peft = get_peft_model(model, LoraConfig(**settings))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name and any(f"{t}.lora_B" in name for t in trained):
                p.copy_(torch.randn(p.shape) * 0.1)
    peft.save_pretrained(out)
    return out


def test_an_adapter_that_changes_nothing_is_told_with_its_reason(
    base: Path, tmp_path: Path
) -> None:
    untrained = lora(base, tmp_path / "untrained")
    assert "every lora_B matrix" in str(adapter_no_op(untrained))
    alpha0 = lora(base, tmp_path / "alpha0", trained=("q_proj", "v_proj"), lora_alpha=0)
    assert "lora_alpha is 0" in str(adapter_no_op(alpha0))
    # trained modules whose own alpha is 0, the others untrained: still nothing
    mixed = lora(base, tmp_path / "mixed", trained=("q_proj",), alpha_pattern={"q_proj": 0})
    assert "zero A, a zero B or a zero scale" in str(adapter_no_op(mixed))
    # the same adapter as older peft saved it (.bin)
    old = tmp_path / "old"
    shutil.copytree(untrained, old)
    tensors = load_file(old / "adapter_model.safetensors")
    (old / "adapter_model.safetensors").unlink()
    torch.save(tensors, old / "adapter_model.bin")
    assert "every lora_B matrix" in str(adapter_no_op(old))


def test_an_adapter_that_changes_anything_is_not_flagged(base: Path, tmp_path: Path) -> None:
    assert adapter_no_op(lora(base, tmp_path / "one", trained=("v_proj",))) is None
    # alpha 0 for v only: q's trained update still counts
    assert (
        adapter_no_op(lora(base, tmp_path / "q", trained=("q_proj",), alpha_pattern={"v_proj": 0}))
        is None
    )
    # zero LoRA updates, but modules saved whole (lm_head), or DoRA's magnitudes: they change it
    assert adapter_no_op(lora(base, tmp_path / "mts", modules_to_save=["lm_head"])) is None
    assert adapter_no_op(lora(base, tmp_path / "dora", use_dora=True)) is None
    # not LoRA: not judged
    ia3 = lora(base, tmp_path / "ia3")
    config = json.loads((ia3 / "adapter_config.json").read_text())
    (ia3 / "adapter_config.json").write_text(json.dumps(config | {"peft_type": "IA3"}))
    assert adapter_no_op(ia3) is None


def test_a_full_checkpoint_equal_to_its_base_byte_for_byte_is_told(
    base: Path, tmp_path: Path
) -> None:
    weights = load_file(base / "model.safetensors")
    # the same tensors sharded otherwise (two files, other order): the same weights
    copy = tmp_path / "copy"
    shutil.copytree(base, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    names = sorted(weights, reverse=True)
    save_file({n: weights[n] for n in names[:3]}, copy / "model-00001-of-00002.safetensors")
    save_file({n: weights[n] for n in names[3:]}, copy / "model-00002-of-00002.safetensors")
    assert same_weights(copy, base) and same_weights(base, copy)
    # the naming bug, fixed: an index that names the one file by another name, both names there
    fixed = tmp_path / "fixed"
    shutil.copytree(base, fixed)
    shard = "model-00001-of-00001.safetensors"
    (fixed / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(weights, shard)})
    )
    (fixed / shard).hardlink_to(fixed / "model.safetensors")
    assert same_weights(fixed, base)
    # one element of one tensor changed, one tensor cast, one tensor missing: not the base
    for change in ("element", "dtype", "missing"):
        other = tmp_path / change
        shutil.copytree(base, other, ignore=shutil.ignore_patterns("*.safetensors"))
        changed = dict(weights)
        name = names[-1]
        if change == "element":
            changed[name] = changed[name].clone()
            changed[name].view(-1)[-1] += 1e-6
        elif change == "dtype":
            changed[name] = changed[name].double()
        else:
            del changed[name]
        save_file(changed, other / "model.safetensors")
        assert not same_weights(other, base), change
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not same_weights(empty, base)


def test_what_changes_the_model_beside_the_lora_weights_is_never_flagged(
    base: Path, tmp_path: Path
) -> None:
    """Seen by an adversarial review, each with the merged model's logits: an alpha_pattern key
    written for the model's own module names (peft's), a NaN where the scale is 0 (0 x NaN is
    NaN: a diverged run), a chat template of the adapter's own, a config that differs."""
    pattern = {r"^model\.layers\.0\.self_attn\.q_proj": 16}
    q = lora(base, tmp_path / "q", trained=("q_proj",), lora_alpha=0, alpha_pattern=pattern)
    assert adapter_no_op(q, base) is None
    nan = lora(base, tmp_path / "nan", lora_alpha=0)
    tensors = load_file(nan / "adapter_model.safetensors")
    first = next(k for k in tensors if "lora_B" in k)
    tensors[first][0, 0] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")
    assert adapter_no_op(nan, base) is None
    templated = lora(base, tmp_path / "templated")
    (templated / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert adapter_no_op(templated, base) is None
    shutil.copy(templated / "chat_template.jinja", tmp_path / "with_template.jinja")
    with_template = tmp_path / "base_with_template"
    shutil.copytree(base, with_template)
    shutil.copy(templated / "chat_template.jinja", with_template / "chat_template.jinja")
    assert "every lora_B" in str(adapter_no_op(templated, with_template))  # the base's own
    # a full copy whose config differs: not its base, though every tensor is
    other = tmp_path / "rope"
    shutil.copytree(base, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"rope_theta": 10.0}))
    assert not same_weights(other, base)
    config.pop("transformers_version", None)  # who saved it is not what it is
    (other / "config.json").write_text(json.dumps(config))
    assert same_weights(other, base)


def test_a_flagged_step_leaves_results_alerts_and_the_baseline_alone(tmp_path: Path) -> None:
    from ckpt_watcher.ledger import Subject, is_result, reused_line
    from ckpt_watcher.report.table import metric_rows
    from ckpt_watcher.sinks.alerts import RegressionWatch

    def line(step: int, value: float, **more: Any) -> dict[str, Any]:
        return {"run": "r", "run_path": "r", "step": step, "label": f"s{step}",
                "fingerprint": f"f{step}", "task": "t", "num_fewshot": 0, "status": "ok",
                "metrics": {"acc,none": value, "acc_stderr,none": 0.001}} | more  # fmt: skip

    # a step rewritten into its base model: the regression its old numbers made is gone
    watch = RegressionWatch(2.0, [], "base")
    watch.load([line(10, 0.5)])
    assert watch.observe(line(20, 0.1))  # a drop, reported
    assert watch.standing([line(10, 0.5), line(20, 0.1)])
    flagged = line(20, 0.0, fingerprint="f20b", no_op="lora_alpha is 0")
    assert watch.observe(flagged) == [] and not is_result(flagged)
    assert watch.standing([line(10, 0.5), line(20, 0.1), flagged]) == []
    # a failed attempt, then the flagged result of the same version: NO-OP, not FAILED
    failed = line(30, 0.0, status="failed", metrics={})
    table, _ = metric_rows([line(10, 0.5), failed, line(30, 0.0, no_op="zero B")])
    assert table.rows[-1][0] == 30 and "NO-OP" in table.rows[-1], table.rows

    # reused lines: the baseline never takes a flag; a step with the baseline's content does
    def subject(run: str) -> Subject:
        return Subject("/x", run, run, 5, "s5", "f")

    base_line = line(0, 0.3, run="baseline", run_path="baseline", checkpoint="/models/base")
    copied = reused_line(base_line, subject("r"), tmp_path)
    assert "its content is the baseline's (/models/base)" in copied["no_op"]
    back = reused_line(line(5, 0.3, no_op="zero B", checkpoint="/c"), subject("baseline"), tmp_path)
    assert "no_op" not in back
