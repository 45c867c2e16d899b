"""What evaluating a LoRA adapter saved alone costs before its eval begins: the worker's merge
(worker/merge.py: the base loaded on the CPU, the adapter merged in, the merged copy saved),
each round in a fresh process (as a worker does it), at a real model's shape with random
weights (no model hub here) and a rank-16 adapter on every projection.

Prints, per round: the imports, the merge (load + merge + save), the process's peak memory
(RSS) against the base's size, and the merged copy's size on disk.
Usage: python bench/adapter_merge.py [--shape qwen3-0.6b|tiny] [--rounds 2] [--work /tmp/bench-merge]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import QWEN3_0_6B

SHAPES = {
    "qwen3-0.6b": QWEN3_0_6B,
    "tiny": {
        **QWEN3_0_6B,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 32,
        "tie_word_embeddings": False,
    },
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

BUILD = """
import json, sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen3Config
base, adapter, sizes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(Qwen3Config(**sizes), dtype=torch.bfloat16)
model.save_pretrained(base)
peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=json.loads(sys.argv[4])))
with torch.no_grad():
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            p.normal_(0, 0.01)
peft.save_pretrained(adapter)
"""

MERGE = """
import resource, sys, time
from pathlib import Path
t = time.monotonic()
import peft, torch, transformers
from ckpt_watcher.worker.merge import merge
imports = time.monotonic() - t
t = time.monotonic()
merge(Path(sys.argv[2]), Path(sys.argv[1]), Path(sys.argv[3]))
print(imports, time.monotonic() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def run(code: str, *args: str) -> tuple[float, float, float]:
    """(seconds importing, seconds merging and saving, peak RSS in GiB) of a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True
    ).stdout.split()
    return float(out[-3]), float(out[-2]), int(out[-1]) / 2**20


def size_gib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.iterdir()) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-merge"))
    args = ap.parse_args()
    base, adapter = args.work / f"base-{args.shape}", args.work / f"adapter-{args.shape}"
    if not (adapter / "adapter_config.json").exists():
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        t = time.monotonic()
        subprocess.run(
            [
                sys.executable,
                "-c",
                BUILD,
                str(base),
                str(adapter),
                json.dumps(SHAPES[args.shape]),
                json.dumps(TARGETS),
            ],
            check=True,
        )
        print(f"built base and rank-16 adapter ({args.shape}) in {time.monotonic() - t:.0f}s")
    print(f"base {size_gib(base):.2f} GiB, adapter {size_gib(adapter) * 1024:.1f} MiB")
    for i in range(args.rounds):
        out = args.work / "merged"
        shutil.rmtree(out, ignore_errors=True)
        imports, merge, rss = run(MERGE, str(base), str(adapter), str(out))
        print(
            f"round {i + 1}: imports {imports:.1f}s (torch, transformers, peft: a worker has the "
            f"first two already); load, merge and save {merge:.1f}s; peak {rss:.2f} GiB "
            f"({rss / size_gib(base):.1f}x the base); merged copy {size_gib(out):.2f} GiB"
        )
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
