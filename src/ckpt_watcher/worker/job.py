"""One job in a worker: read the job folder's spec, stage the checkpoint if it is remote, run
every task on it with the model loaded once (or swapped into a warm engine), and write each
task's outcome as it finishes, so a crash later in the job keeps the tasks already done. The
daemon reads the outcomes and is the only writer of the ledger. The exit code says how the job
ended (`jobfolder.EXIT_*`); what stopped a whole job goes in the folder's crash file.

A checkpoint in a trainer's own format is converted first (convert.py). A LoRA adapter saved
alone is served on its base for lm-eval's tasks (by vLLM, or by peft on the hf backend) where
vLLM serves it as peft applies it (`served_on`); otherwise, and for harnesses that load the
checkpoint themselves, it is merged into a copy of its base (merge.py), which the tasks read.

A result is of exactly the bytes its fingerprint names: the files read are those the checkpoint
was judged with (the spec's write mark) before the model loads, and still are when each task
ends, or nothing more is recorded (`EXIT_CHANGED`: the daemon judges the checkpoint again). A
staged S3 copy is checked object by object as it is fetched (sources/staging.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from ckpt_watcher.checkpoints import adapter, namefix, noop
from ckpt_watcher.checkpoints.files import ADAPTER_WEIGHTS, LocalFiles, check_unchanged
from ckpt_watcher.errors import AdapterNotServed, CheckpointChanged
from ckpt_watcher.evaluators import compile_cache, engine_watch
from ckpt_watcher.jobfolder import (
    EXIT_CHANGED,
    EXIT_CRASH,
    EXIT_OK,
    EXIT_TASK_FAILED,
    Crash,
    JobFolder,
    Progress,
)
from ckpt_watcher.worker import starter
from ckpt_watcher.worker.convert import Converted, converted
from ckpt_watcher.worker.merge import merged

if TYPE_CHECKING:
    from collections.abc import Callable

    from ckpt_watcher.evaluators.keeper import EngineKeeper
    from ckpt_watcher.harnesses.server import Servers
    from ckpt_watcher.jobfolder import EvalRequest, JobSpec, TaskOutcome, TaskRun

PROGRESS_EVERY_SECONDS = 1.0

log = structlog.get_logger("ckpt_watcher.worker")


def _record_crash(folder: JobFolder, e: BaseException) -> int:
    """What stopped the whole job (staging, loading the model), classified like a task's error;
    returns the exit code that says so."""
    if isinstance(e, CheckpointChanged):
        log.warning("worker.checkpoint_changed", error=str(e))
        folder.write_crash(Crash(str(e), heals=True, changed=True))
        return EXIT_CHANGED
    from ckpt_watcher.evaluators.failures import classify

    failure = classify(e)
    folder.write_crash(Crash(failure.error, failure.heals))
    return EXIT_CRASH


def _run_lm_eval(
    req: EvalRequest,
    keeper: EngineKeeper | None,
    record: Callable[[TaskOutcome], None],
    progress: Callable[[Progress], None],
    spec: JobSpec,
) -> list[TaskOutcome]:
    """lm-eval's entries, with the model loaded once (or swapped into `keeper`'s engine)."""
    import torch

    from ckpt_watcher.evaluators.harness import run_tasks

    # a CPU slot's share of the cores (devices.py), as torch took it
    log.info("worker.threads", torch=torch.get_num_threads(), omp=os.environ.get("OMP_NUM_THREADS"))
    engine = keeper.acquire(req) if keeper is not None else None
    if engine is not None:
        log.info("worker.engine", engine=engine.kind, seconds=round(engine.seconds, 3))
    outcomes = run_tasks(req, record, engine, progress, spec.device_label)
    failed = [o for o in outcomes if o.status == "failed" and o.heals]
    if keeper is not None and engine is not None and engine.kind in ("warm", "early") and failed:
        # a task that failed on a swapped engine (and might not fail again) gets a cold
        # engine before its failure counts
        log.warning("worker.warm_task_failed", tasks=[o.task for o in failed])
        keeper.drop()
        retry = {o.key for o in failed}
        sub = dataclasses.replace(req, tasks=[t for t in req.tasks if t.key in retry])
        again = {
            o.key: o
            for o in run_tasks(sub, record, keeper.acquire(sub), progress, spec.device_label)
        }
        outcomes = [again.get(o.key, o) for o in outcomes]
    elif keeper is not None and any("EngineDeadError" in (o.error or "") for o in failed):
        keeper.drop()  # vLLM declared this engine dead (a process of its own died): not kept
    return outcomes


def run_job(
    job_dir: Path, keeper: EngineKeeper | None = None, servers: Servers | None = None
) -> int:
    """One job: stage, load (or have `keeper` swap in) the checkpoint, run its tasks. A warm
    worker passes its `keeper` and its kept model `servers` (for served harnesses). If its
    engine's process dies, the worker exits at once with the job's crash (`engine_watch`)."""
    folder = JobFolder(job_dir)

    def engine_died(why: str) -> None:
        folder.write_crash(Crash(why, heals=True))
        folder.write_exit(EXIT_CRASH)

    with engine_watch.last_words(engine_died):
        return _run_job(folder, keeper, servers)


def _run_job(folder: JobFolder, keeper: EngineKeeper | None, servers: Servers | None) -> int:
    spec = folder.read_spec()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The daemon decided the device; we only read it. First in the log: a worker killed while
    # it imports (a time-out) still leaves this line in its error (the log tail, jobs/settle.py)
    log.info(
        "worker.started",
        pid=os.getpid(),
        job_id=spec.job_id,
        device=spec.device_label,
        CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        warm=keeper is not None,
        starter=starter.forked_from,  # None: a plain process
    )
    compile_cache.use(spec.request.compile_cache)  # before anything compiles (imports torch)
    req = spec.request
    # a local checkpoint (or its pin) is read where the trainer may still write: the files read
    # must be those judged, before loading and after each task (a staged copy is ours, and
    # was checked object by object as it was fetched)
    live = Path(req.checkpoint) if spec.stage is None else None

    def unchanged() -> None:
        if live is not None:
            check_unchanged(LocalFiles(live), spec.write_mark, str(live))

    try:
        unchanged()
    except CheckpointChanged as e:
        return _record_crash(folder, e)
    if spec.stage is not None:
        from ckpt_watcher.sources.staging import stage as stage_checkpoint

        try:
            local = stage_checkpoint(
                spec.stage.location,
                Path(spec.stage.cache_dir),
                spec.stage.endpoint_url,
                request_timeout=spec.stage.request_timeout,
                write_mark=spec.write_mark,
            )
        except Exception as e:
            if not isinstance(e, CheckpointChanged):
                log.exception("worker.staging_failed", location=spec.stage.location)
            return _record_crash(folder, e)
        log.info("worker.staged", location=spec.stage.location, path=str(local))
        req = dataclasses.replace(req, checkpoint=str(local))
    made: list[Path] = []  # copies of our own, removed when the job ends
    native = None
    try:
        try:  # a trainer's own format is converted first, into a Hugging Face folder
            native = converted(
                Path(req.checkpoint),
                req.model_args,
                _converting(folder),
                req.adapter_base,
                spec.fingerprint,
                req.convert,
            )
            if native is not None:
                req = dataclasses.replace(req, checkpoint=str(native.path))
            # a LoRA/PEFT adapter saved alone is evaluated as the model it makes: served on its
            # base by vLLM where it can be, else merged into a copy of the base
            base = served_on(Path(req.checkpoint), req, spec.fingerprint)
            merge = None
            if base is None:
                merge = merged(Path(req.checkpoint), req.adapter_base, spec.fingerprint)
        except Exception as e:
            if not isinstance(e, CheckpointChanged):
                log.exception("worker.convert_failed", checkpoint=req.checkpoint)
            return _record_crash(folder, e)
        flags = Flags(
            adapter="served" if base is not None else "merged" if merge is not None else None,
            no_op=_no_op(Path(req.checkpoint), (base or merge) is not None, req.adapter_base),
        )
        if merge is not None:
            made.append(merge)
            req = dataclasses.replace(req, checkpoint=str(merge))
        if base is not None:
            served = [_journaled_as(t, "served") for t in req.tasks]
            req = dataclasses.replace(req, checkpoint=str(base), lora=req.checkpoint, tasks=served)

        def merge_now() -> str:
            """The adapter merged into its base, for what cannot be served it (made once)."""
            for path in made:
                return str(path)
            assert req.lora is not None
            copy = merged(Path(req.lora), req.adapter_base, spec.fingerprint)
            assert copy is not None
            made.append(copy)
            return str(copy)

        return _run_tasks(folder, spec, req, keeper, servers, unchanged, native, flags, merge_now)
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
        if native is not None:
            native.release()


# the bases vLLM refused to serve adapters on in this worker (an architecture without LoRA in
# vLLM): their next adapters are merged at once, without another engine start that fails
_NOT_SERVED: set[str] = set()


def base_refused(base: str) -> None:
    """vLLM refused to load `base` with LoRA enabled: this worker merges its adapters."""
    _NOT_SERVED.add(base)


def served_on(
    checkpoint: Path, req: EvalRequest, judged: str | None, ahead: bool = False
) -> Path | None:
    """The base model `checkpoint` is served on, if it is a LoRA adapter saved alone that
    vLLM serves as peft applies it (`adapter.unservable`) with its base's tokenizer; None:
    not an adapter, or one to merge (which says why in the log). On the hf backend peft
    serves it (evaluators/peft_adapter.py), and the same adapters are served: the job's
    served harnesses ask vLLM's model server for it. `ahead`: the step is still being
    written (an engine started before it, worker/early.py): its adapter config is enough, and
    its tensors are judged (`adapter.unfit`) by its job."""
    if not req.serve_adapters or (req.backend == "hf" and req.model_args.get("peft")):
        return None  # (hf: an adapter of the engine's own stays on, under the merged copy)
    view = LocalFiles(checkpoint)
    if not (adapter.is_adapter(view.files) or (ahead and adapter.adapter_so_far(view.files))):
        return None
    override = Path(req.adapter_base) if req.adapter_base is not None else None
    base = adapter.resolve_base(view, override, str(checkpoint))
    if judged is not None:
        adapter.check_base(view, base, judged, str(checkpoint))
    config = adapter.read_config(view)
    if isinstance(config, str):
        why = config
    elif not (why := adapter.unservable(config)):
        if not noop.tokenizer_is_bases(checkpoint, base):
            why = "it saved a tokenizer or chat template of its own"
        elif not ahead or any(n in view.files for n in ADAPTER_WEIGHTS):  # (else: its job's)
            why = adapter.unfit(checkpoint, base, config)
    if why:
        log.info("worker.adapter_not_served", adapter=str(checkpoint), why=why)
        return None
    # the base as vLLM can load it (its index's names), at one path for the worker's life:
    # the warm engine keeps a base it loaded from the same path (keeper.py)
    # (the pid: workers whose TMPDIR is shared never build one folder at once, scratch.py)
    digest = hashlib.sha256(str(base).encode()).hexdigest()[:12]
    links = Path(tempfile.gettempdir()) / f"ckpt-watcher-base-{digest}-{os.getpid()}"
    loadable = namefix.loadable_view(base, links)
    if str(loadable) in _NOT_SERVED:
        log.info("worker.adapter_not_served", adapter=str(checkpoint), why="refused before")
        return None
    return loadable


def _journaled_as(t: TaskRun, adapter: str | None) -> TaskRun:
    """`t`, its journal's records valid only for an adapter evaluated that way ("served"; None:
    merged, the identity as the daemon gave it): a served and a merged run of one step differ
    in their last bits (bf16), and an attempt never resumes from the other's responses."""
    if t.journal is None:  # (a served harness's proxy journal too: keyed by this identity)
        return t
    identity = {k: v for k, v in t.journal.identity.items() if k != "adapter"}
    if adapter is not None:
        identity["adapter"] = adapter
    return dataclasses.replace(t, journal=dataclasses.replace(t.journal, identity=identity))


