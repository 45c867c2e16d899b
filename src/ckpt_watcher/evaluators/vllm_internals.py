"""Everything that touches vLLM beyond `LLM(...)` and `generate`, in one place (worker only).

vLLM is not pinned as tightly as lm-eval, and none of this is its documented API. `RELIED_ON`
lists each name we use, and `tests/test_vllm_internals.py` checks every one of them still exists
with the expected parameters, without starting an engine: an upgrade that moves one fails there,
naming it, instead of warm engines silently falling back to cold loads.

- the CPU build's process environment (`prepare_cpu_process`);
- swapping a checkpoint's weights into a live engine (`swap`, and `SwapExtension`, which vLLM
  mixes into its worker through `worker_extension_cls` and which runs where the model lives),
  an engine started on placeholder weights (`PLACEHOLDER_FORMAT`) included;
- the check's probes (`probe`: greedy tokens and logprobs) and an engine's shutdown;
- the step loop `LLM.generate` runs inside, fed a chunk of requests at a time so that a journaled
  task gets each response as the engine finishes it (`EngineStream`);
- a LoRA adapter served on the loaded base (`use_adapter`, `drop_adapter`): each adapter under
  an id never used before in the process, so neither vLLM's adapter cache nor its prefix
  cache (whose keys hold the id) can answer with another step's adapter.

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
on a process's first such request (`batched_count_greater_than`, torch.compile with inductor;
seconds, more on a fresh machine: docs/benchmarks.md has the figures). In a job of generative
tasks the probes are the only requests with logprobs, and they never read the ranks, so while a
probe runs that one function is plain torch (`eager_ranks`). The model's own forward pass,
compiled or CUDA-graphed, stays exactly as the eval runs it: that is what the probe must test.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

# the load format of an engine started before its checkpoint's weights exist: every weight
# random, replaced by the first swap (keeper.prepare)
PLACEHOLDER_FORMAT = "dummy"
# its values: uniform in +-this (weight_utils.initialize_single_dummy_weight), and float8's
# smallest steps (2^-9) they round to in an 8-bit buffer
PLACEHOLDER_RANGE = 1e-3
PLACEHOLDER_LIMIT = 4 * PLACEHOLDER_RANGE
RANK_KERNEL = "batched_count_greater_than"  # in vllm.v1.sample.sampler
RELOAD_WRAPPER = "online_process_loader"  # vLLM's deferred loader, in reload/layerwise.py
# what vLLM is told to mix into its worker (engine argument `worker_extension_cls`)
SWAP_EXTENSION = "ckpt_watcher.evaluators.vllm_internals.SwapExtension"

# (module, attribute path, parameter names it must accept, in order, after self)
RELIED_ON: list[tuple[str, str, list[str]]] = [
    ("vllm", "SamplingParams", ["n", "presence_penalty"]),
    ("vllm.entrypoints.llm", "LLM.collective_rpc", ["method", "timeout", "args", "kwargs"]),
    ("vllm.entrypoints.llm", "LLM.reset_prefix_cache", []),
    ("vllm.entrypoints.llm", "LLM.generate", ["prompts", "sampling_params"]),
    ("vllm.entrypoints.llm", "LLM.enqueue", ["prompts", "sampling_params"]),
    ("vllm.v1.engine.llm_engine", "LLMEngine.step", []),
    ("vllm.v1.engine.llm_engine", "LLMEngine.abort_request", ["request_ids", "internal"]),
    ("vllm.v1.engine.llm_engine", "LLMEngine.get_num_unfinished_requests", []),
    ("vllm", "SamplingParams.extra_args", []),
    ("vllm.lora.request", "LoRARequest", ["lora_name", "lora_int_id", "lora_path"]),
    ("vllm.v1.engine.llm_engine", "LLMEngine.add_lora", ["lora_request"]),
    ("vllm.v1.engine.llm_engine", "LLMEngine.remove_lora", ["lora_id"]),
    ("vllm.v1.engine.llm_engine", "LLMEngine.list_loras", []),
    ("vllm.engine.arg_utils", "EngineArgs.worker_extension_cls", []),
    ("vllm.v1.engine.core_client", "EngineCoreClient.shutdown", []),
    ("vllm.v1.sample.sampler", f"{RANK_KERNEL}._torchdynamo_orig_callable", []),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner.reload_weights",
        ["weights_iterator", "weights_path"],
    ),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_model", []),
    ("vllm.v1.worker.gpu_worker", "Worker.update_config", ["overrides"]),
    ("vllm.engine.arg_utils", "EngineArgs.load_format", []),
    ("vllm.model_executor.model_loader.reload.layerwise", "LAYERWISE_INFO", []),
    (
        "vllm.model_executor.model_loader.reload.layerwise",
        "make_online_process_loader",
        ["layer", "param_name"],
    ),
    (
        "vllm.model_executor.model_loader.reload.sanitize",
        "sanitize_layer_refs",
        ["tensor", "layer"],
    ),
    ("vllm.model_executor.model_loader.reload.types", "LayerReloadingInfo.restore_metadata", []),
    (
        "vllm.model_executor.layers.vocab_parallel_embedding",
        "UnquantizedEmbeddingMethod.process_weights_after_loading",
        ["layer"],
    ),
    # a warm worker's kept model server (harnesses/server.py): swaps through the development
    # routes (VLLM_SERVER_DEV_MODE), probes with token ids and the model's context from /tokenize
    ("vllm.entrypoints.serve.dev.rpc.api_router", "collective_rpc", ["raw_request"]),
    ("vllm.entrypoints.serve.dev.cache.api_router", "reset_prefix_cache", ["raw_request"]),
    (
        "vllm.entrypoints.openai.completion.protocol",
        "CompletionRequest.return_tokens_as_token_ids",
        [],
    ),
    ("vllm.entrypoints.serve.tokenize.protocol", "TokenizeResponse.max_model_len", []),
]
# Attributes set in constructors (no class attribute to look up): (module, class, the line that
# sets it in the class's source)
RELIED_ON_ASSIGNED: list[tuple[str, str, str]] = [
    ("vllm.entrypoints.llm", "LLM", "self.llm_engine ="),
    ("vllm.v1.engine.llm_engine", "LLMEngine", "self.engine_core ="),
]
# Environment variables vLLM reads that we set (each must be one of `vllm.envs`')
RELIED_ON_ENV = (
    "VLLM_TARGET_DEVICE",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_USE_AOT_COMPILE",  # off: compiled once per model shape (evaluators/compile_cache.py)
    "VLLM_SERVER_DEV_MODE",  # on for a kept model server, on its private socket (harnesses/server.py)
)


def prepare_cpu_process() -> None:
    """This process's environment for vLLM's CPU build (a user's own values win)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # the engine core in this process, not a spawned one that imports torch and vLLM again
    # (bench/vllm_cpu_start.py measures both). CUDA keeps vLLM's default: a separate process,
    # whose exit surely frees the GPU.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        # vLLM reads an empty value as a Ray actor's not-yet-set GPUs and keeps Triton (which
        # has no CPU driver here), and its first batch dies on "0 active drivers"; "-1" hides
        # every GPU just as well (a spawned engine core disabled Triton anyway)
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"


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
    vllm_config: Any  # provided by vLLM's Worker
    update_config: Any  # provided by vLLM's Worker

    def ckpt_watcher_swap(self, path: str) -> list[str]:
        """Load `path`'s weights in place; returns the tied modules that were re-processed."""
        return self._ckpt_watcher_reload(weights_path=path)

    def ckpt_watcher_swap_permuted(self, path: str, hidden: str) -> list[str]:
        """`path`'s weights with the hidden dimension permuted, in place (the quick check,
        keeper.py); arguments as strings, as vLLM's /collective_rpc route passes them."""
        from pathlib import Path

        from ckpt_watcher.evaluators.weights import permuted

        return self._ckpt_watcher_reload(weights_iterator=permuted(Path(path), int(hidden)))

    def ckpt_watcher_scramble(self) -> int:
        from ckpt_watcher.evaluators.weights import scramble

        return scramble(self.model_runner.get_model())

    def ckpt_watcher_unwritten(self) -> list[str]:
        from ckpt_watcher.evaluators.weights import unwritten

        return unwritten(self.model_runner.get_model())

    def ckpt_watcher_digest(self) -> dict[str, int]:
        from ckpt_watcher.evaluators.weights import digest

        return digest(self.model_runner.get_model())

    def ckpt_watcher_random_buffers(self) -> list[str]:
        """The model's buffers that still hold vLLM's placeholder values (its loader sets every
        persistent floating-point buffer uniformly in +-PLACEHOLDER_RANGE, `DummyModelLoader`,
        unless the layer's processing after loading sets it again, as the attention layers'
        KV-cache scales of an unquantized cache are set to 1): a checkpoint's reload may leave
        them so (a quantized KV cache's scales), where a cold load sets them, and the quick
        check, which scrambles parameters, would not see it."""
        import torch

        out = []
        for prefix, module in self.model_runner.get_model().named_modules():
            for name, buffer in module.named_buffers(recurse=False):
                if name in module._non_persistent_buffers_set:
                    continue
                if not torch.is_floating_point(buffer) or not buffer.numel():
                    continue
                # in float32: an 8-bit buffer holds them rounded to 0 or its smallest step
                if 0 < float(buffer.float().abs().max()) <= PLACEHOLDER_LIMIT:
                    out.append(f"{prefix}.{name}" if prefix else name)
        return out

    def _ckpt_watcher_reload(self, **source: Any) -> list[str]:
        if self.vllm_config.load_config.load_format == PLACEHOLDER_FORMAT:
            # an engine started before its weights (keeper.prepare): vLLM reloads only from
            # a loader that reads files, in every version (NotImplementedError otherwise)
            self.update_config({"load_config": {"load_format": "auto"}})
        self.model_runner.reload_weights(**source)
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


# --- the engine, seen from lm-eval's VLLM model (`lm.model` is vLLM's `LLM`) ---------------
def swap(lm: Any, checkpoint: str) -> None:
    """Swap `checkpoint`'s weights into the live engine, then drop the old weights' KV cache
    (on CUDA vLLM no longer resets the prefix cache by itself)."""
    lm.model.collective_rpc("ckpt_watcher_swap", args=(checkpoint,))
    lm.model.reset_prefix_cache()


def probe(
    lm: Any, prompts: list[list[int]], max_tokens: int
) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs for each prompt (token ids)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, seed=0)
    # the sampled tokens' ranks uncompiled while probing (see the module's docstring)
    if not all(lm.model.collective_rpc("ckpt_watcher_eager_ranks", args=(True,))):
        import structlog

        structlog.get_logger("ckpt_watcher.evaluators.vllm_internals").warning(
            "engine.probe_compiles", why="this vLLM has no compiled rank kernel we know"
        )
    try:
        requests = lm.model.generate(
            [{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False
        )
    finally:
        lm.model.collective_rpc("ckpt_watcher_eager_ranks", args=(False,))
    out = []
    for request in requests:
        gen = request.outputs[0]
        tokens = list(gen.token_ids)
        logprobs = [step[t].logprob for step, t in zip(gen.logprobs or [], tokens, strict=True)]
        out.append((tokens, logprobs))
    return out


def shutdown(lm: Any) -> bool:
    """Stop vLLM's engine (its core process, where it has one); False if `lm` has no engine."""
    engine = getattr(getattr(lm, "model", None), "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is None:
        return False
    core.shutdown()
    return True


# A sampled request's journal key rides in its SamplingParams' `extra_args` through lm-eval's
# generate_until (which sorts the requests) to `_model_generate`, where the step loop runs.
UNIT_ARG = "ckpt_watcher_unit"

_adapter_ids = itertools.count(1)  # never reused in a process (module docstring)


def use_adapter(lm: Any, path: str, label: str) -> None:
    """Serve the LoRA adapter in `path` on `lm`'s engine (loaded with `enable_lora`) for every
    request lm-eval makes from now on (its `lora_request`), loaded into the engine now: an
    adapter vLLM refuses raises AdapterNotServed here, before any task runs. Its id and its
    name (`label`-id; the prefix cache's keys hold the name) are new to the process."""
    from vllm.lora.request import LoRARequest

    from ckpt_watcher.errors import AdapterNotServed

    drop_adapter(lm)
    number = next(_adapter_ids)
    request = LoRARequest(f"{label}-{number}", number, path)
    try:
        lm.model.llm_engine.add_lora(request)
    except Exception as e:
        raise AdapterNotServed(
            f"vLLM cannot serve the adapter {path}: {type(e).__name__}: {e}"
        ) from e
    lm.lora_request = request


def drop_adapter(lm: Any) -> None:
    """Stop serving `lm`'s adapter, and unload it from the engine."""
    request = getattr(lm, "lora_request", None)
    lm.lora_request = None
    if request is not None:
        lm.model.llm_engine.remove_lora(request.lora_int_id)


class EngineStream:
    """vLLM's step loop, as `LLM.generate` runs it, fed requests a chunk at a time (a
    `resume.Engine`). A unit is (key, (prompt token ids, SamplingParams)); its value, as the
    journal keeps it, is the raw output: {"text", "tokens" (how many), "finish"}.

    `LLM.enqueue` gives each request the number `generate` would (its counter) and answers
    vLLM's internal id, that number with a random suffix; outputs name the number."""

    def __init__(self, llm: Any, lora_request: Any = None) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.lora_request = lora_request  # the adapter served, if any (`use_adapter`)
        self.keys: dict[str, str] = {}  # the request's number -> unit key, until it finishes
        self.internal: dict[str, str] = {}  # the request's number -> vLLM's internal id

    def submit(self, units: list[tuple[str, Any]]) -> None:
        from vllm.inputs import TokensPrompt

        ids = self.llm.enqueue(
            [TokensPrompt(prompt_token_ids=list(tokens)) for _, (tokens, _) in units],
            [params for _, (_, params) in units],
            lora_request=self.lora_request,
            use_tqdm=False,
        )
        for internal, (key, _) in zip(ids, units, strict=True):
            number = internal.rsplit("-", 1)[0]
            self.keys[number], self.internal[number] = key, internal

    def pending(self) -> int:
        return int(self.engine.get_num_unfinished_requests())

    def step(self) -> list[tuple[str, Any]]:
        done = []
        for out in self.engine.step():
            if out.finished:
                first = out.outputs[0]
                value = {
                    "text": first.text,
                    "tokens": len(first.token_ids),
                    "finish": first.finish_reason,
                }
                self.internal.pop(out.request_id, None)
                done.append((self.keys.pop(out.request_id), value))
        return done

    def close(self) -> None:
        if self.internal:
            self.engine.abort_request(list(self.internal.values()), internal=True)
        self.keys.clear()
        self.internal.clear()
