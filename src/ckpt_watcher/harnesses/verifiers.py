"""`harness: verifiers`: `vf-eval` against the checkpoint served on loopback.

`vf-eval` is told to stay local (no hosted API, no cloud sandbox, no upload) and to talk to the
worker's endpoint (`endpoint.py`). Its exit status is 0 even when every rollout failed, so the
verdict comes from what it wrote, in either format its users have:

- verifiers 0.4: `<out>/<run>/traces.jsonl`, one episode (rollout) per line: `task.data`
  (idx/id, prompt, answer), `ok`, `errors`, `traces[].rewards{name: {score, weight}}`;
- verifiers 0.3: `results.jsonl` (`example_id`, `reward`, one key per reward function) with
  `metadata.json` (`avg_reward`, `avg_metrics` naming the functions).

Metrics: `reward` (the weighted sum per rollout, its mean), `reward/<function>` (each
function's mean score), `reward_pass@<k>` for k up to the rollouts where every reward is 0 or 1
(unbiased, per example, then the mean), `error_rate` (errored rollouts' share). A result whose
error rate is above `max_error_rate` is failed, naming the first error.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ckpt_watcher.errors import EvalError
from ckpt_watcher.evaluators.passk import is_binary, pass_at_k
from ckpt_watcher.harnesses import interp
from ckpt_watcher.harnesses.base import Context, Parsed, log_tail

RUN_NAME = "run"
CONFIG_NAME = "vf-eval.json"  # see _config_file
API_KEY_VAR = "CKPT_WATCHER_ENDPOINT_KEY"  # the loopback endpoint takes any key


def examples(ctx: Context) -> int | None:
    """The examples vf-eval is asked for: the entry's `num_examples`, at most `eval.limit`
    (a count: config.py refuses a fraction for verifiers); None: all."""
    n = int(ctx.spec.get("num_examples", -1))
    if ctx.limit is not None:
        n = int(ctx.limit) if n <= 0 else min(n, int(ctx.limit))
    return n if n > 0 else None


class VerifiersHarness:
    def served(self, spec: dict[str, Any]) -> bool:
        return True

    def total(self, ctx: Context) -> int | None:
        n = examples(ctx)
        return n * int(ctx.spec.get("rollouts", 1)) if n is not None else None

    def argv(self, ctx: Context) -> list[str]:
        spec = ctx.spec
        argv = [
            interp.program(spec, "vf-eval"),
            spec["env_id"],
            "-m",
            ctx.model,
            "--client.base-url",
            ctx.url,
            "--client.api-key-var",
            API_KEY_VAR,
            "-r",
            str(spec.get("rollouts", 1)),
            "-o",
            str(ctx.output_dir),
            "--run.name",
            RUN_NAME,
            # stay on this host: no harness program, no sandbox
            "--env.agent.harness.id",
            "null",
            "--env.agent.runtime.type",
            "subprocess",
            "@",
            str(self._config_file(ctx)),
        ]
        n = examples(ctx)
        if n is not None:  # else all: vf-eval 0.4 refuses `-n -1`
            argv += ["-n", str(n)]
        if spec.get("concurrency"):
            argv += ["--max-concurrent", str(spec["concurrency"])]
        return argv + list(spec.get("extra_args") or [])

    @staticmethod
    def _config_file(ctx: Context) -> Path:
        """The rest of vf-eval's settings, as its `@ file`: no upload, plain output, and the
        entry's sampling and env_args. As `--sampling.<key>` flags, a value of a key vf-eval does
        not type (stop, logit_bias, ...) stays the string given: `stop: ["\\n"]` reached vLLM as
        the stop string `["\\n"]`. (With a file, vf-eval refuses `--no-push`/`--no-rich`.)"""
        spec = ctx.spec
        given: dict[str, Any] = {"push": False, "rich": None}
        if spec.get("sampling"):
            given["sampling"] = spec["sampling"]
        if spec.get("env_args"):
            given["env"] = {"taskset": spec["env_args"]}
        path = ctx.output_dir / CONFIG_NAME
        path.write_text(json.dumps(given, indent=1) + "\n")
        return path

    def environ(self, ctx: Context, env: dict[str, str]) -> dict[str, str]:
        env.setdefault(API_KEY_VAR, "local")
        env.setdefault("NO_COLOR", "1")
        return env

    def read(self, ctx: Context, returncode: int) -> Parsed:
        found = find_output(ctx.output_dir)
        if found is None:
            raise EvalError(
                f"vf-eval (exit status {returncode}) wrote no traces.jsonl or results.jsonl in "
                f"{ctx.output_dir}; its output ends:\n{log_tail(ctx)}"
            )
        rollouts = read_traces(found) if found.name == "traces.jsonl" else read_results(found)
        if not rollouts:
            raise EvalError(f"{found} holds no rollouts; vf-eval's output ends:\n{log_tail(ctx)}")
        parsed = score(rollouts, ctx.spec.get("name") or ctx.spec["env_id"])
        parsed.results_file = str(found)
        rate = parsed.metrics["error_rate"]
        if rate > float(ctx.spec.get("max_error_rate", 0.0)):
            first = next((r["error"] for r in rollouts if r["error"]), "unknown error")
            parsed.error = (
                f"{rate:.0%} of {len(rollouts)} rollouts errored (max_error_rate "
                f"{ctx.spec.get('max_error_rate', 0.0)}); the first: {first}"
            )
        return parsed


def find_output(folder: Path) -> Path | None:
    """0.4's traces.jsonl, else 0.3's results.jsonl, anywhere under the output folder."""
    for name in ("traces.jsonl", "results.jsonl"):
        hits = sorted(folder.rglob(name))
        if hits:
            return hits[0]
    return None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # message parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _errors(errors: Iterable[Any]) -> str | None:
    for e in errors:
        if isinstance(e, dict):
            return str(e.get("message") or e.get("error") or e.get("type") or e)
        return str(e)
    return None


def read_traces(path: Path) -> list[dict[str, Any]]:
    """verifiers 0.4: one rollout per line; its rewards, reply and error."""
    rollouts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        ep = json.loads(line)
        data = (ep.get("task") or {}).get("data") or {}
        traces = ep.get("traces") or []
        rewards: dict[str, list[tuple[float, float]]] = {}
        reply = ""
        for tr in traces:
            for fn, r in (tr.get("rewards") or {}).items():
                if isinstance(r, dict) and r.get("score") is not None:
                    rewards.setdefault(fn, []).append(
                        (float(r["score"]), float(r.get("weight", 1.0)))
                    )
            for node in reversed(tr.get("nodes") or []):
                msg = node.get("message") or {}
                if msg.get("role") == "assistant":
                    reply = reply or _text(msg.get("content"))
                    break
        error = _errors(ep.get("errors") or [])
        for tr in traces:
            error = error or _errors(tr.get("errors") or [])
        if error is None and ep.get("ok") is False:
            error = "the rollout did not complete (ok: false)"
        rollouts.append(
            {
                "example": data.get("id") if data.get("id") is not None else data.get("idx"),
                "prompt": data.get("prompt"),
                "answer": data.get("answer"),
                "reply": reply,
                "scores": {fn: sum(s for s, _ in v) / len(v) for fn, v in rewards.items()},
                "weights": {fn: v[0][1] for fn, v in rewards.items()},
                "error": error,
            }
        )
    return rollouts


def read_results(path: Path) -> list[dict[str, Any]]:
    """verifiers 0.3: results.jsonl beside metadata.json (whose avg_metrics name the reward
    functions; `reward` is already their weighted sum)."""
    meta_path = path.parent / "metadata.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    functions = list((meta.get("avg_metrics") or {}).keys())
    rollouts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        completion = row.get("completion")
        if isinstance(completion, list):
            reply = next(
                (
                    _text(m.get("content"))
                    for m in reversed(completion)
                    if m.get("role") == "assistant"
                ),
                "",
            )
        else:
            reply = _text(completion)
        error = row.get("error")
        rollouts.append(
            {
                "example": row.get("example_id"),
                "prompt": row.get("prompt"),
                "answer": row.get("answer"),
                "reply": reply,
                "scores": {fn: float(row[fn]) for fn in functions if row.get(fn) is not None},
                "reward": float(row["reward"]) if row.get("reward") is not None else None,
                "error": str(error) if error else None,
            }
        )
    return rollouts


def _stderr(metrics: dict[str, Any], name: str, per_example: list[list[float]]) -> None:
    """`<name>_stderr`: the standard error of the mean over examples (each example's mean over
    its rollouts; sample standard deviation over the square root of their number), where lm-eval
    puts a metric's stderr, so the alerts, the report's bands and `--vs` judge rewards as they
    judge lm-eval's metrics. Left out with one example."""
    means = [sum(v) / len(v) for v in per_example if v]
    n = len(means)
    if n < 2:
        return
    mean = sum(means) / n
    variance = sum((m - mean) ** 2 for m in means) / (n - 1)
    metrics[f"{name}_stderr"] = (variance / n) ** 0.5