@dataclasses.dataclass(frozen=True)
class Flags:
    """What each of the job's ledger lines says of how the checkpoint was served."""

    adapter: str | None = None  # an adapter, "served" on its base or "merged" into it
    no_op: str | None = None  # why the checkpoint is its base model (checkpoints/noop.py)


def _run_theirs(
    theirs: list[TaskRun],
    req: EvalRequest,
    servers: Servers,
    spec: JobSpec,
    unchanged: Callable[[], None],
    progress: Callable[[Progress], None],
    merge_now: Callable[[], str] | None,
    adapter_for: dict[bool, str | None],
    record: Callable[[TaskOutcome], None],
) -> list[TaskOutcome]:
    """Each other harness's entry on the job's checkpoint. An adapter (`req.lora`) is served on
    its base to an entry that asks a model server (harnesses/server.py); an entry that loads the
    checkpoint itself, or one whose server refused the adapter, gets the merged copy."""
    from ckpt_watcher.harnesses.run import harness, run_entry

    on_copy: list[EvalRequest] = []

    def copy() -> EvalRequest:
        """The request on the merged copy (made once)."""
        if not on_copy:
            assert merge_now is not None
            on_copy.append(dataclasses.replace(req, checkpoint=merge_now(), lora=None))
        return on_copy[0]

    refused = False
    outcomes = []
    for t in theirs:
        entry, how = req, adapter_for[False]
        if req.lora is not None:
            served = not refused and harness(t.harness).served(dict(t.spec or {}))
            if not served:
                entry, t = copy(), _journaled_as(t, None)
            how = "served" if served else "merged"
        if servers.req is not entry:
            servers.job(entry)
        try:
            outcome = run_entry(entry, servers, t, spec.device_label, unchanged, progress)
        except AdapterNotServed as e:  # merged, and this entry run again on the copy
            log.warning("worker.adapter_not_served", adapter=req.lora, why=str(e))
            if e.base_refused:  # the next adapters on it are merged at once
                base_refused(req.checkpoint)
            servers.stop()
            refused, entry = True, copy()
            servers.job(entry)
            how, t = "merged", _journaled_as(t, None)
            outcome = run_entry(entry, servers, t, spec.device_label, unchanged, progress)
        adapter_for[False] = how
        record(outcome)
        outcomes.append(outcome)
    return outcomes


