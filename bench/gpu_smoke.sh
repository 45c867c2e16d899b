#!/usr/bin/env bash
# GPU smoke test, for a machine with one NVIDIA GPU (never part of CI; skipped without a GPU):
#   1. real NVML discovery: the daemon's inventory lists the GPU by UUID, and workers are pinned
#      with CUDA_VISIBLE_DEVICES=GPU-<uuid>;
#   2. three small checkpoints built here (tied embeddings, as Qwen3's small models), evaluated
#      cold (a fresh worker and engine per checkpoint) and warm (one worker, weights swapped in),
#      TP=1, bf16, on BACKEND (vllm when importable, else hf);
#   3. the warm results against the cold ones: a greedy task's metrics equal; a likelihood
#      task's within a stated tolerance (a GPU's bf16 sums in another order between two loads:
#      perplexity within 1% relative, accuracy within 0.02); prints the largest deviation, and
#      the quick check's time (the proof of swaps on the first cold engine).
# Prints one figure line ("gpu_smoke: ..."); exit 0 when all holds, 1 when not, 0 with "skipped".
# Usage: bash bench/gpu_smoke.sh   (PYTHON=python3 BACKEND=vllm|hf SIZE=tiny|0.6b WORK=/tmp/gpu_smoke)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/gpu_smoke}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_smoke: skipped (no NVIDIA GPU here)"
  exit 0
fi
if [ -z "${BACKEND:-}" ]; then
  if "$PY" -c "import vllm" >/dev/null 2>&1; then BACKEND=vllm; else BACKEND=hf; fi
fi
rm -rf "$WORK" && mkdir -p "$WORK"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" - "$WORK" "$BACKEND" "${SIZE:-tiny}" <<'EOF'
import json, shutil, subprocess, sys, time
from pathlib import Path

import yaml

work, backend, size = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
from ckpt_watcher.config import DevicesConfig
from ckpt_watcher.demo.tiny import VLLM_HEADS, write_task
from ckpt_watcher.demo.train import train
from ckpt_watcher.devices import build_inventory

# 1. NVML, as the daemon sees it
inventory, warnings = build_inventory(DevicesConfig())
gpus = [d for d in inventory.devices() if d.kind == "cuda"]
print(f"NVML: {[(d.label, d.visible) for d in gpus]} {warnings or ''}", flush=True)
assert gpus and all(d.visible.startswith("GPU-") for d in gpus), "no GPU found by UUID"

# 2. three checkpoints with tied embeddings: the tiny Llama trained on the CPU (SIZE=tiny), or
#    Qwen3-0.6B's shape (28 layers, hidden 1024, vocabulary 151936; ~0.6B parameters, 1.2 GB in
#    bf16) with random weights, one seed each (SIZE=0.6b: engine and swap times at a real size)
began = time.monotonic()
if size == "tiny":
    ckpts = train(work / "trained", run="smoke", steps=300, save_every=100, heads=VLLM_HEADS,
                  tie_word_embeddings=True, threads=8)
else:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from ckpt_watcher.demo.tiny import build_tokenizer, save_checkpoint
    tok, ckpts = build_tokenizer(), []
    for seed, step in enumerate((100, 200, 300)):
        torch.manual_seed(seed)
        shape = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                            num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                            head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True)
        model = Qwen3ForCausalLM(shape).to(torch.bfloat16)
        ckpts.append(work / "trained" / f"smoke_step{step}")
        save_checkpoint(model, tok, ckpts[-1], naming_bug=False)
print(f"built 3 checkpoints ({size}) in {time.monotonic() - began:.1f} s", flush=True)
tasks = write_task(work / "tasks")
data = next(tasks.glob("*.jsonl"))
(tasks / "addition_ll.yaml").write_text(
    "task: addition_ll\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
    f"    test: {data}\ntest_split: test\noutput_type: loglikelihood\n"
    'doc_to_text: "{{a}}+{{b}}="\ndoc_to_target: "{{answer}}"\ntarget_delimiter: ""\n'
    "metric_list:\n  - metric: perplexity\n  - metric: acc\n"
)

