"""A transformers Trainer checkpoint under accelerate's FSDP2 (TRL's FSDP2 recipes): the model
saved as accelerate's `save_fsdp_model` saves a sharded state dict, `dist_cp.save(state_dict=
{"model": ...}, storage_writer=FileSystemWriter(<out>/checkpoint-N/pytorch_model_fsdp_0))` over
W gloo ranks (torch's DCP: `.metadata` written last), then rank 0 writes the config, the
tokenizer and `trainer_state.json` beside it, as the Trainer does. No Hugging Face weights.

Usage: python tests/writers/accelerate_fsdp2.py MODEL OUT STEP RANKS
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from spawn import spawn


def _rank(rank: int, model_dir: str, out: str, step: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    folder = Path(out) / f"checkpoint-{step}"
    ckpt_dir = folder / "pytorch_model_fsdp_0"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist_cp.save(
        state_dict={"model": model.state_dict()},
        storage_writer=dist_cp.FileSystemWriter(str(ckpt_dir)),
        planner=DefaultSavePlanner(),
    )
    dist.barrier()
    if rank == 0:
        model.config.save_pretrained(folder)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
        torch.save({"output_dir": out}, folder / "training_args.bin")
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    dist.destroy_process_group()


def main() -> None:
    model_dir, out, step, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    spawn(_rank, world, model_dir, out, step, world)


if __name__ == "__main__":
    main()
