"""What the quick check of a swap does to a loaded model's weights (evaluators/keeper.py).

A swap must leave the engine exactly as a fresh load of the checkpoint would: every weight
rewritten, and whatever a layer derived from its weights at load time (a packed GEMM on CPU, a
re-tied head) derived again. Proving it against a fresh load costs a whole engine start. The
quick check proves it on the engine it has, with a checkpoint whose right answer is known
without loading it: the same checkpoint with its hidden dimension permuted.

Permuting the hidden (residual stream) dimension the same way in every tensor that has it
(embedding and head columns, the norms, the input columns of the projections that read the
residual stream, the output rows of those that write it) gives a model that computes the same
function: RMS and layer norms do not depend on the order of their inputs, and each matrix
product sums the same terms in another order. Every such tensor changes, so a weight the swap
left out, or a layer that kept what it derived from the weights before (the stale tied head
vLLM's reload leaves: vllm_internals.py), gives other tokens; a right swap gives the same
tokens, with logprobs that differ only by the order of the sums.

`permuted` knows the tensor names of the Llama family (Llama, Qwen2/2.5/3, Mistral, Gemma and
the like, fused `qkv_proj`/`gate_up_proj` too); a checkpoint with any other tensor is not
permuted (None), and its swaps are checked against a fresh load as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckpt_watcher.checkpoints import namefix
from ckpt_watcher.errors import SwapError

# the last two parts of a tensor's name -> the axis that is the hidden dimension
_READS_HIDDEN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj")
_WRITES_HIDDEN = ("o_proj", "down_proj")
_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "norm",
)
_NO_HIDDEN = ("q_norm", "k_norm")  # per head: their size is head_dim
_SEED = 20261125


def hidden_axis(name: str, shape: tuple[int, ...], hidden: int) -> int | None | bool:
    """The axis of `name` that is the hidden dimension; None for a tensor without one; False
    for a tensor this module does not know (the checkpoint is then not permuted)."""
    parts = name.split(".")
    if len(parts) < 2:
        return False
    module, kind = parts[-2], parts[-1]
    if module in ("embed_tokens", "lm_head", "wte") and kind == "weight" and len(shape) == 2:
        return 1 if shape[1] == hidden else False
    if module in _READS_HIDDEN:
        if kind == "bias":
            return None
        return 1 if kind == "weight" and len(shape) == 2 and shape[1] == hidden else False
    if module in _WRITES_HIDDEN and kind in ("weight", "bias"):
        return 0 if shape and shape[0] == hidden else False
    if module in _NO_HIDDEN and kind == "weight":
        return None
    if module in _NORMS and kind in ("weight", "bias") and len(shape) == 1:
        return 0 if shape[0] == hidden else False
    return False


def weight_files(checkpoint: Path) -> list[Path]:
    """The safetensors files a load reads: those its index maps to, else every one; a swap
    and the quick check read these (a name the naming fix added is in neither twice)."""
    files = namefix.weight_files(checkpoint)
    if not files:
        raise SwapError(f"{checkpoint}: no safetensors weights to swap in")
    return files


def permutable(checkpoint: Path, hidden: int) -> bool:
    """Every tensor of the checkpoint has a known hidden axis (or none), read from the files'
    headers (no weights read)."""
    from safetensors import safe_open

    try:
        files = weight_files(checkpoint)
    except SwapError:  # no safetensors: nothing a swap could load either
        return False
    if hidden <= 1:
        return False
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is no dict
                shape = tuple(f.get_slice(name).get_shape())
                if hidden_axis(name, shape, hidden) is False:
                    return False
    return True


def permuted(checkpoint: Path, hidden: int) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with the hidden dimension permuted (one fixed permutation),
    one tensor at a time. Call `permutable` first."""
    import torch
    from safetensors import safe_open

    order = torch.randperm(hidden, generator=torch.Generator().manual_seed(_SEED))
    for path in weight_files(checkpoint):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118
                tensor = f.get_tensor(name)
                axis = hidden_axis(name, tuple(tensor.shape), hidden)
                yield name, tensor if axis is None else tensor.index_select(int(axis), order)


def scramble(model: Any) -> int:
    """Every floating-point parameter set to NaN (a weight a swap leaves out then shows in
    every output); returns how many."""
    import torch

    n = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.fill_(float("nan"))
                n += 1
    return n


def unwritten(model: Any) -> list[str]:
    """The floating-point parameters holding a NaN: after `scramble` and a swap, those the swap
    did not write (or a checkpoint's own NaN, as wrong to serve)."""
    import torch

    with torch.no_grad():
        return [
            name
            for name, p in model.named_parameters()
            if p.is_floating_point() and bool(torch.isnan(p).any())
        ]


_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
_CHUNK = 1 << 24
_PRIME = 65521


def digest(model: Any) -> dict[str, int]:
    """Every parameter's bits, each weighted by its position, summed (by name, tied names
    each; on the parameter's device, a chunk at a time): equal for equal weights, and other
    for the same values in another order (a permuted weight left in place)."""
    import torch

    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            flat = p.detach().contiguous().view(-1)
            ints = flat.view(getattr(torch, _INT_OF_SIZE[flat.element_size()]))
            total = 0
            for i in range(0, len(ints), _CHUNK):
                part = ints[i : i + _CHUNK].to(torch.int64)
                at = torch.arange(i, i + len(part), device=part.device, dtype=torch.int64)
                total += int((part * (at % _PRIME + 1)).sum())
            out[name] = total
    return out


def compare_digests(now: dict[str, int], before: dict[str, int]) -> str | None:
    """None when the weights are the same as before, bit for bit; else which differ."""
    if now.keys() != before.keys():
        return f"the parameters are not the same set ({sorted(now.keys() ^ before.keys())[:3]})"
    differ = [k for k in now if now[k] != before[k]]
    if differ:
        return f"{len(differ)} parameter(s) not as loaded after the swap back, e.g. {differ[0]}"
    return None