def _no_op(checkpoint: Path, is_adapter: bool, base: str | None) -> str | None:
    """Why `checkpoint` (an adapter saved alone, or a model whose source names its base)
    changes nothing, or None. A check that cannot be made says nothing: the step is
    evaluated as any other."""
    try:
        if is_adapter:
            override = Path(base) if base is not None else None
            found = adapter.resolve_base(LocalFiles(checkpoint), override, str(checkpoint))
            return noop.adapter_no_op(checkpoint, found)
        if base is not None and noop.same_weights(checkpoint, Path(base)):
            return f"its weights are its base model's ({base}), byte for byte"
    except Exception as e:  # unreadable tensors: the eval says so, if they matter
        log.warning("worker.no_op_unchecked", checkpoint=str(checkpoint), error=repr(e))
        return None
    return None


def _converting(folder: JobFolder) -> Callable[[int, int], None]:
    """The conversion's progress, as `watcher status` shows a task's (in MiB, once a second)."""
    since = time.time()
    last = [0.0]

    def said(done: int, total: int) -> None:
        now = time.time()
        if done >= total or now - last[0] >= PROGRESS_EVERY_SECONDS:
            mib = 2**20
            folder.write_progress(
                Progress("converting", -(-done // mib), -(-total // mib), "MiB", since, 0, now)
            )
            last[0] = now

    return said


def _run_tasks(
    folder: JobFolder,
    spec: JobSpec,
    req: EvalRequest,
    keeper: EngineKeeper | None,
    servers: Servers | None,
    unchanged: Callable[[], None],
    native: Converted | None = None,
    flags: Flags = Flags(),
    merge_now: Callable[[], str] | None = None,
) -> int:
    """Every task of the job on `req.checkpoint` (the checkpoint, its staged, converted or
    merged copy, or the base an adapter `req.lora` is served on), each outcome written as it
    ends; `unchanged` raises if what the job was asked about was written since it was judged;
    `native`: the conversion it was made by; `merge_now`: a served adapter merged into its
    base, for the harnesses that cannot serve it and where vLLM refuses it."""
    index = {t.key: i for i, t in enumerate(req.tasks)}
    # how lm-eval's tasks, and the other harness's entry running, were given an adapter
    adapter_for = {True: flags.adapter, False: flags.adapter}

    last_progress = [0.0]

    def progress(now: Progress) -> None:  # at most once a second, and at each task's end
        if now.done >= now.total or now.at - last_progress[0] >= PROGRESS_EVERY_SECONDS:
            unchanged()  # a long task stops within a second of a write into what it reads
            folder.write_progress(now)
            last_progress[0] = now.at

    def record(outcome: TaskOutcome) -> None:
        unchanged()  # raises: this task's result is of no bytes the job was asked about
        if native is not None:
            outcome.source_format, outcome.convert_seconds = native.source_format, native.seconds
        outcome.adapter, outcome.no_op = adapter_for[outcome.harness == "lm-eval"], flags.no_op
        folder.write_outcome(index[outcome.key], outcome)
        log.info(
            "worker.task_done",
            task=outcome.task,
            num_fewshot=outcome.num_fewshot,
            status=outcome.status,
            error=outcome.error,
        )

    # lm-eval's entries share one loaded model; each other harness's entry runs on its own
    # after them (it loads or serves the checkpoint itself), with the device to itself
    # (a GPU holds one of them at a time: a warm worker's kept engine, or its kept server)
    ours = [t for t in req.tasks if t.harness == "lm-eval"]
    theirs = [t for t in req.tasks if t.harness != "lm-eval"]
    own = servers is None  # a one-shot worker's server ends with the job
    if servers is None:
        from ckpt_watcher.harnesses.server import Servers

        servers = Servers()
    servers.job(req)
    on_gpu = req.device != "cpu"
    try:
        if ours and on_gpu:
            servers.stop()
        outcomes = []
        if ours:
            lm_req = dataclasses.replace(req, tasks=ours)
            refused = None
            try:
                outcomes = _run_lm_eval(lm_req, keeper, record, progress, spec)
            except AdapterNotServed as e:  # merged instead, and said so in each ledger line
                refused = e
            if refused is not None:  # (out of the handler: its traceback holds the engine)
                assert merge_now is not None
                log.warning("worker.adapter_not_served", adapter=req.lora, why=str(refused))
                if refused.base_refused:
                    base_refused(req.checkpoint)
                refused = None
                if keeper is not None:
                    keeper.drop()
                adapter_for[True] = "merged"
                merged_tasks = [_journaled_as(t, None) for t in lm_req.tasks]
                lm_req = dataclasses.replace(
                    lm_req, checkpoint=merge_now(), lora=None, tasks=merged_tasks
                )
                outcomes = _run_lm_eval(lm_req, keeper, record, progress, spec)
        if theirs and keeper is not None and on_gpu:
            keeper.drop()  # the GPU's memory is the other harness's now
        if theirs:
            outcomes += _run_theirs(theirs, req, servers, spec, unchanged, progress, merge_now,
                                    adapter_for, record)  # fmt: skip
    except CheckpointChanged as e:
        servers.stop()  # it may serve bytes that are not the checkpoint's now
        return _record_crash(folder, e)
    except Exception as e:
        log.exception("worker.crashed")
        if keeper is not None:  # whatever broke may have broken the engine: start cold next
            keeper.drop()
        servers.stop()
        return _record_crash(folder, e)
    finally:
        if own:
            servers.stop()
    return EXIT_OK if all(o.status != "failed" for o in outcomes) else EXIT_TASK_FAILED
