"""What a verl step costs before its eval: converting its FSDP shards into a Hugging Face folder
(formats/verl_fsdp.py, as the worker runs it), side by side with verl's own merger
(`python -m verl.model_merger merge --backend fsdp`) on the same folder, each in a fresh process.

The folders are what verl's FSDPCheckpointManager writes for a real model's shape (Qwen3-0.6B,
random fp32 weights: no model hub here), saved by W gloo ranks on this CPU (fsdp_shards.py:
each rank's `torch.save` of its DTensors), with `fsdp_config.json` and `huggingface/` (config,
a tokenizer). verl's merger always writes bf16; ours writes what was
saved (fp32) unless told, so ours is timed both ways.

Prints per world size: seconds and peak RSS of each, and the ratios. The shards are read once
before the three are timed, so each reads them from the page cache (the first to run would
otherwise pay the disk alone).
Usage: python bench/native_convert.py [--ranks 2 8] [--shape qwen3-0.6b|tiny] [--work /tmp/bench-native]
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
    "tiny": {**QWEN3_0_6B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 64},
}  # fmt: skip

OURS = """
import resource, sys, time
from pathlib import Path
from ckpt_watcher.formats import detect
from ckpt_watcher.checkpoints.files import LocalFiles
t = time.monotonic()
src, out, dtype = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] or None
detect(LocalFiles(src).files).convert(src, out, dtype, lambda done, total: None)
print(time.monotonic() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

VERL = """
import resource, runpy, sys, time
t = time.monotonic()
sys.argv = ["verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", sys.argv[1], "--target_dir", sys.argv[2]]
try:
    runpy.run_module("verl.model_merger", run_name="__main__")
finally:
    print(time.monotonic() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def shapes_of(sizes: dict) -> dict[str, list[int]]:
    """Every tensor a Qwen3 causal LM of these sizes has in its state dict (the tied head too,
    as FSDP's state dict lists it)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**sizes))
    return {k: list(v.shape) for k, v in model.state_dict(keep_vars=False).items()}


def build(folder: Path, world: int, sizes: dict) -> None:
    from transformers import Qwen3Config

    from ckpt_watcher.demo.tiny import build_tokenizer

    folder.mkdir(parents=True)
    hf = folder / "huggingface"
    Qwen3Config(**sizes, architectures=["Qwen3ForCausalLM"]).save_pretrained(hf)
    build_tokenizer().save_pretrained(hf)
    (folder / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    shapes = json.dumps(shapes_of(sizes))
    saver = Path(__file__).parent / "fsdp_shards.py"
    subprocess.run([sys.executable, str(saver), str(folder), str(world), shapes], check=True)


def timed(code: str, *args: str) -> tuple[float, float]:
    """(seconds, peak RSS in GiB) of a fresh process running `code`, from its start to its
    end (imports included: verl's merger imports verl, ours torch)."""
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    seconds = time.monotonic() - t
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    lines = (r.stdout if code is OURS else r.stderr).strip().splitlines()
    return seconds, int(lines[-1].split()[1]) / 2**20


def size_gib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-native"))
    args = ap.parse_args()
    for world in args.ranks:
        src = args.work / f"{args.shape}-w{world}" / "actor"
        if not (src / f"model_world_size_{world}_rank_{world - 1}.pt").exists():
            shutil.rmtree(src.parent, ignore_errors=True)
            t = time.monotonic()
            build(src, world, SHAPES[args.shape])
            print(f"saved {args.shape} over {world} ranks in {time.monotonic() - t:.0f}s")
        shards = sum(p.stat().st_size for p in src.glob("model_world_size_*.pt")) / 2**30
        print(f"W={world}: model shards {shards:.2f} GiB (fp32)")
        for p in src.glob("model_world_size_*.pt"):  # all three read them from the page cache
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass
        results = {}
        for label, code, dtype in (
            ("ours fp32", OURS, ""),
            ("ours bf16", OURS, "bfloat16"),
            ("verl merger", VERL, None),
        ):
            out = args.work / "out"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            extra = [dtype] if dtype is not None else []
            seconds, rss = timed(code, str(src), str(out), *extra)
            results[label] = (seconds, rss)
            print(
                f"  {label:12s} {seconds:6.1f}s  peak RSS {rss:5.2f} GiB  wrote {size_gib(out):.2f} GiB"
            )
            shutil.rmtree(out, ignore_errors=True)
        (vs, vr) = results["verl merger"]
        for label in ("ours fp32", "ours bf16"):
            s, r = results[label]
            print(f"  {label} / verl merger: time {s / vs:.2f}, peak RSS {r / vr:.2f}")


if __name__ == "__main__":
    main()