def score(rollouts: list[dict[str, Any]], task: str) -> Parsed:
    """The ledger's metrics and per-example records from the rollouts (errored ones score 0)."""
    by_example: dict[Any, list[dict[str, Any]]] = {}
    for r in rollouts:
        by_example.setdefault(r["example"], []).append(r)

    def weighted(r: dict[str, Any]) -> float:
        if r.get("reward") is not None:
            return float(r["reward"])
        return sum(s * r.get("weights", {}).get(fn, 1.0) for fn, s in r["scores"].items())

    def graded(r: dict[str, Any], fn: str | None = None) -> float:
        """A rollout's weighted reward (or function `fn`'s score); an errored one scores 0."""
        if r["error"]:
            return 0.0
        return weighted(r) if fn is None else float(r["scores"].get(fn, 0.0))

    functions = sorted({fn for r in rollouts for fn in r["scores"]})
    groups = list(by_example.values())
    # each metric's grades per example, rollout by rollout (None: the weighted reward)
    grades = {fn: [[graded(r, fn) for r in rs] for rs in groups] for fn in [None, *functions]}
    rewards = [graded(r) for r in rollouts]
    metrics: dict[str, Any] = {
        "reward": sum(rewards) / len(rewards),
        "error_rate": sum(1 for r in rollouts if r["error"]) / len(rollouts),
    }
    per_example = grades[None]
    _stderr(metrics, "reward", per_example)
    for fn in functions:
        values = [graded(r, fn) for r in rollouts]
        metrics[f"reward/{fn}"] = sum(values) / len(values)
        _stderr(metrics, f"reward/{fn}", grades[fn])
    n = min(len(rs) for rs in per_example)
    if n >= 1 and is_binary(per_example):
        ks = sorted({2**i for i in range(n.bit_length())} | {n})
        for k in (k for k in ks if k <= n):
            metrics[f"reward_pass@{k}"] = sum(
                pass_at_k(len(rs), int(sum(rs)), k) for rs in per_example
            ) / len(per_example)
    records = [
        {
            "task": task,
            "doc_id": example,
            "prompt": rs[0]["prompt"],
            "target": rs[0]["answer"],
            "responses": [r["reply"] for r in rs],
            "extracted": {},
            "scores": {"reward,none": grades[None][i]}
            | {f"{fn},none": grades[fn][i] for fn in functions},
            "errors": [r["error"] for r in rs],
        }
        for i, (example, rs) in enumerate(by_example.items())
    ]
    return Parsed(metrics, len(by_example), records)


VERIFIERS = VerifiersHarness()
