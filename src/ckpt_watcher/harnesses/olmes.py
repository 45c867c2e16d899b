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
    task_args = dict(spec.get("task_args") or {})
    n = olmes_limit(spec, limit)
    if n is not None:
        # in --task-args, where a count stays a JSON integer: `--limit` is parsed as a float,
        # and OLMES reads 1.0 as the whole of each task, not one instance
        task_args["limit"] = n
    if task_args:
        argv += ["--task-args", json.dumps(task_args, sort_keys=True)]
    return argv


def olmes_limit(spec: dict[str, Any], limit: float | None) -> int | float | None:
    """The instances of each task OLMES is asked for: the entry's own `limit`, else
    `eval.limit` as lm-eval reads it (below 1 a fraction of each task, else a count)."""
    if spec.get("limit"):
        return int(spec["limit"])
    if limit is None:
        return None
    return limit if limit < 1 else int(limit)


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

    def total(self, ctx: Context) -> int | None:
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
        parts = [_part(out, t, name) for t, name in zip(tasks, _names(tasks), strict=True)]
        if len(parts) == 1:  # one OLMES task: the entry's own line
            (p,) = parts
            return Parsed(
                p["metrics"], p["n_samples"], p.pop("records"), results_file=p["results_file"]
            )
        for p in parts:
            _write_records(p, ctx)
        return Parsed({}, None, parts=parts, results_file=str(path))


def _alias(task: dict[str, Any]) -> str:
    """What OLMES itself calls the task in its summary: its alias, else its task name."""
    config = task.get("task_config") or {}
    return str(
        (config.get("metadata") or {}).get("alias")
        or config.get("task_name")
        or task.get("task_name")
    )


def _names(tasks: list[dict[str, Any]]) -> list[str]:
    """Each task's part name: its alias; tasks that share one (two JSON configs of one task) are
    told apart by their task index (`gsm8k@2`), so each is a line of its own and the entry
    counts as done once all are in."""
    aliases = [_alias(t) for t in tasks]
    names = [
        f"{a}@{t['task_idx']}" if aliases.count(a) > 1 and t.get("task_idx") is not None else a
        for a, t in zip(aliases, tasks, strict=True)
    ]
    twins = sorted({n for n in names if names.count(n) > 1})
    if twins:
        raise EvalError(f"olmes wrote several results named {', '.join(twins)}, no index apart")
    return names


def task_file(out: Path, task: dict[str, Any], kind: str) -> Path | None:
    """A task's own file in OLMES's output folder (`oe_eval.utils.task_file_name`: its index
    and its base task name, `task-001-gsm8k-metrics.json`); None for an aggregate of several
    tasks (`task_idx` null), which has none."""
    idx = task.get("task_idx")
    if idx is None:
        return None
    base = task.get("task_name") or (task.get("task_config") or {}).get("task_name")
    return out / f"task-{int(idx):03d}-{base}-{kind}"


def _part(out: Path, task: dict[str, Any], name: str) -> dict[str, Any]:
    """One OLMES task: its metrics (all of them, `primary_score` among them), instances and
    per-instance records, from the files of its own index."""
    metrics = dict(task.get("metrics") or {})
    if "primary_score" not in metrics:
        raise EvalError(f"olmes task {_alias(task)!r} has no primary_score in {METRICS_ALL}")
    predictions = task_file(out, task, "predictions.jsonl")
    metric_file = task_file(out, task, "metrics.json")
    records = []
    lines = []
    if predictions is not None and predictions.exists():
        lines = predictions.read_text(encoding="utf-8").splitlines()
    for line in lines:
        if not line.strip():
            continue
        row = json.loads(line)
        outputs = row.get("model_output") or []
        records.append(
            {
                "task": name,
                "doc_id": row.get("doc_id"),
                "prompt": row.get("native_id"),
                "target": row.get("label"),
                "responses": [o.get("continuation") if isinstance(o, dict) else o for o in outputs],
                "extracted": {},
                "scores": {f"{k},none": [v] for k, v in (row.get("metrics") or {}).items()},
            }
        )
    return {
        "task": name,
        "metrics": metrics,
        "n_samples": task.get("num_instances"),
        "results_file": str(metric_file) if metric_file and metric_file.exists() else None,
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
