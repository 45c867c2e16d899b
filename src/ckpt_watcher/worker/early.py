"""An engine started before its checkpoint's weights exist, in a warm worker (`serve.py`).

The daemon asks for one on an idle device as soon as a run's model is known: a step still being
written whose config and tokenizer are already whole (checkpoints/model_meta.py). Here those files
are copied into the worker's own placeholder folder (the trainer goes on writing the step
beside them; the engine reads only the copy), and the keeper starts vLLM on them with
placeholder weights. The step's weights are swapped in when its job comes, and proven before
anything is evaluated (evaluators/keeper.py). A LoRA step saved alone gets its base model
instead, loaded for real (on vLLM with LoRA enabled at the step's rank), on which its adapter
is served when its job comes (worker/job.py `served_on`, the same base folder the job will
name).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from ckpt_watcher.checkpoints import adapter, model_meta
from ckpt_watcher.checkpoints.files import LocalFiles
from ckpt_watcher.errors import AdapterNotServed, SwapError
from ckpt_watcher.jobfolder import EvalRequest, JobFolder
from ckpt_watcher.worker.job import base_refused, served_on

if TYPE_CHECKING:
    from ckpt_watcher.evaluators.keeper import EngineKeeper

log = structlog.get_logger("ckpt_watcher.worker.early")


def prepare(request_folder: JobFolder, placeholder: Path, keeper: EngineKeeper) -> str:
    """Start the keeper's engine for the request in `request_folder` on placeholder weights;
    returns the signature it was started for."""
    spec = request_folder.read_spec()
    req = spec.request
    source = Path(req.checkpoint)
    base = served_on(source, req, None, ahead=True)
    if base is not None:  # a LoRA step saved alone (its config and tokenizer too, maybe: the
        # job serves the adapter all the same), its tensors maybe still to come
        log.info("engine.preparing", run=spec.job_id, base=str(base), adapter=str(source))
        try:
            sig = keeper.prepare(dataclasses.replace(req, checkpoint=str(base), lora=str(source)))
        except AdapterNotServed as e:
            if e.base_refused:  # its job merges at once, without a second engine start
                base_refused(str(base))
            raise
        _ready_tasks(spec.job_id, req)
        log.info("engine.ready", run=spec.job_id, signature=sig)
        return sig
    if adapter.adapter_so_far(LocalFiles(source).files):
        raise SwapError(f"{source}: an adapter not served on its base (merged when complete)")
    files = model_meta.find(source, tokenizer_required="tokenizer" not in req.model_args)
    if files is None:
        raise SwapError(f"{source}: no whole config and tokenizer to start an engine on")
    shutil.rmtree(placeholder, ignore_errors=True)
    placeholder.mkdir(parents=True)
    for path in files:
        shutil.copyfile(path, placeholder / path.name)
    log.info("engine.preparing", run=spec.job_id, model=str(source))
    sig = keeper.prepare(dataclasses.replace(req, checkpoint=str(placeholder)))
    _ready_tasks(spec.job_id, req)
    log.info("engine.ready", run=spec.job_id, signature=sig)
    return sig


def _ready_tasks(run: str, req: EvalRequest) -> None:
    """The rest of a first job's set-up, done while the weights are still being written: on the
    tests' model it was 1.0 s of the first step's 1.1 s in its worker (torch's environment report,
    mostly), which every later job of the worker finds done."""
    from ckpt_watcher.evaluators.harness import ready_tasks

    try:
        log.info("engine.tasks_ready", run=run, seconds=round(ready_tasks(req), 3))
    except Exception as e:  # its job does it all again, and says what failed
        log.warning("engine.tasks_not_ready", run=run, error=f"{type(e).__name__}: {e}")
