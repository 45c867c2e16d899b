"""The worker's Python heap, kept out of garbage collections that cannot free it.

Once torch, vLLM and lm-eval are imported a worker holds hundreds of thousands of objects that
live as long as it does, and every full collection walks them all. vLLM runs several per engine
start and per shutdown (memory profiling, `freeze_gc_heap`, `cleanup_dist_env_and_memory`):
they were most of a warm worker's release and fresh load (docs/benchmarks.md, warm engines).
`gc.freeze()` moves every live object to a generation no collection walks, as vLLM itself does
once its engine is up; objects made later are collected as before. A worker ends with
`os._exit` once its results are written, so no collection over the frozen heap (nor the
teardown warnings of extension modules that count their objects) happens at exit. Imported only
inside worker processes.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Collect what is garbage now, then freeze what is left. Call it when what is live is what
    the worker keeps: before an engine is built, after one is released. Never while an engine is
    only dropped but not collected: it would be frozen with the rest and never freed."""
    gc.collect()
    gc.freeze()
