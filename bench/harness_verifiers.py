"""verifiers per checkpoint: the watcher (`watcher once`: daemon, loopback server, proxy, vf-eval,
ledger) vs what a team's script does by hand (start vLLM's OpenAI server on the checkpoint, wait
for it, run vf-eval against it, stop it), same checkpoint, taskset and sampling, alternated
A B A B in one run; the metrics of each pair compared (greedy, so equal).

Also reported: the server's start (the watcher's `engine_seconds`) as a share of each run.
Target: wall ratio (watcher / by hand) at most 1.05, metrics equal.
Usage: python bench/harness_verifiers.py --venv /path/to/vf-venv [--rounds 2]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml
from common import WATCHER, summary, trained_checkpoint

from ckpt_watcher.harnesses.verifiers import read_traces, score

TASKSETS = Path(__file__).resolve().parent.parent / "tests" / "tasksets"
EXAMPLES, ROLLOUTS, MAX_TOKENS = 8, 2, 8
MODEL_ARGS = {
    "dtype": "float32",
    "max_model_len": 64,
    "enforce_eager": True,
    "gpu_memory_utilization": 0.5,
}


def by_hand(ckpt: Path, venv: Path, out: Path, template: Path) -> tuple[float, dict]:
    port = 18123
    env = dict(
        os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", CUDA_VISIBLE_DEVICES="-1"
    )
    server = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(ckpt),
        "--served-model-name",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--seed",
        "42",
        "--dtype",
        "float32",
        "--max-model-len",
        "64",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.5",
        "--chat-template",
        str(template),
    ]
    t0 = time.perf_counter()
    with open(out.parent / "server.log", "wb") as log:
        proc = subprocess.Popen(server, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None:
                raise SystemExit("the server died; see server.log")
            time.sleep(0.5)
        vf = [
            str(venv / "bin" / "vf-eval"),
            "wt_add2d",
            "-m",
            "m",
            "--client.base-url",
            f"http://127.0.0.1:{port}/v1",
            "--client.api-key-var",
            "KEY",
            "-n",
            str(EXAMPLES),
            "-r",
            str(ROLLOUTS),
            "--sampling.temperature",
            "0",
            "--sampling.max-tokens",
            str(MAX_TOKENS),
            "-o",
            str(out),
            "--run.name",
            "run",
            "--env.agent.harness.id",
            "null",
            "--env.agent.runtime.type",
            "subprocess",
            "--no-push",
            "--no-rich",
        ]
        vf_env = dict(
            os.environ,
            KEY="x",
            PYTHONPATH=str(TASKSETS),
            PATH=f"{venv / 'bin'}:{os.environ['PATH']}",
        )
        subprocess.run(vf, env=vf_env, check=True, capture_output=True)
    finally:
        proc.terminate()
        proc.wait()
    took = time.perf_counter() - t0
    return took, score(read_traces(out / "run" / "traces.jsonl"), "sums").metrics


def through_watcher(
    ckpt: Path, venv: Path, root: Path, template: Path
) -> tuple[float, dict, float]:
    watch = root / "ckpts" / "run1"
    watch.mkdir(parents=True)
    shutil.copytree(ckpt, watch / "step_300")
    cfg = root / "w.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(root / "state"),
                "ledger_dir": str(root / "ledgers"),
                "settle_seconds": 0,
                "sources": [{"kind": "local", "path": str(root / "ckpts")}],
                "devices": {"gpus": [], "cpu_slots": 1},
                "eval": {
                    "backend": "vllm",
                    "model_args": MODEL_ARGS,
                    "tasks": [
                        {
                            "harness": "verifiers",
                            "name": "sums",
                            "venv": str(venv),
                            "env_id": "wt_add2d",
                            "num_examples": EXAMPLES,
                            "rollouts": ROLLOUTS,
                            "sampling": {"temperature": 0, "max_tokens": MAX_TOKENS},
                            "chat_template": str(template),
                            "env": {"PYTHONPATH": str(TASKSETS)},
                        }
                    ],
                },
            }
        )
    )
    t0 = time.perf_counter()
    subprocess.run([*WATCHER, "once", "-c", str(cfg)], check=True, capture_output=True)
    took = time.perf_counter() - t0
    (line,) = [
        json.loads(x) for x in (root / "ledgers" / "run1" / "ledger.jsonl").read_text().splitlines()
    ]
    return took, line["metrics"], line["engine_seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--venv", type=Path, default=Path(os.environ.get("CKPT_WATCHER_VERIFIERS_VENV", ""))
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-harness-verifiers"))
    args = ap.parse_args()
    if not (args.venv / "bin" / "vf-eval").exists():
        raise SystemExit(
            "--venv must be a virtualenv with verifiers 0.4 (pip install verifiers uv)"
        )
    ckpt = trained_checkpoint(args.work)
    ready = args.work / "ready"  # the naming bug fixed, as the watcher serves it
    if not ready.exists():
        shutil.copytree(ckpt, ready)
        (ready / "model.safetensors.index.json").unlink(missing_ok=True)
    template = args.work / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    hand, ours, starts = [], [], []
    for i in range(args.rounds):
        for d in ("hand", "ours"):
            shutil.rmtree(args.work / f"{d}{i}", ignore_errors=True)
            (args.work / f"{d}{i}").mkdir()
        t, m_hand = by_hand(ready, args.venv, args.work / f"hand{i}" / "out", template)
        hand.append(t)
        t, m_ours, start = through_watcher(ready, args.venv, args.work / f"ours{i}", template)
        ours.append(t)
        starts.append(start)
        same = all(abs(m_ours[k] - v) < 1e-12 for k, v in m_hand.items())
        print(
            f"round {i}: by hand {hand[-1]:.1f}s  watcher {ours[-1]:.1f}s  server start {start:.1f}s  metrics equal: {same}  {m_ours}"
        )
    print(f"by hand: {summary(hand)}")
    print(f"watcher: {summary(ours)}")
    print(f"server start in the watcher: {summary(starts)}")
    print(
        f"ratio (median watcher / median by hand): {sorted(ours)[len(ours) // 2] / sorted(hand)[len(hand) // 2]:.3f}"
    )


if __name__ == "__main__":
    main()
