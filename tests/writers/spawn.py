"""What every writer here does to run its ranks: W processes of one gloo group on a free local
port, each calling `rank(r, *args, port)` (as torchrun would start them)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any


def spawn(rank: Callable[..., None], world: int, *args: Any) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank, args=(*args, port), nprocs=world, join=True)
