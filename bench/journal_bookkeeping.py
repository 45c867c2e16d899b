"""Journal bookkeeping per chunk, with compute doing nothing: what a journaled task costs beyond
its engine (claims, done marks, journal appends, progress), at 1k, 10k and 100k chunks.

One worker answers a task of N chunks (`TaskJournal.answer`, the hf path; 8 units a chunk, as
hf's batches of 8 cut an MMLU-sized likelihood task of 56,168 requests into 7,021 chunks)
whose compute returns at once, its journal in a fresh folder on this machine's disk, progress
reported as the worker reports it. Figures: seconds per 1,000 chunks at each size, and the
ratio of the largest to the smallest (target: flat within 20%, and under 1 s per 10k chunks).
Before the bookkeeping was made linear (a look at every chunk still to do after each chunk, an
fsync per chunk): 1,000 chunks 3.2 s, 2,000 chunks 13.8 s.

Usage: python bench/journal_bookkeeping.py [--sizes 1000 10000 100000] [--work DIR]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from ckpt_watcher import journal
from ckpt_watcher.evaluators.resume import TaskJournal

UNITS_PER_CHUNK = 8


def one(work: Path, chunks: int) -> float:
    """Seconds to answer `chunks` chunks whose compute does nothing."""
    folder = work / f"chunks{chunks}"
    shutil.rmtree(folder, ignore_errors=True)
    ident = journal.identity("sampled:bench", "s", "bench", 0)
    ref = journal.JournalRef(str(folder), ident)
    units = [(f"k{i}", i) for i in range(chunks * UNITS_PER_CHUNK)]
    reports = []
    task = TaskJournal(
        ref, "w", UNITS_PER_CHUNK, progress=lambda d, t, u: reports.append(d), device="cpu:0"
    )
    began = time.perf_counter()
    out = task.answer(units, lambda r: r, lambda reqs: reqs, "requests")
    took = time.perf_counter() - began
    task.close()
    assert out == [r for _, r in units] and reports[-1] == len(units)
    shutil.rmtree(folder, ignore_errors=True)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-journal-"))
    work.mkdir(parents=True, exist_ok=True)
    per_k = {}
    for n in args.sizes:
        took = one(work, n)
        per_k[n] = took / n * 1000
        print(f"{n:>7} chunks: {took:7.2f} s in all, {per_k[n]:.3f} s per 1,000 chunks", flush=True)
    low, high = min(args.sizes), max(args.sizes)
    print(
        f"per-1,000 cost at {high} chunks / at {low}: {per_k[high] / per_k[low]:.2f} "
        "(target: within 1.2)"
    )
    if 10_000 in per_k:
        print(f"per 10k chunks: {per_k[10_000] * 10:.2f} s (target: under 1 s)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
