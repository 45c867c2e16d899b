"""A LoRA/PEFT adapter saved alone becomes the model it makes: merged into its base (peft's
`merge_and_unload`, on the CPU, in the base's dtype) and saved as a checkpoint of its own in
the worker's temporary folder, which every backend and harness then reads. The merged copy is
removed when the job ends (and with the worker's temporary folder if the worker is killed:
scratch.py).

The base is found as the daemon found it when it judged the adapter (checkpoints/adapter.py),
and must still be the base the job's fingerprint covers (`adapter.with_base`): a base rewritten
since sends the adapter to be judged again (CheckpointChanged), as its own files would.
The merge's peak memory is about 1.6 times the base's size, and it writes a copy of the base's
size to TMPDIR (bench/adapter_merge.py).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import structlog

from ckpt_watcher.checkpoints import adapter
from ckpt_watcher.checkpoints.files import NEEDED, LocalFiles

log = structlog.get_logger("ckpt_watcher.worker.merge")

# what the merged copy takes from the adapter's folder over the base's (a trainer that adds
# tokens or a chat template saves its tokenizer beside the adapter)
_TOKENIZER = NEEDED - {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
}


def merged(checkpoint: Path, adapter_base: str | None, judged: str | None = None) -> Path | None:
    """The merged copy of `checkpoint` if it is an adapter saved alone (None if it is not).
    `judged`: the fingerprint it was judged with, which its base must still give."""
    view = LocalFiles(checkpoint)
    if not adapter.is_adapter(view.files):
        return None
    override = Path(adapter_base) if adapter_base is not None else None
    base = adapter.resolve_base(view, override, str(checkpoint))
    if judged is not None:
        adapter.check_base(view, base, judged, str(checkpoint))
    out = Path(tempfile.mkdtemp(prefix="merged-"))
    started = time.monotonic()
    try:
        merge(checkpoint, base, out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    log.info(
        "worker.adapter_merged",
        adapter=str(checkpoint),
        base=str(base),
        into=str(out),
        seconds=round(time.monotonic() - started, 3),
    )
    return out


def merge(adapter_dir: Path, base: Path, out: Path) -> None:
    """Save to `out` the base model with the adapter merged in, and the tokenizer files: the
    adapter folder's where it has them, else the base's."""
    import torch
    from transformers import AutoModelForCausalLM

    from ckpt_watcher.evaluators.peft_adapter import attach

    loaded = AutoModelForCausalLM.from_pretrained(base, dtype="auto", low_cpu_mem_usage=True)
    with torch.no_grad():
        model = attach(loaded, adapter_dir, base)
        merged = model.merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    del merged, model, loaded
    for folder in (base, adapter_dir):  # the adapter's own last: it wins
        for name in _TOKENIZER & set(LocalFiles(folder, follow_links=True).files):
            shutil.copyfile(folder / name, out / name)
