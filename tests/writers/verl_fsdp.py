"""verl 0.9.1's own `FSDPCheckpointManager` saving a Hugging Face model sharded over gloo ranks
on the CPU, with verl's default `save_contents` (`model`, `optimizer`, `extra`: no `hf_model`),
then the driver's `latest_checkpointed_iteration.txt` last, as `RayPPOTrainer._save_checkpoint`
writes a step: `<out>/global_step_<N>/actor/` and `<out>/global_step_<N>/data.pt`.

Usage: python tests/writers/verl_fsdp.py MODEL OUT STEP RANKS [--replicas R] [--lr LR]

FSDP2 (`fully_shard`), verl's default strategy. FSDP1 needs an accelerator (torch refuses CPU
parameters with the device mesh verl passes); its sharded state dict is the same DTensors.

`--replicas R` saves under HSDP (a `(R, RANKS/R)` mesh: placements `[Replicate(), Shard(0)]`,
FSDP2 only). `--lr` takes one AdamW step on a sum before saving (the weights then differ from
MODEL's); with the default 0 no step is taken and the saved weights are MODEL's.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from spawn import spawn


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if args.replicas > 1:
        mesh = init_device_mesh(
            "cpu", (args.replicas, args.ranks // args.replicas), mesh_dim_names=("ddp", "fsdp")
        )
    else:
        mesh = init_device_mesh("cpu", (args.ranks,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:  # as verl's apply_fsdp2: each layer, then the model
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr or 1e-3)
    if args.lr:
        ids = torch.arange(2, 12).unsqueeze(0)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    step_dir = Path(args.out) / f"global_step_{args.step}"
    manager = FSDPCheckpointManager(
        model, optimizer, processing_class=AutoTokenizer.from_pretrained(args.model)
    )
    manager.save_checkpoint(local_path=str(step_dir / "actor"), global_step=args.step)
    dist.barrier()
    if rank == 0:  # the driver: the dataloader's state, then the tracker file last
        torch.save({"dataloader": {}}, step_dir / "data.pt")
        (Path(args.out) / "latest_checkpointed_iteration.txt").write_text(str(args.step))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("step", type=int)
    p.add_argument("ranks", type=int)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.0)
    args = p.parse_args()
    spawn(_rank, args.ranks, args, preload=("verl.utils.checkpoint.fsdp_checkpoint_manager",))


if __name__ == "__main__":
    main()
