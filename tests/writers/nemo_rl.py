"""A NeMo-RL step as its DTensor policy saves it by default (`model_save_format: safetensors`,
`save_consolidated: false`): each of W gloo ranks writes its dim-0 slice of every tensor with
torch's own `HuggingFaceStorageWriter(save_distributed=True)` (what NeMo Automodel's checkpointer
calls) as `policy/weights/model/shard-{R+1:05d}-model-00001-of-00001.safetensors`; rank 0 adds
`.hf_metadata/` (config, generation config, the fqn-to-file mapping) and `policy/tokenizer/`;
the step is written as `tmp_step_N` and renamed `step_N` once whole, as NeMo-RL's checkpoint
manager does.

Usage: python tests/writers/nemo_rl.py MODEL OUT STEP RANKS
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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    tmp = Path(out) / f"tmp_step_{step}"
    weights = tmp / "policy" / "weights" / "model"
    state = model.state_dict()
    writer = HuggingFaceStorageWriter(
        path=str(weights), save_distributed=True, fqn_to_index_mapping=dict.fromkeys(state, 1)
    )
    dcp.save(state, storage_writer=writer)
    dist.barrier()
    if rank == 0:
        meta = weights / ".hf_metadata"
        meta.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(meta)
        model.generation_config.save_pretrained(meta)
        (meta / "fqn_to_file_index_mapping.json").write_text(json.dumps(dict.fromkeys(state, 1)))
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp / "policy" / "tokenizer")
        torch.save({}, tmp / "train_dataloader.pt")
        tmp.rename(Path(out) / f"step_{step}")
    dist.destroy_process_group()


def main() -> None:
    model_dir, out, step, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    spawn(_rank, world, model_dir, out, step, world)


if __name__ == "__main__":
    main()
