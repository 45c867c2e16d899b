"""`harness: command`: any other harness, as an argv with placeholders and a results file.

The argv runs without a shell; each `{placeholder}` is replaced inside its own argument and
never re-split, so a checkpoint folder named `x; rm -rf ~` stays one harmless argument. Its
metrics are read from a JSON results file by dotted paths (`scores.f1`, `results.0.acc`); a
per-sample JSON-lines file, where it names one, is kept for `watcher samples`.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ckpt_watcher.errors import EvalError
from ckpt_watcher.harnesses.base import Context, Parsed, log_tail


def fill(template: str, ctx: Context) -> str:
    """A template with the placeholders replaced (str.format: `{{` is a brace)."""
    return template.format(
        limit="" if ctx.limit is None else f"{ctx.limit:g}",
        checkpoint=ctx.checkpoint,
        device=ctx.device,
        output_dir=str(ctx.output_dir),
        url=ctx.url,
        model=ctx.model,
    )


def dotted(data: Any, path: str) -> Any:
    """The value at a dotted path (`a.b.0.c`: keys, and list indexes as numbers)."""
    node = data
    for part in path.split("."):
        if isinstance(node, list) and part.lstrip("-").isdigit():
            try:
                node = node[int(part)]
                continue
            except IndexError:
                raise KeyError(path) from None
        if not isinstance(node, dict) or part not in node:
            raise KeyError(path)
        node = node[part]
    return node


# a file's time as the filesystem keeps it may trail the clock by its time granularity
MTIME_SLACK_SECONDS = 2.0


def written(name: str, ctx: Context, what: str) -> Path:
    """The file the command wrote under `name`: a relative name is in the folder it ran in
    (its output folder), and a file older than its start is left from something else."""
    path = Path(name)
    if not path.is_absolute():
        path = ctx.output_dir / path
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        raise EvalError(
            f"{ctx.spec['argv'][0]} exited 0 but wrote no {what} {path} (a relative path is "
            "read in the folder the command runs in, {output_dir})"
        ) from None
    if mtime < ctx.started - MTIME_SLACK_SECONDS:
        raise EvalError(
            f"{what} {path} was last written before the command started (at "
            f"{datetime.fromtimestamp(mtime, UTC):%Y-%m-%d %H:%M:%S} UTC): it is not this "
            "checkpoint's; write it under {output_dir}, or remove it before each run"
        )
    return path


class CommandHarness:
    def served(self, spec: dict[str, Any]) -> bool:
        return bool(spec.get("serve"))

    def total(self, ctx: Context) -> int | None:
        return None

    def argv(self, ctx: Context) -> list[str]:
        return [fill(a, ctx) for a in ctx.spec["argv"]]

    def environ(self, ctx: Context, env: dict[str, str]) -> dict[str, str]:
        return env

    def read(self, ctx: Context, returncode: int) -> Parsed:
        if returncode != 0:
            raise EvalError(
                f"{ctx.spec['argv'][0]} exited with status {returncode}; its output ends:\n"
                + log_tail(ctx)
            )
        path = written(fill(ctx.spec["results"]["file"], ctx), ctx, "results file")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise EvalError(f"results file {path} is not JSON: {e}") from None
        metrics: dict[str, Any] = {}
        missing = []
        for name, where in ctx.spec["results"]["metrics"].items():
            try:
                metrics[name] = dotted(data, where)
            except KeyError:
                missing.append(f"{name} ({where})")
        if missing:
            raise EvalError(f"results file {path} has no {', '.join(missing)}")
        records = _records(ctx)
        return Parsed(metrics, len(records) or None, records, results_file=str(path))


# a per-sample line's fields as `watcher samples` reads them (missing ones: empty); its
# `scores` are `{"<metric>,<filter>": [score per response]}`
SAMPLE_FIELDS: dict[str, Any] = {
    "prompt": "",
    "target": None,
    "responses": list,
    "extracted": dict,
    "scores": dict,
}


def _records(ctx: Context) -> list[dict[str, Any]]:
    """The command's per-sample file, as the watcher's sample records (its own fields kept)."""
    if not ctx.spec.get("samples"):
        return []
    path = written(fill(ctx.spec["samples"], ctx), ctx, "samples file")
    records = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        rec = dict(row) if isinstance(row, dict) else {"value": row}
        rec.setdefault("task", ctx.spec.get("name") or "")
        rec.setdefault("doc_id", i)
        for key, empty in SAMPLE_FIELDS.items():
            rec.setdefault(key, empty() if callable(empty) else empty)
        records.append(rec)
    return records


COMMAND = CommandHarness()
