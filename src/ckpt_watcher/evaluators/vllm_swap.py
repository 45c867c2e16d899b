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
"""

from __future__ import annotations

from typing import Any


def shared_parameter_modules(model: Any) -> list[str]:
    """Names of modules holding a parameter that another module holds too (tied weights)."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(name)
    return sorted({name for names in holders.values() if len(names) > 1 for name in names})


class SwapExtension:
    """Mixed into vLLM's Worker; called with `llm.collective_rpc("ckpt_watcher_swap", ...)`."""

    model_runner: Any  # provided by vLLM's Worker

    def ckpt_watcher_swap(self, path: str) -> list[str]:
        """Load `path`'s weights in place; returns the tied modules that were re-processed."""
        self.model_runner.reload_weights(weights_path=path)
        model = self.model_runner.get_model()
        redone = []
        for name in shared_parameter_modules(model):
            module = model.get_submodule(name)
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                redone.append(name)
        return redone