def evaluate(mode: str) -> tuple[list[dict], float]:
    d = work / mode
    for ck in ckpts:
        shutil.copytree(ck, d / "watch" / ck.name)
    model_args = {"dtype": "bfloat16", "max_model_len": 64}
    if backend == "vllm":
        model_args |= {"gpu_memory_utilization": 0.3}
    cfg = {
        "state_dir": str(d / "state"), "ledger_dir": str(d / "ledgers"), "stable_seconds": 1,
        "sources": [{"kind": "local", "path": str(d / "watch"), "poll_seconds": 1}],
        # idle_memory_mib 0: any process not ours on the GPU makes it busy, so a warm worker
        # holding memory between jobs must be counted as ours for the next job to start
        "devices": {"cpu_slots": 0, "idle_memory_mib": 0},
        "eval": {"backend": backend, "model_args": model_args, "batch_size": 32,
                 "include_path": str(tasks), "warm_engine": mode == "warm", "max_attempts": 1,
                 "tasks": [{"task": "addition", "num_fewshot": 0},
                           {"task": "addition_ll", "num_fewshot": 0}]},
    }
    (d / "w.yaml").write_text(yaml.safe_dump(cfg))
    began = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ckpt_watcher", "once", "-c", str(d / "w.yaml")],
                       capture_output=True, text=True, timeout=1800)
    seconds = time.monotonic() - began
    lines = [json.loads(x) for x in (d / "ledgers" / "smoke" / "ledger.jsonl").read_text().splitlines()]
    if r.returncode != 0:
        print(r.stderr[-3000:], file=sys.stderr)
    pinned = {ln.split("CUDA_VISIBLE_DEVICES=")[1].split()[0] for p in (d / "state" / "jobs").rglob("worker.log")
              for ln in p.read_text(errors="replace").splitlines() if "CUDA_VISIBLE_DEVICES=GPU-" in ln}
    print(f"{mode}: {len(lines)} lines in {seconds:.1f} s, rc {r.returncode}, pinned {sorted(pinned)}", flush=True)
    return lines, seconds

# 3. a GPU that training uses is never used: a process not ours holds 2 GiB on it (more than
#    devices.idle_memory_mib, 1024): no job may start until it lets go. It sits idle, so the
#    zombie watch (after 5 s here) should list it too
hog = subprocess.Popen(
    [sys.executable, "-c", "import time, torch; x = torch.empty(2 << 30, dtype=torch.uint8, "
     "device='cuda'); torch.cuda.synchronize(); print('holding', flush=True); time.sleep(900)"],
    stdout=subprocess.PIPE, text=True)
hog.stdout.readline()
d = work / "busy"
shutil.copytree(ckpts[0], d / "watch" / ckpts[0].name)
(d / "w.yaml").write_text(yaml.safe_dump({
    "state_dir": str(d / "state"), "ledger_dir": str(d / "ledgers"), "stable_seconds": 1,
    "sources": [{"kind": "local", "path": str(d / "watch"), "poll_seconds": 1}],
    "devices": {"cpu_slots": 0, "zombie_after_seconds": 5},
    "eval": {"backend": backend, "model_args": {"dtype": "bfloat16", "max_model_len": 64},
             "include_path": str(tasks), "tasks": [{"task": "addition", "num_fewshot": 0}]}}))
watcher = [sys.executable, "-m", "ckpt_watcher"]
daemon = subprocess.Popen([*watcher, "run", "-c", str(d / "w.yaml")],
                          stdout=subprocess.DEVNULL, stderr=open(d / "daemon.log", "wb"))
time.sleep(25)
status = json.loads(subprocess.run([*watcher, "status", "-c", str(d / "w.yaml"), "--json"],
                                   capture_output=True, text=True).stdout)
ledger = d / "ledgers" / "smoke" / "ledger.jsonl"
held = {"lines": len(ledger.read_text().splitlines()) if ledger.exists() else 0,
        "queued": len(status["queue"]), "running": len(status["running"]),
        "zombie_listed": hog.pid in [z["pid"] for z in status["suspected_zombies"]]}
