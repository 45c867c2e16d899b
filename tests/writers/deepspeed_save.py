"""DeepSpeed's own `engine.save_checkpoint` of a Hugging Face model over gloo ranks on the CPU,
as OpenRLHF saves its actor by default: ZeRO stage 1, 2 or 3 with bf16 (OpenRLHF's default
precision), into `<out>/_actor/global_step<N>/`, DeepSpeed writing its `latest` file last.

Usage: python tests/writers/deepspeed_save.py MODEL OUT STEP STAGE RANKS

One optimizer step is taken with a learning rate of 0: the optimizer states hold AdamW's
moments, as a trainer's save does (with the fp32 weights, 12 bytes a parameter), and the saved
weights stay MODEL's (ZeRO-1/2 keep them in bf16 in the model states, ZeRO-3 in fp32 in its
optimizer states' flat partitions).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from spawn import spawn


def _rank(
    rank: int, model_dir: str, out: str, step: int, stage: int, world: int, port: int
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR="cpu",
    )
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    # DeepSpeed's CPU collectives over shared memory are a C++ op it builds on first use (46 s
    # of g++ on a fresh machine); gloo's own do the same exchanges, and the save is the same
    # (`deepspeed.comm.torch` is torch itself there: the module is looked up by name)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    deepspeed.init_distributed(dist_backend="gloo")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "torch_adam": True}},
        "bf16": {"enabled": True},
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    ids = torch.tensor([[1, 2, 3, 4]])
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(str(Path(out) / "_actor"), tag=f"global_step{step}")


def main() -> None:
    model_dir, out, step, stage, world = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    os.environ["DS_ACCELERATOR"] = "cpu"  # read by `import deepspeed`, in the fork server
    spawn(_rank, world, model_dir, out, step, stage, world, preload=("deepspeed",))


if __name__ == "__main__":
    main()
