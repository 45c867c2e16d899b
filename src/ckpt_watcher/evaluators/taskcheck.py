"""`python -m ckpt_watcher.evaluators.taskcheck`: resolve task names the way the worker will
(lm-eval's TaskManager, with `eval.include_path`) and check each task's local data files, so a
typo or a missing file is caught before any device is spent. Reads
`{"tasks": [...], "include_path": ...}` as JSON on stdin; writes
`{"unknown": {name: [closest names]}, "missing_data": {name: [paths]}}` on stdout, and, when
all is well and the request names a cache, the cache file.
Imports lm-eval: run it as a subprocess (the daemon never imports lm-eval).
"""

from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path
from typing import Any

from ckpt_watcher.durable import write_json_atomic
from ckpt_watcher.evaluators.lm_eval_internals import (
    builtin_tasks,
    task_manager,
    task_yaml_config,
)
from ckpt_watcher.tasks import task_paths

# `dataset_path` values under which `dataset_kwargs.data_files` are local files
LOCAL_BUILDERS = frozenset({"json", "csv", "parquet", "text", "arrow"})


def local_data_files(cfg: dict[str, Any]) -> list[str]:
    """The local files a task's YAML reads (none for a Hub dataset)."""
    if cfg.get("dataset_path") not in LOCAL_BUILDERS:
        return []
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") or []
    if isinstance(files, dict):
        files = list(files.values())
    out: list[str] = []
    for f in files if isinstance(files, list) else [files]:
        out += f if isinstance(f, list) else [f]
    return [str(f) for f in out if isinstance(f, str)]


def check(
    names: list[str], include_path: str | None, index_dir: str | None = None
) -> dict[str, Any]:
    """`index_dir`: where lm-eval's index of its built-in tasks is kept (the host's compile
    cache): a name found nowhere is then told at once, with the closest names, rather than
    after indexing all of lm-eval's YAMLs again."""
    paths = task_paths(include_path)
    tm = task_manager(names, paths, index_dir=index_dir)
    known = set(tm.all_tasks)
    if index_dir is not None and not set(names) <= known:
        known |= set(builtin_tasks(index_dir))
    unknown: dict[str, list[str]] = {}
    missing: dict[str, list[str]] = {}
    for name in names:
        if name not in known:
            unknown[name] = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            continue
        if name not in tm.all_tasks:  # a built-in group or tag: lm-eval's own datasets
            continue
        gone = [f for f in local_data_files(task_yaml_config(tm, name)) if not Path(f).is_file()]
        if gone:
            missing[name] = gone
    return {"unknown": unknown, "missing_data": missing}


def main() -> int:
    request = json.load(sys.stdin)
    verdict = check(request["tasks"], request.get("include_path"), request.get("index_dir"))
    cache = request.get("cache")
    if cache and not (verdict["unknown"] or verdict["missing_data"]):
        # written here, not by the caller: a daemon killed meanwhile still finds it next start
        Path(cache["path"]).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(cache["path"]), {"ok_for": cache["key"]})
    json.dump(verdict, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
