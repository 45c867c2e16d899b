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
    copy.mkdir()
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
        other.mkdir()
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
