"""`harness: olmes`: AI2's OLMES (`olmes`, module `oe_eval`) in its own virtualenv.

OLMES runs `python -m oe_eval.run_eval` with the first `python` on PATH, so its venv's `bin`
leads PATH (`interp.environment`). It is given the checkpoint as `--model-args
{"model_path": ...}` and writes, in its output folder, `metrics-all.jsonl` (one object per task:
`metrics` with `primary_score`, `task_config.metadata.alias`, `num_instances`) and per task
`task-NNN-<name>-predictions.jsonl`. Each OLMES task becomes one part of the entry's outcome
(one ledger line each, `task` = `<entry>/<alias>`; an entry of one task is one line under the
entry's name). OLMES's transformers is 4.x: a checkpoint saved by transformers 5 is given to it
through a view whose tokenizer config names a class 4.x has (`for_transformers4`).

OLMES has no GPU flag, and its vLLM class sets `CUDA_VISIBLE_DEVICES="0"` when one GPU is
visible: with the watcher's `GPU-<uuid>` (or `6`) that would start the engine on physical GPU 0,
training's. So the job's value is pinned in the OLMES process and in every process it starts:
a `sitecustomize` on PYTHONPATH (`pin/`) refuses any other value and says so in its log.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ckpt_watcher.errors import EvalError
from ckpt_watcher.harnesses import interp
from ckpt_watcher.harnesses.base import Context, Parsed, log_tail

MODEL_ALIAS = "ckpt-watcher"
PIN_DIR = Path(__file__).parent / "pin"
PIN_VAR = "CKPT_WATCHER_PIN_CUDA"
METRICS_ALL = "metrics-all.jsonl"


def olmes_argv(spec: dict[str, Any], checkpoint: str, out: Path, limit: float | None) -> list[str]:
    """The `olmes` command line for one checkpoint (also used with `--dry-run` at start)."""
    argv = [
        interp.program(spec, "olmes"),
        "--model",
        MODEL_ALIAS,
        "--model-type",
        spec.get("model_type", "hf"),
        "--model-args",
        json.dumps({"model_path": checkpoint} | (spec.get("model_args") or {}), sort_keys=True),
        "--task",
        *spec["task"],
        "--output-dir",
        str(out),
    ]
    n = spec.get("limit") or (int(limit) if limit is not None and limit >= 1 else None)
    if n:
        argv += ["--limit", str(int(n))]
    if spec.get("task_args"):
        argv += ["--task-args", json.dumps(spec["task_args"], sort_keys=True)]
    return argv


def olmes_environ(spec: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    """OLMES's environment: the job's GPU pinned, and what it needs offline (a user's own
    values win)."""
    env[PIN_VAR] = env.get("CUDA_VISIBLE_DEVICES", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PIN_DIR), env.get("PYTHONPATH")) if p)
    env.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    if "TIKTOKEN_CACHE_DIR" not in env and spec.get("venv"):
        found = sorted(
            Path(spec["venv"]).glob(
                "lib/python*/site-packages/litellm/litellm_core_utils/tokenizers"
            )
        )
        if found:
            env["TIKTOKEN_CACHE_DIR"] = str(found[0])
    return env


def for_transformers4(ckpt: Path, view: Path) -> Path:
    """The checkpoint as OLMES's transformers 4 can read it. transformers 5 saves
    `"tokenizer_class": "TokenizersBackend"`, a class 4.x does not have; then `view` is made: a
    link to each of the checkpoint's files but its tokenizer config, which is a copy naming
    `PreTrainedTokenizerFast` (the same tokenizer.json). The weights are the checkpoint's own."""
    config = ckpt / "tokenizer_config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ckpt
    if data.get("tokenizer_class") != "TokenizersBackend":
        return ckpt
    view.mkdir(parents=True, exist_ok=True)
    for item in ckpt.iterdir():
        if item.name != config.name and not (view / item.name).exists():
            (view / item.name).symlink_to(item.resolve())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    data.pop("backend", None)
    (view / config.name).write_text(json.dumps(data, indent=2), encoding="utf-8")
    return view


