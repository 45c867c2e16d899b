"""Run lm-evaluation-harness on one checkpoint: the model is loaded once, then every task runs.

Each (task, num_fewshot) is one `simple_evaluate` call on the same loaded model with the same
seeds as `lm_eval --seed S`, so a result equals what `lm_eval` reports for that task alone.
The backends are lm-eval's own `hf` and `vllm` classes with one change: the generation clamp
(see `clamp.py`; lm-eval internals are all in `lm_eval_internals.py`). Imported only inside
worker processes.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ckpt_watcher.clock import utcnow
from ckpt_watcher.durable import write_json_atomic
from ckpt_watcher.errors import EvalError
from ckpt_watcher.evaluators.clamp import ClampCounts
from ckpt_watcher.evaluators.failures import classify
from ckpt_watcher.evaluators.lm_eval_internals import (
    clamped_backend,
    json_default,
    n_samples,
    task_metrics,
)

# vLLM engine arguments the transformers backend does not take.
_VLLM_ONLY_ARGS = frozenset(
    {
        "gpu_memory_utilization",
        "enforce_eager",
        "max_num_seqs",
        "swap_space",
        "kv_cache_dtype",
        "enable_prefix_caching",
        "block_size",
        "cpu_offload_gb",
        "max_num_batched_tokens",
    }
)


@dataclass(frozen=True)
class TaskRun:
    task: str
    num_fewshot: int | None
    allow_code_execution: bool = False


@dataclass
class EvalRequest:
    """Everything one worker needs; built by the daemon, read from the job's spec file."""

    checkpoint: str
    backend: str
    model_args: dict[str, Any]
    tasks: list[TaskRun]
    seed: int
    gen_kwargs: dict[str, Any]
    max_gen_toks: int | None
    include_path: str | None
    batch_size: int | str | None  # None: the backend's own default (hf 1, vllm auto)
    limit: float | None
    results_dir: str
    device: str  # "cpu" or "cuda"
    tensor_parallel_size: int = 1


@dataclass
class TaskOutcome:
    task: str
    num_fewshot: int | None
    status: str  # ok | failed
    metrics: dict[str, Any] = field(default_factory=dict)
    n_samples: int | None = None
    clamped_requests: int = 0
    truncated_prompts: int = 0
    started_at: str = ""
    finished_at: str = ""
    results_file: str | None = None
    error: str | None = None
    heals: bool = True  # False: failing again as is is certain (see failures.py)
    lm_eval_version: str = ""


def load_model(req: EvalRequest) -> Any:
    """Load the checkpoint once, as lm-eval's backend with the clamp; returns an lm-eval LM."""
    if req.device == "auto":  # a Ray slot: whatever this node has
        import torch

        req.device = "cuda" if torch.cuda.is_available() else "cpu"
    args = dict(req.model_args)
    if req.batch_size is not None:
        args["batch_size"] = req.batch_size
    if req.backend == "vllm" and req.device == "cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cls = clamped_backend(req.backend)
    if req.backend == "vllm":
        args.setdefault("seed", req.seed)
        lm = cls(pretrained=req.checkpoint, tensor_parallel_size=req.tensor_parallel_size, **args)
    else:
        if "max_model_len" in args:
            args["max_length"] = args.pop("max_model_len")
        for key in _VLLM_ONLY_ARGS & args.keys():
            args.pop(key)
        args.pop("device", None)
        lm = cls(pretrained=req.checkpoint, device=req.device, **args)
    lm.clamp_counts = ClampCounts()
    return lm


@contextmanager
def _code_execution(allowed: bool) -> Iterator[None]:
    """HF_ALLOW_CODE_EVAL=1 only while a task that was allowed to execute code runs."""
    before = os.environ.get("HF_ALLOW_CODE_EVAL")
    if allowed:
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"
    else:
        os.environ.pop("HF_ALLOW_CODE_EVAL", None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_ALLOW_CODE_EVAL", None)
        else:
            os.environ["HF_ALLOW_CODE_EVAL"] = before


def run_tasks(req: EvalRequest, on_outcome: Callable[[TaskOutcome], None]) -> list[TaskOutcome]:
    """Load the model once and run every task; `on_outcome` is called as each task finishes."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    version = importlib.metadata.version("lm-eval")
    lm = load_model(req)
    metadata = dict(req.model_args) | {"pretrained": req.checkpoint}
    task_manager = TaskManager(include_path=req.include_path, metadata=metadata)
    gen_kwargs = dict(req.gen_kwargs)
    if req.max_gen_toks is not None:
        gen_kwargs["max_gen_toks"] = req.max_gen_toks
    results_dir = Path(req.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for t in req.tasks:
        started = utcnow()
        outcome = TaskOutcome(
            t.task, t.num_fewshot, "failed", started_at=started, lm_eval_version=version
        )
        try:
            with _code_execution(t.allow_code_execution):
                results = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=[t.task],
                    num_fewshot=t.num_fewshot,
                    limit=req.limit,
                    log_samples=False,
                    gen_kwargs=gen_kwargs or None,
                    task_manager=task_manager,
                    random_seed=req.seed,
                    numpy_random_seed=req.seed,
                    torch_random_seed=req.seed,
                    fewshot_random_seed=req.seed,
                    confirm_run_unsafe_code=t.allow_code_execution,
                )
            if results is None:
                raise EvalError("lm-eval returned no results (not rank 0?)")
            shots = "default" if t.num_fewshot is None else f"{t.num_fewshot}shot"
            stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H-%M-%S.%f")
            rfile = results_dir / f"results_{_safe(t.task)}_{shots}_{stamp}.json"
            write_json_atomic(rfile, results, default=json_default)
            clamped, truncated = lm.clamp_counts.take()
            outcome.status = "ok"
            outcome.metrics = task_metrics(results, t.task)
            outcome.n_samples = n_samples(results, t.task)
            outcome.clamped_requests = clamped
            outcome.truncated_prompts = truncated
            outcome.results_file = str(rfile)
        except Exception as e:  # one task's failure must not lose the others' results
            lm.clamp_counts.take()
            failure = classify(e)
            outcome.error, outcome.heals = failure.error, failure.heals
        outcome.finished_at = utcnow()
        outcomes.append(outcome)
        on_outcome(outcome)
    return outcomes


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:80]
