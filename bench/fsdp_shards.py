"""Save random weights of given shapes as verl's FSDP ranks save a model: each of W gloo ranks
`torch.save`s its DTensors (`[Shard(0)]`, torch.chunk's pieces: later ranks may hold fewer rows)
as `model_world_size_{W}_rank_{R}.pt`, what `FSDPCheckpointManager` writes for an FSDP2 model's
sharded state dict, without building the model (so a 0.6B shape saves on a small CPU box).

Usage: python bench/fsdp_shards.py OUT W SHAPES_JSON
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path


def _rank(r: int, out: str, world: int, shapes: dict[str, list[int]], port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    g = torch.Generator().manual_seed(r)
    state = {}
    for name, shape in shapes.items():
        sizes = [len(c) for c in torch.empty(shape[0], dtype=torch.int8).chunk(world)]
        sizes += [0] * (world - len(sizes))
        local = torch.randn((sizes[r], *shape[1:]), generator=g) * 0.02
        stride = torch.empty(shape, device="meta").stride()
        state[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
        )
    torch.save(state, Path(out) / f"model_world_size_{world}_rank_{r}.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    out, world, shapes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(out, world, shapes, port), nprocs=world, join=True)


if __name__ == "__main__":
    main()
