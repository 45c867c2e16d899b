"""What every writer here does to run its ranks: W processes of one gloo group on a free local
port, each calling `rank(r, *args, port)` (as torchrun would start them).

The ranks are forked from one fork server (the standard library's `forkserver`) that imports
torch, transformers and the writer's `preload` modules once: each rank started by `spawn`
imported them again (about 4 s of CPU a rank, 11 ranks in one test). Nothing is initialized
before the fork (no process group, no thread pool: the server only imports); each rank sets
up its group itself, as under torchrun. This parent never imports torch."""

from __future__ import annotations

import multiprocessing
import socket
import time
from collections.abc import Callable
from typing import Any


def spawn(rank: Callable[..., None], world: int, *args: Any, preload: tuple[str, ...] = ()) -> None:
    """Run the ranks; again on a new port if one fails (the free port found here can be taken
    by another test's process before rank 0 listens on it: EADDRINUSE, seen in a CI run).
    A rank that failed for another reason fails each time: three tries, then its error."""
    for attempt in range(3):
        try:
            return _spawn_once(rank, world, *args, preload=preload)
        except SystemExit:
            if attempt == 2:
                raise
    return None


def _spawn_once(
    rank: Callable[..., None], world: int, *args: Any, preload: tuple[str, ...] = ()
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["rank_imports", *preload])
    procs = [ctx.Process(target=rank, args=(r, *args, port)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        while any(p.exitcode is None for p in procs):
            failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:  # the others would wait for it in the group for ever
                raise SystemExit(f"rank {failed[0][0]} exited with {failed[0][1]}")
            time.sleep(0.05)
        failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise SystemExit(f"rank {failed[0][0]} exited with {failed[0][1]}")
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
