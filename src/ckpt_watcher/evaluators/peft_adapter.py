"""A LoRA adapter applied by peft to a Hugging Face model in this process: attached, checked
to fit, and taken off again.

The merge (worker/merge.py) attaches an adapter to a base it has just loaded and merges it
into a copy. The hf backend serves an adapter instead: attached to the kept base under an id
of its own (never another step's), lm-eval's requests answered through peft's forward (the
adapter applied beside the base's weights, as lm-eval's own `peft=` argument does), and
unloaded after the job, which leaves the base's own modules and tensors (`intact` checks
that before the base serves another adapter; evaluators/keeper.py). No copy of the base is
made. Imported only inside worker processes.
"""

from __future__ import annotations

import itertools
import re
import warnings
from pathlib import Path
from typing import Any

from ckpt_watcher.errors import AdapterError, AdapterNotServed

_ids = itertools.count(1)  # each adapter served in this process gets a name of its own


def attach(model: Any, adapter_dir: Path, base: Path, name: str = "default") -> Any:
    """`model` (the base, loaded) with the adapter in `adapter_dir` attached under `name`: a
    peft model. AdapterError when the adapter's tensors are not the ones its modules expect
    (another model's shapes, or names peft does not know: peft only warns, and the model would
    be the base alone, scored as the adapter)."""
    import torch
    from peft import PeftModel

    with torch.no_grad(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            attached = PeftModel.from_pretrained(model, adapter_dir, adapter_name=name)
        except RuntimeError as e:  # torch's load_state_dict: tensors of another model's shapes
            if "size mismatch" not in str(e):
                raise
            first = next(ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln)
            raise AdapterError(
                f"{adapter_dir}: its tensors do not fit {base}, whose shapes differ ({first}); "
                "set the source's adapter_base to the model the adapter was trained on"
            ) from None
    missing = [str(w.message) for w in said if "missing adapter keys" in str(w.message)]
    if missing:
        raise AdapterError(
            f"{adapter_dir}: its tensors do not fit {base}: peft found no tensor for "
            f"{missing[0].count('lora_')} of the adapter's weights (saved under other names "
            "than peft's, or for another model); re-save it with peft's save_pretrained, or "
            "set the source's adapter_base to the model it was trained on"
        )
    attached.eval()
    return attached


def use_adapter(lm: Any, path: str, label: str) -> None:
    """Serve the adapter in `path` on the hf model of lm-eval's `lm` (its base) for every
    request from now on, under the name `label`-id; an adapter peft cannot attach raises
    AdapterNotServed (the job merges it instead, which says what is wrong with it)."""
    from peft import PeftModel

    drop_adapter(lm)
    base = lm._model
    if isinstance(base, PeftModel):  # an adapter of the engine's own (model_args' `peft`)
        raise AdapterNotServed("the engine holds an adapter of its own (model_args: peft)")
    if getattr(lm, "ckpt_watcher_tensors", None) is None:  # the base as loaded, for `intact`
        lm.ckpt_watcher_tensors = _tensors(base)
    # peft freezes the base's weights; a frozen weight sends torch's matmul of a strided input
    # (generate's last position into the head) to a batched product that copies the weight
    # once per sequence: on CPU a 0.6B model's generate went 5 times slower and its peak up by
    # more than a base (bench/adapter_serve.py). The base's flags are put back as they were.
    flags = [(p, p.requires_grad) for p in base.parameters()]
    try:
        named = Path(str(getattr(base, "name_or_path", "its base")))
        # (a module name: torch refuses dots, which run names such as qwen2.5-lora hold)
        name = f"{re.sub(r'[^A-Za-z0-9_-]', '_', label)}-{next(_ids)}"
        lm._model = attach(base, Path(path), named, name)
        lm.ckpt_watcher_serving = True
    except Exception as e:
        raise AdapterNotServed(f"peft cannot serve the adapter {path}: {e}") from e
    finally:
        for p, wanted in flags:
            p.requires_grad_(wanted)


def drop_adapter(lm: Any) -> None:
    """Stop serving `lm`'s adapter: its LoRA modules taken out of the base, nothing merged."""
    if getattr(lm, "ckpt_watcher_serving", False):  # never an adapter use_adapter did not attach
        lm.ckpt_watcher_serving = False
        lm._model = lm._model.unload()


def intact(lm: Any) -> bool:
    """Whether `lm`'s model is its base as loaded: no adapter attached, and the same modules
    holding the same tensors as before its first adapter (True if it never served one)."""
    before = getattr(lm, "ckpt_watcher_tensors", None)
    return before is None or _tensors(lm._model) == before


def _tensors(model: Any) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Every parameter and buffer of `model` by name: where its data is, and its shape."""
    named = itertools.chain(model.named_parameters(), model.named_buffers())
    return {name: (t.data_ptr(), tuple(t.shape)) for name, t in named}
