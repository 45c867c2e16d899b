"""A tiny character-level Llama for 2-digit addition, and its bundled lm-eval task.

The task: `47+85=` is answered `132`, every sum written with 3 digits (`10+20=` -> `030`), so
each answer digit sits at the same place in every example.

Its thinking variant (`thinking=True`), a stand-in for a reasoning model, writes its working
between `<think>` and `</think>` before the answer (`thought`); a sum whose ones digits carry
thinks longer, so a small `max_gen_toks` cuts those responses before `</think>`.

Imports torch/transformers: used by the trainer process and by tests, never by the daemon.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

CHARS = list("0123456789+= \n")
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
THINK = ("<think>", "</think>")  # the thinking variant's markers: tokens of their own
# Not a .yaml: lm-eval would index it if `include_path` pointed here, and its data path is a
# placeholder that `write_task` fills in.
TASK_TEMPLATE = Path(__file__).parent / "tasks" / "addition.yaml.template"


def build_tokenizer(thinking: bool = False) -> Any:
    """A character-level WordLevel tokenizer wrapped for transformers (no files needed);
    `thinking` adds `<think>` and `</think>` as tokens (not special: decoding keeps them, as
    reasoning models' tokenizers do)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=64,
    )
    if thinking:
        fast.add_tokens(list(THINK))
    return fast


# 16 heads of size 8 learn the task on every seed tried (0-6 reach 0.98-1.0 at step 600, 1 or
# 2 threads alike). With 2 heads (size 64), 3 seeds in 4 stalled at loss ~0.7 below 0.15, and 8
# heads still stalled 1 seed in 6: the jump out of that plateau needs a head that happens to
# attend to the right digits, and more heads make that near certain.
DEMO_HEADS = 16
# vLLM's CPU attention takes head sizes from 32 up; tests that serve the model with vLLM use 2
# heads (size 64).
VLLM_HEADS = 2


def answer(a: int, b: int) -> str:
    """The target the task scores: the sum with 3 digits."""
    return f"{a + b:03d}"


def thought(a: int, b: int) -> str:
    """The thinking variant's response: the ones digits' sum, and where it carries the tens'
    sum with the carry, in `<think>...</think>`, then the answer (`47+85=` ->
    `<think>7+5=12 1+4+8=13</think>132`: 19 tokens; `41+35=` -> `<think>1+5=6</think>076`: 10)."""
    x, y = a % 10, b % 10
    work = f"{x}+{y}={x + y}"
    if x + y >= 10:
        work += f" 1+{a // 10}+{b // 10}={1 + a // 10 + b // 10}"
    return f"{THINK[0]}{work}{THINK[1]}{answer(a, b)}"


def build_model(
    vocab_size: int, seed: int = 0, tie_word_embeddings: bool = False, heads: int = DEMO_HEADS
) -> Any:
    """A ~0.4M-parameter Llama (2 layers, hidden 128 split into `heads` heads, context 64)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=64,
        bos_token_id=SPECIALS.index("<s>"),
        eos_token_id=SPECIALS.index("</s>"),
        pad_token_id=SPECIALS.index("<pad>"),
        tie_word_embeddings=tie_word_embeddings,
    )
    return LlamaForCausalLM(config)


def addition_pairs(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)]


def write_task(folder: Path, n_test: int = 100, seed: int = 1234) -> Path:
    """Write the `addition` task (YAML + jsonl with an absolute path, as lm-eval needs) to `folder`.

    Returns the folder, for `eval.include_path`. Test pairs use their own seed, so the
    trainer (seed 0 stream, disjoint draws) rarely sees them verbatim.
    """
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "addition_test.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for a, b in addition_pairs(n_test, seed):
            f.write(json.dumps({"a": a, "b": b, "answer": answer(a, b)}) + "\n")
    text = TASK_TEMPLATE.read_text(encoding="utf-8").replace("__DATA_FILE__", str(data.resolve()))
    (folder / "addition.yaml").write_text(text, encoding="utf-8")
    return folder


def save_checkpoint(model: Any, tokenizer: Any, out: Path, naming_bug: bool = True) -> None:
    """Save in place as buggy trainers do: tokenizer, then (bug) an index that names
    `model-00001-of-00001.safetensors`, then the weights as `model.safetensors` and config.

    The index goes first so a watcher always sees the mismatch: a half-written
    `model.safetensors` beside an index naming a file that will never exist.
    """
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    if naming_bug:
        names = sorted(model.state_dict().keys())
        if model.config.tie_word_embeddings:
            names = [n for n in names if n != "lm_head.weight"]
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {n: "model-00001-of-00001.safetensors" for n in names},
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    model.save_pretrained(out, safe_serialization=True)