hog.kill(); hog.wait()
released = time.monotonic()
while time.monotonic() - released < 180 and not (ledger.exists() and ledger.read_text().strip()):
    time.sleep(0.5)
after = time.monotonic() - released if ledger.exists() and ledger.read_text().strip() else None
daemon.terminate(); daemon.wait(60)
# (the zombie listing needs NVML's per-process utilisation, which some drivers do not report)
busy_ok = (held["lines"], held["queued"], held["running"]) == (0, 1, 0) and after is not None
print(f"training-busy GPU: while held {held}; evaluated {after and round(after, 1)} s after release", flush=True)

cold, cold_s = evaluate("cold")
warm, warm_s = evaluate("warm")
metrics = lambda lines: {(l["step"], l["task"]): l["metrics"] for l in lines if l["status"] == "ok"}
# what equality holds where: greedy generation, equal on every backend; likelihoods on a GPU,
# within these tolerances (relative for perplexity, absolute for accuracies)
LIKELIHOOD_TOLERANCE = {"perplexity,none": ("relative", 1e-2), "acc,none": ("absolute", 0.02)}
deviations, broken = {}, []
cm, wm = metrics(cold), metrics(warm)
for key in sorted(cm.keys() | wm.keys()):
    for name in sorted((cm.get(key) or {}).keys() | (wm.get(key) or {}).keys()):
        a, b = (cm.get(key) or {}).get(name), (wm.get(key) or {}).get(name)
        if name.endswith("_stderr,none") or a == b:
            continue
        kind, limit = LIKELIHOOD_TOLERANCE.get(name, ("equal", 0.0))
        if key[1] != "addition_ll" or not isinstance(a, float) or not isinstance(b, float):
            kind, limit = "equal", 0.0
        dev = abs(a - b) / max(abs(a), 1e-12) if kind == "relative" else abs(a - b)
        deviations[f"{key[0]} {key[1]} {name} ({kind})"] = dev
        if kind == "equal" or dev > limit:
            broken.append(f"{key} {name}: cold {a} warm {b}")
equal = len(cold) == len(warm) == 6 and not broken
largest = max(deviations.items(), key=lambda kv: kv[1]) if deviations else ("none", 0.0)
quick = [e for p in (work / "warm" / "state" / "jobs" / "_warm").glob("*/engine.json")
         for e in json.loads(p.read_text())["events"] if e.get("check") == "quick"]
check = (f"quick check {quick[0]['event']} in {quick[0].get('permuted_s', 0) + quick[0].get('back_s', 0):.2f} s"
         if quick else "no quick check")
order = [l for l in warm if l["task"] == "addition"]
engines = [l["engine"] for l in order]
cold_engine = [l["engine_seconds"] for l in cold if l["task"] == "addition"]
warm_engine = [l["engine_seconds"] for l, e in zip(order, engines) if e == "warm"]
for l in cold + warm:
    print(f"  {l['engine']:>4} step {l['step']:>3} {l['task']:<12} {l['device']} "
          f"{ {k: round(v, 6) for k, v in l['metrics'].items() if isinstance(v, float)} }")
name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                      capture_output=True, text=True).stdout.strip().splitlines()[0]
print(
    f"gpu_smoke: {name}, backend {backend}, {size} model, bf16, TP=1, 3 checkpoints x 2 tasks: "
    f"cold {cold_s:.1f} s, warm {warm_s:.1f} s (ratio {warm_s / cold_s:.2f}); "
    f"engine ready cold {min(cold_engine):.2f}-{max(cold_engine):.2f} s, "
    f"warm swap {', '.join(f'{s:.2f}' for s in warm_engine) or 'none'} s; {check}; "
    f"engines {engines}; warm metrics {'AS CLAIMED' if equal else 'DIFFER: ' + '; '.join(broken)} "
    f"(greedy equal, likelihoods within tolerance; largest deviation {largest[1]:.2e}, "
    f"{largest[0]}); a GPU held by another process "
    f"{'was left alone until released' if busy_ok else 'WAS NOT HANDLED RIGHT'}"
)
sys.exit(0 if equal and "warm" in engines and busy_ok else 1)
EOF
