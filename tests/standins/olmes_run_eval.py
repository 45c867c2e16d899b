"""A stand-in for OLMES (`olmes`, which resolves the task specs, then `oe_eval.run_eval`),
written from OLMES's source (oe_eval/launch.py, run_eval.py, utils.py; ../shared/FACTS.md,
"Other harnesses"), as it cannot be installed in CI (not on PyPI, git-only dependencies):

- the same CLI; `--limit` a float (a whole number but 1.0 is a count, anything else a fraction
  of each task's instances: `make_int(..., exclude_float1=True)`), also settable per task or
  in `--task-args`, never both;
- task specs resolved as `launch.py` does: a named config (`gsm8k::tulu`) is its registered
  config with `metadata.alias` = the name; a JSON object is merged over the registered config
  of its `task_name` when there is one (no alias then), else taken as it is; a suite is its
  tasks; a `.jsonl` file is its configs;
- the same files: per task `task-{idx:03d}-{task_name}-predictions.jsonl` and `-metrics.json`
  (`task_file_name`: the task's index and its *base* task name, so two variants of one task
  differ by index only), each metrics object with its `task_idx`, then `metrics-all.jsonl`
  and `metrics.json`;
- the same `CUDA_VISIBLE_DEVICES` rewrite as its vLLM class (one visible GPU -> "0"). Its
  "engine" is a subprocess that reports what it sees.

Scores are derived from the checkpoint's own files and the task's config (its variant), so a
ledger line says which checkpoint and which variant it was computed from. Standard library
only (it runs in a bare virtualenv of its own).
"""

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import zlib

DOCS = 10  # instances in each task's data
SUITES = {"tiny_suite": ["sums::tiny", "digits::tiny"]}
TASK_REGISTRY = {"sums", "digits", "gsm8k"}  # the base tasks run_eval can load
TASK_CONFIGS = {  # named configs (oe_eval/configs/tasks.py): several per base task
    "sums::tiny": {"task_name": "sums", "primary_metric": "exact_match", "num_shots": 0},
    "digits::tiny": {"task_name": "digits", "primary_metric": "exact_match", "num_shots": 0},
    "gsm8k::tulu": {
        "task_name": "gsm8k",
        "primary_metric": "exact_match",
        "num_shots": 8,
        "use_chat_format": True,
    },
    "gsm8k::olmes": {"task_name": "gsm8k", "primary_metric": "exact_match", "num_shots": 8},
}


def make_int(f, exclude_float1=False):
    if not isinstance(f, float):
        return f
    if f.is_integer() and (not exclude_float1 or f != 1.0):
        return int(f)
    return f


def resolve(specs):
    """launch.py's task resolution."""
    out = []
    names = []
    for spec in specs:
        names += SUITES.get(spec, [spec])
    for spec in names:
        if spec.endswith(".jsonl"):
            with open(spec) as f:
                out += [json.loads(x) for x in f if x.strip()]
        elif spec in TASK_CONFIGS:
            config = copy.deepcopy(TASK_CONFIGS[spec])
            config.setdefault("metadata", {})["alias"] = spec
            out.append(config)
        elif spec.startswith("{"):
            given = json.loads(spec)
            base = copy.deepcopy(TASK_CONFIGS.get(given["task_name"], {}))
            out.append(base | given)
        else:
            sys.exit(f"ValueError: No config found for task: {spec}")
    return out


def limited(n, limit):
    """base_task.py: a float is a fraction of the instances, an int a count."""
    if limit is None:
        return n
    if isinstance(limit, float):
        limit = math.ceil(n * limit)
    return min(n, limit)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--model-type", default="hf")
    p.add_argument("--model-args", default="{}")
    p.add_argument("--task", nargs="+", required=True)
    p.add_argument("--limit", type=float)
    p.add_argument("--task-args")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args()
    tasks = resolve(a.task)
    overrides = json.loads(a.task_args) if a.task_args else {}
    if a.limit is not None:
        if "limit" in overrides:
            sys.exit("ValueError: Cannot override limit both in --task-args and --limit!")
        overrides["limit"] = make_int(a.limit, exclude_float1=True)
    tasks = [t | overrides for t in tasks]
    for t in tasks:
        if t["task_name"] not in TASK_REGISTRY:
            sys.exit(f"ValueError: Task {t['task_name']} not found in the task registry!")
    if a.dry_run:
        print(json.dumps(tasks))
        return
    model_path = json.loads(a.model_args)["model_path"]
    tok = os.path.join(model_path, "tokenizer_config.json")
    if os.path.exists(tok) and json.load(open(tok)).get("tokenizer_class") == "TokenizersBackend":
        sys.exit(
            "ValueError: Tokenizer class TokenizersBackend does not exist or is not currently imported."
        )  # transformers 4
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if a.model_type == "vllm" and visible and visible != "-1" and "," not in visible:
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # what OLMES's vLLM class does
    os.makedirs(a.output_dir, exist_ok=True)
    engine = "import json, os, sys; json.dump({'CUDA_VISIBLE_DEVICES': os.environ.get('CUDA_VISIBLE_DEVICES')}, open(sys.argv[1], 'w'))"
    subprocess.run(
        [sys.executable, "-c", engine, os.path.join(a.output_dir, "engine-seen.json")], check=True
    )
    with open(os.path.join(model_path, "config.json"), "rb") as f:
        seed = zlib.crc32(f.read())
    all_lines = []
    for idx, config in enumerate(tasks):
        name = config["task_name"]
        variant = variant_key(config)
        preds = []
        for d in range(limited(DOCS, config.get("limit"))):
            right = (seed + zlib.crc32(f"{variant}:{d}".encode())) % 3 != 0
            preds.append(
                {
                    "doc_id": d,
                    "native_id": f"{name}-{d}",
                    "metrics": {"exact_match": float(right)},
                    "model_output": [
                        {
                            "continuation": f"{variant} {'yes' if right else 'no'}",
                            "sum_logits": -1.0,
                            "num_tokens": 1,
                        }
                    ],
                    "label": "yes",
                }
            )
        score = sum(x["metrics"]["exact_match"] for x in preds) / len(preds)
        stem = os.path.join(a.output_dir, f"task-{idx:03d}-{name}")  # utils.task_file_name
        with open(stem + "-predictions.jsonl", "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in preds)
        entry = {
            "task_name": name,
            "task_hash": f"{zlib.crc32(variant.encode()):08x}",
            "model_hash": "m",
            "task_config": config,
            "num_instances": len(preds),
            "metrics": {"exact_match": score, "primary_score": score},
            "task_idx": idx,
        }
        with open(stem + "-metrics.json", "w") as f:
            json.dump(entry, f)
        all_lines.append(entry)

    def alias(m):
        return (m["task_config"].get("metadata") or {}).get("alias", m["task_name"])

    with open(os.path.join(a.output_dir, "metrics-all.jsonl"), "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in all_lines)
    with open(os.path.join(a.output_dir, "metrics.json"), "w") as f:
        json.dump(
            {
                "all_primary_scores": [
                    f"{alias(x)}: {x['metrics']['primary_score']:.6}" for x in all_lines
                ],
                "tasks": [
                    {
                        "alias": alias(x),
                        "metrics": x["metrics"],
                        "num_instances": x["num_instances"],
                    }
                    for x in all_lines
                ],
            },
            f,
        )


def variant_key(config):
    """What decides a task's answers here: its config but the instances asked for."""
    scored = {k: v for k, v in config.items() if k not in ("limit", "metadata")}
    return json.dumps(scored, sort_keys=True)


if __name__ == "__main__":
    main()
