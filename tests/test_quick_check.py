"""The quick check of swaps (evaluators/keeper.py, weights.py) on the hf backend, in process: a
checkpoint with its hidden dimension permuted computes what it computed; the check holds for a
right swap and leaves the cold load's weights; a swap that leaves one weight out fails it; a
checkpoint with tensor names it does not know is not permuted (its swaps are checked against a
fresh load); probes that part at a near tie of two tokens agree, any other parting does not."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ckpt_watcher.demo.tiny import build_model, build_tokenizer, save_checkpoint
from ckpt_watcher.evaluators import weights
from ckpt_watcher.evaluators.keeper import (
    EngineKeeper,
    compare,
    engine_reach,
    fill_check,
    quick_check,
)
from ckpt_watcher.jobfolder import EvalRequest

from .conftest import write_safetensors


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("quick") / "r_step1"
    tok = build_tokenizer(False)
    save_checkpoint(build_model(len(tok), seed=3), tok, out, naming_bug=False)
    return out


def _request(checkpoint: Path) -> EvalRequest:
    return EvalRequest(
        checkpoint=str(checkpoint),
        backend="hf",
        tasks=[],
        seed=42,
        gen_kwargs={},
        max_gen_toks=None,
        model_args={"dtype": "float32", "max_model_len": 64},
        include_path=None,
        batch_size=None,
        limit=None,
        results_dir=str(checkpoint.parent),
        device="cpu",
    )


def test_the_permuted_checkpoint_computes_the_same_function(checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    hidden = json.loads((checkpoint / "config.json").read_text())["hidden_size"]
    assert weights.permutable(checkpoint, hidden)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 11, 4, 7, 3]])
    with torch.no_grad():
        before = model(ids).logits
        state = dict(weights.permuted(checkpoint, hidden))
        changed = [k for k, v in model.state_dict().items() if k in state and v.ne(state[k]).any()]
        model.load_state_dict(state, strict=False)
        after = model(ids).logits
    # every matrix moved (the norms of an untrained model are all ones: the same permuted)
    assert {k for k, v in state.items() if v.ndim == 2} <= set(changed), changed
    assert torch.allclose(before, after, atol=1e-5), (before - after).abs().max()


def test_a_right_swap_passes_and_leaves_the_cold_weights_a_swap_missing_a_weight_fails(
    checkpoint: Path,
) -> None:
    keeper = EngineKeeper()
    engine = keeper.acquire(_request(checkpoint))
    assert engine.kind == "cold"
    ((event, check),) = [(e["event"], e["check"]) for e in keeper.events]
    assert (event, check) == ("engine.verify_ok", "quick")
    assert keeper.checked == {keeper.signature}
    hidden = json.loads((checkpoint / "config.json").read_text())["hidden_size"]
    reach = engine_reach(engine.lm, "hf", str(checkpoint), hidden)
    loaded = reach.digest()
    assert quick_check(reach, "float32")[:2] == (None, True)
    assert reach.digest() == loaded  # the cold load's weights, bit for bit

    def permuted_without_the_norm() -> None:
        state = dict(weights.permuted(checkpoint, hidden))
        del state["model.norm.weight"]
        engine.lm.model.load_state_dict(state, strict=False)

    why, restored, _ = quick_check(
        replace(reach, swap_permuted=permuted_without_the_norm), "float32"
    )
    assert why is not None and "with the hidden dimension permuted" in why, why
    assert restored and reach.digest() == loaded  # the swap back made it the cold load again
    # a swap back that leaves a weight out: the check that the cold load's weights are back
    reach.scramble()
    reach.swap()
    bare = replace(reach, swap=lambda: None)
    why, restored, _ = quick_check(bare, "float32")
    assert "not as loaded after the swap back" in str(why) and not restored
    keeper.drop()


def test_the_first_weights_in_a_placeholder_engine_are_proven_and_any_left_out_is_caught(
    checkpoint: Path, tmp_path: Path
) -> None:
    """An engine started on the step's config and tokenizer alone (`prepare`) holds NaN in every
    weight until its first checkpoint is swapped in; that swap is served (`early`) with the cold
    load's very weights once `fill_check` proved it. A swap that leaves a weight out leaves its
    NaN, and one that keeps a weight from the permuted swap before it gives other probes."""
    from safetensors.torch import load_file

    meta = tmp_path / "meta"  # the step as its trainer began it: config and tokenizer
    meta.mkdir()
    for f in checkpoint.iterdir():
        if not f.name.endswith(".safetensors"):
            (meta / f.name).write_bytes(f.read_bytes())
    keeper = EngineKeeper()
    keeper.prepare(_request(meta))
    names = [n for n, _ in keeper.lm.model.named_parameters()]
    assert weights.unwritten(keeper.lm.model) == names  # every weight NaN, waiting
    engine = keeper.acquire(_request(checkpoint))
    assert engine.kind == "early" and keeper.checked == {keeper.signature}
    assert [(e["event"], e["check"]) for e in keeper.events] == [("engine.verify_ok", "quick")]
    early = weights.digest(engine.lm.model)
    keeper.drop()
    cold = EngineKeeper()
    assert weights.digest(cold.acquire(_request(checkpoint)).lm.model) == early
    cold.drop()

    hidden = json.loads((checkpoint / "config.json").read_text())["hidden_size"]
    state = dict(weights.permuted(checkpoint, hidden))
    own = {k: v for f in weights.weight_files(checkpoint) for k, v in load_file(f).items()}

    def load(tensors: dict[str, torch.Tensor], but: str) -> None:
        keeper.lm.model.load_state_dict(
            {k: v for k, v in tensors.items() if k != but}, strict=False
        )

    # a swap (permuted or not: the same code) that leaves the final norm out
    keeper.prepare(_request(meta))
    reach = engine_reach(keeper.lm, "hf", str(checkpoint), hidden)
    norm = "model.norm.weight"
    leaves_out = replace(
        reach, swap_permuted=lambda: load(state, norm), swap=lambda: load(own, norm)
    )
    why, _ = fill_check(leaves_out, "float32")
    assert why is not None and "left at the placeholder" in why and norm in why, why
    keeper.drop()
    # a swap that keeps a layer's weight from the permuted swap before it (as a layer that kept
    # what it derived from its first weights): the probes differ
    keeper.prepare(_request(meta))
    reach = engine_reach(keeper.lm, "hf", str(checkpoint), hidden)
    down = "model.layers.0.mlp.down_proj.weight"
    why, _ = fill_check(replace(reach, swap=lambda: load(own, down)), "float32")
    assert keeper.lm.model.get_parameter(down).equal(state[down])
    assert why is not None and why.startswith("with the hidden dimension permuted: probe "), why
    keeper.drop()


def test_a_tied_head_saved_beside_its_embeddings_is_swapped_in_as_a_cold_load_keeps_it(
    tmp_path: Path,
) -> None:
    """A model that ties its head to its embeddings, from a checkpoint that also holds an
    `lm_head.weight` of other values: `from_pretrained` keeps the embeddings' (it ties after
    loading), and so must a swap, into a cold engine or one started ahead (where the two swaps
    of the check agree with each other whichever tensor wins: only a cold load says which)."""
    from safetensors.torch import load_file, save_file

    tok = build_tokenizer(False)
    ckpt = tmp_path / "r_step1"
    save_checkpoint(build_model(len(tok), seed=3, tie_word_embeddings=True), tok, ckpt, False)
    meta = tmp_path / "meta"
    meta.mkdir()
    for f in ckpt.iterdir():
        if not f.name.endswith(".safetensors"):
            (meta / f.name).write_bytes(f.read_bytes())
    (path,) = weights.weight_files(ckpt)
    state = load_file(path)
    assert "lm_head.weight" not in state  # what a tied save writes; the trainer's own adds it:
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, path, metadata={"format": "pt"})
    cold, early = EngineKeeper(), EngineKeeper()
    early.prepare(_request(meta))
    for keeper in (cold, early):
        model = keeper.acquire(_request(ckpt)).lm.model
        assert model.lm_head.weight.equal(state["model.embed_tokens.weight"])
        assert [e["event"] for e in keeper.events] == ["engine.verify_ok"], keeper.events
    assert weights.digest(early.lm.model) == weights.digest(cold.lm.model)
    for keeper in (cold, early):
        keeper.drop()


def test_a_checkpoint_with_tensors_it_does_not_know_is_not_permuted(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model.safetensors", {"model.norm.weight": 16})
    assert weights.permutable(tmp_path, 16)
    write_safetensors(tmp_path / "model.safetensors", {"transformer.h.0.attn.c_attn.weight": 16})
    assert not weights.permutable(tmp_path, 16)
    # the axes by name: what reads the residual stream, what writes it, what has none
    assert weights.hidden_axis("model.layers.0.self_attn.q_proj.weight", (64, 16), 16) == 1
    assert weights.hidden_axis("model.layers.0.mlp.down_proj.weight", (16, 64), 16) == 0
    assert weights.hidden_axis("model.layers.0.self_attn.k_proj.bias", (64,), 16) is None
    assert weights.hidden_axis("model.layers.0.self_attn.q_norm.weight", (8,), 16) is None
    assert weights.hidden_axis("lm_head.weight", (100, 16), 16) == 1
    assert weights.hidden_axis("lm_head.weight", (100, 12), 16) is False  # not this model's


def test_probes_agree_through_a_near_tie_and_nothing_else() -> None:
    """Where a permuted sum breaks a tie of two tokens the other way (seen here: a tiny model's
    probe 5 went 7 where the fresh load went 6, each at about -0.69), the probes still agree;
    a confident other token, a logprob gap at the parting, or one before it does not."""
    fresh = [([4, 5], [-0.2, -0.1]), ([6, 17, 7, 17], [-0.05, -0.3, -0.6931, -0.4])]

    def with_second(tokens: list[int], logprobs: list[float]) -> list:
        return [fresh[0], (tokens, logprobs)]

    tie = with_second([6, 17, 6, 9], [-0.05, -0.3, -0.69312, -0.9])
    assert compare(tie, fresh, "float32") is None
    confident = with_second([6, 11, 7, 17], [-0.05, -0.3, -0.6931, -0.4])  # 11 at -0.3: no tie
    assert "probe 1: greedy token 1 differs" in str(compare(confident, fresh, "float32"))
    gap = with_second([6, 17, 6, 9], [-0.05, -0.3, -0.75, -0.9])
    assert "probe 1: greedy token 2 differs" in str(compare(gap, fresh, "float32"))
    moved = with_second([6, 17, 6, 9], [-0.05, -0.31, -0.69312, -0.9])
    assert "token 1's logprob -0.310000" in str(compare(moved, fresh, "float32"))
    # a 16-bit engine's tolerance is wider: the same gap of 0.005 is a tie there, not in float32
    wide = with_second([6, 17, 6, 9], [-0.05, -0.3, -0.6981, -0.9])
    assert compare(wide, fresh, "bfloat16") is None and compare(wide, fresh, "float32")
    shorter = with_second([6, 17], [-0.05, -0.3])  # ended where the other went on
    assert "greedy token 2 differs" in str(compare(shorter, fresh, "float32"))


def test_buffers_a_placeholder_load_sets_at_random_are_found() -> None:
    """vLLM's placeholder loader sets every persistent floating-point buffer at random, which
    the quick check (it scrambles parameters) would not see left so after the first swap: an
    engine ahead of its weights is not started for such a model (keeper.prepare)."""
    from types import SimpleNamespace

    from ckpt_watcher.evaluators.vllm_internals import SwapExtension

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)
            self.norm = torch.nn.Module()
            # as vLLM's placeholder loader leaves a persistent buffer
            self.norm.register_buffer("scale", torch.empty(2).uniform_(-1e-3, 1e-3))
            self.register_buffer("_k_scale", torch.tensor(1.0))  # set again after loading
            self.register_buffer("zeros", torch.zeros(2))
            # an 8-bit buffer holds them rounded to 0 or its smallest steps
            eight = torch.empty(64).uniform_(-1e-3, 1e-3).to(torch.float8_e4m3fn)
            self.register_buffer("kv_scale", eight)
            random = torch.empty(2).uniform_(-1e-3, 1e-3)
            self.register_buffer("cos_sin_cache", random, persistent=False)  # computed
            self.register_buffer("positions", torch.arange(2))  # integers: left alone

    ext = SwapExtension()
    ext.model_runner = SimpleNamespace(get_model=lambda: Model())
    assert ext.ckpt_watcher_random_buffers() == ["kv_scale", "norm.scale"]
    ext.model_runner = SimpleNamespace(get_model=lambda: torch.nn.Linear(2, 2))
    assert ext.ckpt_watcher_random_buffers() == []