class OlmesHarness:
    def served(self, spec: dict[str, Any]) -> bool:
        return False

    def total(self, spec: dict[str, Any]) -> int | None:
        return None

    def argv(self, ctx: Context) -> list[str]:
        ckpt = for_transformers4(Path(ctx.checkpoint), ctx.output_dir / "checkpoint")
        return olmes_argv(ctx.spec, str(ckpt), ctx.output_dir / "olmes", ctx.limit)

    def environ(self, ctx: Context, env: dict[str, str]) -> dict[str, str]:
        return olmes_environ(ctx.spec, env)

    def read(self, ctx: Context, returncode: int) -> Parsed:
        out = ctx.output_dir / "olmes"
        if returncode != 0:
            raise EvalError(
                f"olmes exited with status {returncode}; its output ends:\n{log_tail(ctx)}"
            )
        path = out / METRICS_ALL
        if not path.exists():
            raise EvalError(f"olmes exited 0 but wrote no {METRICS_ALL} in {out}:\n{log_tail(ctx)}")
        tasks = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
        if not tasks:
            raise EvalError(f"{path} names no task")
        parts = [_part(out, t, i, ctx) for i, t in enumerate(tasks)]
        if len(parts) == 1:  # one OLMES task: the entry's own line
            (p,) = parts
            return Parsed(p["metrics"], p["n_samples"], p.pop("records"), results_file=str(path))
        for p in parts:
            _write_records(p, ctx)
        return Parsed({}, None, parts=parts, results_file=str(path))


def _alias(task: dict[str, Any]) -> str:
    config = task.get("task_config") or {}
    return str(
        (config.get("metadata") or {}).get("alias")
        or config.get("task_name")
        or task.get("task_name")
    )


def _part(out: Path, task: dict[str, Any], i: int, ctx: Context) -> dict[str, Any]:
    """One OLMES task: its metrics (all of them, `primary_score` among them), instances and
    per-instance records."""
    metrics = dict(task.get("metrics") or {})
    if "primary_score" not in metrics:
        raise EvalError(f"olmes task {_alias(task)!r} has no primary_score in {METRICS_ALL}")
    name = (task.get("task_config") or {}).get("task_name") or task.get("task_name") or _alias(task)
    predictions = sorted(out.glob(f"task-*-{name}-predictions.jsonl"))
    metric_files = sorted(out.glob(f"task-*-{name}-metrics.json"))
    records = []
    for line in predictions[0].read_text(encoding="utf-8").splitlines() if predictions else []:
        if not line.strip():
            continue
        row = json.loads(line)
        outputs = row.get("model_output") or []
        records.append(
            {
                "task": _alias(task),
                "doc_id": row.get("doc_id"),
                "prompt": row.get("native_id"),
                "target": row.get("label"),
                "responses": [o.get("continuation") if isinstance(o, dict) else o for o in outputs],
                "extracted": {},
                "scores": {f"{k},none": [v] for k, v in (row.get("metrics") or {}).items()},
            }
        )
    return {
        "task": _alias(task),
        "metrics": metrics,
        "n_samples": task.get("num_instances"),
        "results_file": str(metric_files[0]) if metric_files else None,
        "records": records,
    }


def _write_records(part: dict[str, Any], ctx: Context) -> None:
    from ckpt_watcher.evaluators.harness import safe_filename, write_samples

    records = part.pop("records")
    if records:
        path = ctx.output_dir / f"samples_{safe_filename(part['task'])}.jsonl.gz"
        write_samples(path, records)
        part["samples_file"] = str(path)


def dry_run_problem(spec: dict[str, Any]) -> str | None:
    """`olmes --dry-run` of the entry's task specs: None if they resolve, else what it said."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        try:
            argv = olmes_argv(spec, "/nonexistent-checkpoint", Path(tmp), None) + ["--dry-run"]
        except FileNotFoundError as e:
            return str(e)
        env = olmes_environ(spec, interp.environment(spec))
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"olmes --dry-run did not run: {e}"
    if r.returncode == 0:
        return None
    said = [ln for ln in (r.stderr + r.stdout).strip().splitlines() if ln.strip()]
    return f"olmes --dry-run of {spec['task']} failed: {said[-1] if said else f'exit status {r.returncode}'}"


OLMES = OlmesHarness()
