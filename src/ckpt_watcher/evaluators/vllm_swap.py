"""Runs inside vLLM's worker process (`worker_extension_cls`): swap a checkpoint's weights into
the live model, tied parameters included.

Why tied embeddings need more than `reload_weights` (vLLM 0.32, read in
`model_executor/model_loader/reload/layerwise.py`): the reload re-processes each layer once all
of *its* checkpoint weights have arrived. A checkpoint with `tie_word_embeddings: true` has no
`lm_head.weight`; the new values reach `lm_head` only because its parameter *is*
`embed_tokens.weight`, so `lm_head` counts as "nothing loaded" and gets its old kernel tensors
put back (`_place_kernel_tensors`). Whatever its quant method derived from the weight at load
time then stays stale: on CPU `UnquantizedEmbeddingMethod.process_weights_after_loading` packs
a GEMM of the old weight, and the swapped engine computes logits with the previous checkpoint's
head. We find every module whose parameter is shared with another module and run its
`process_weights_after_loading` again, as a cold load does.

Why a swapped model was never freed (vLLM 0.32, same files): the reload registers the meta
tensors it recorded for each layer (`LAYERWISE_INFO[layer].restore_metadata`, a module-level
WeakKeyDictionary) as the layer's parameters and wraps their weight loaders in
`online_process_loader`, a closure over the layer. The wrappers stay on the recorded tensors
after the reload, so each dictionary value refers to its own key, and every layer of a model that
was ever swapped, with its weights, stayed alive for the life of the process: after the check's
fresh load and after every release of a swapped engine, one more copy of the model (seen here as
all 14 parameters of the released engine alive). With vLLM's engine core in a process of its own
(CUDA) that memory went back when the core exited; in process (CPU) it did not. After each swap
we put the recorded tensors' own loaders back, sanitized as vLLM records them at load
(`unwrap_recorded_loaders`); the next reload wraps them again.

The check's probes ask for logprobs, and vLLM ranks each sampled token with a kernel it compiles
on a process's first such request (`batched_count_greater_than`, torch.compile with inductor):
17.6 s on a fresh machine here, 2-5 s with inductor's cache warm. In a job of generative
tasks the probes are the only requests with logprobs, and they never read the ranks, so while a
probe runs that one function is plain torch (`eager_ranks`). The model's own forward pass,
compiled or CUDA-graphed, stays exactly as the eval runs it: that is what the probe must test.
"""

from __future__ import annotations

from typing import Any

RANK_KERNEL = "batched_count_greater_than"  # in vllm.v1.sample.sampler
RELOAD_WRAPPER = "online_process_loader"  # vLLM's deferred loader, in reload/layerwise.py
# vLLM's compiled rank kernel, as its sampler module first held it
_COMPILED_RANKS: dict[str, Any] = {}


def eager_ranks(on: bool) -> bool:
    """While `on`, vLLM's sampler ranks tokens with its rank kernel's plain-torch source instead
    of compiling it (same counts). False when this vLLM's sampler has no such compiled kernel."""
    from vllm.v1.sample import sampler

    compiled = _COMPILED_RANKS.setdefault("kernel", getattr(sampler, RANK_KERNEL, None))
    eager = getattr(compiled, "_torchdynamo_orig_callable", None)
    if eager is None:
        return False
    setattr(sampler, RANK_KERNEL, eager if on else compiled)
    return True


def shared_parameter_modules(model: Any) -> list[str]:
    """Names of modules holding a parameter that another module holds too (tied weights)."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(name)
    return sorted({name for names in holders.values() if len(names) > 1 for name in names})


def unwrap_recorded_loaders(model: Any) -> int:
    """Give every tensor vLLM recorded for reloading `model` its own weight loader back, bound
    to no layer (see the module's docstring); returns how many it unwrapped."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.sanitize import sanitize_layer_refs

    def unwrap(tensor: Any, layer: Any) -> bool:
        loader = getattr(tensor, "weight_loader", None)
        if getattr(loader, "__name__", None) != RELOAD_WRAPPER:
            return False
        while getattr(loader, "__name__", None) == RELOAD_WRAPPER:
            loader = loader.__wrapped__  # type: ignore[union-attr]
        tensor.weight_loader = loader
        sanitize_layer_refs(tensor, layer)
        return True

    unwrapped = 0
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is not None:
            for tensors in info.restore_metadata:
                unwrapped += sum(unwrap(t, layer) for t in tensors.values())
    return unwrapped


class SwapExtension:
    """Mixed into vLLM's Worker; called with `llm.collective_rpc("ckpt_watcher_swap", ...)`."""

    model_runner: Any  # provided by vLLM's Worker

    def ckpt_watcher_swap(self, path: str) -> list[str]:
        """Load `path`'s weights in place; returns the tied modules that were re-processed."""
        self.model_runner.reload_weights(weights_path=path)
        model = self.model_runner.get_model()
        unwrap_recorded_loaders(model)
        redone = []
        for name in shared_parameter_modules(model):
            module = model.get_submodule(name)
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                redone.append(name)
        return redone

    def ckpt_watcher_eager_ranks(self, on: bool) -> bool:
        """`eager_ranks` in the process where vLLM's sampler runs."""
        return eager_ranks(on)
