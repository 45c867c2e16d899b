"""Before any device is spent: every task name in the config resolves, and every local data file
its YAML names exists. The check runs lm-eval's TaskManager in a subprocess (seconds; indexing
lm-eval's own thousands of task YAMLs, when a name needs them, costs several times more), and a
passed check is cached in `state_dir`, keyed by the task names, the include_path's YAML files
(names, sizes, times) and the lm-eval version, so a restart after a crash does not pay for it
again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import subprocess
import sys

import structlog

from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.errors import ConfigError, WatcherError

log = structlog.get_logger("ckpt_watcher.preflight")

CACHE_NAME = "taskcheck.json"
TIMEOUT_SECONDS = 600.0


def cache_key(cfg: WatcherConfig) -> str:
    """What a passed check holds for: the task names, the include_path's YAML files (names,
    sizes, times) and the lm-eval version."""
    names = sorted({t.task for t in cfg.eval.lm_eval_tasks})
    yamls: list[str] = []
    include = cfg.eval.include_path
    if include is not None and include.exists():
        for p in sorted(include.rglob("*.y*ml")):
            st = p.stat()
            yamls.append(f"{p}:{st.st_size}:{st.st_mtime_ns}")
    try:
        version = importlib.metadata.version("lm-eval")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    blob = json.dumps([names, str(include), yamls, version]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def task_problems(cfg: WatcherConfig) -> list[str]:
    """One line per unknown task (with the closest names) or missing data file; [] if none."""
    if not cfg.eval.lm_eval_tasks:
        return []
    key = cache_key(cfg)
    cache = cfg.state_dir / CACHE_NAME
    try:
        if json.loads(cache.read_text()).get("ok_for") == key:
            log.info("tasks.checked", cached=True, tasks=len(cfg.eval.lm_eval_tasks))
            return []
    except (OSError, ValueError):
        pass
    names = sorted({t.task for t in cfg.eval.lm_eval_tasks})
    request = {
        "tasks": names,
        "include_path": str(cfg.eval.include_path) if cfg.eval.include_path else None,
        "cache": {"path": str(cache), "key": key},
        "index_dir": str(cfg.compile_cache),
    }
    try:
        r = subprocess.run(
            [sys.executable, "-m", "ckpt_watcher.evaluators.taskcheck"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_SECONDS,
        )
    except subprocess.TimeoutExpired as e:
        raise WatcherError(f"checking the task names took over {TIMEOUT_SECONDS:g}s") from e
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise WatcherError(
            f"cannot check the task names: lm-eval failed to start ({last}); run `watcher doctor`"
        )
    verdict = json.loads(r.stdout)
    problems = []
    for name, close in sorted(verdict["unknown"].items()):
        hint = (
            f"did you mean {', '.join(repr(c) for c in close)}?"
            if close
            else "check its spelling; custom tasks need eval.include_path"
        )
        problems.append(f"unknown task {name!r} ({hint})")
    for name, paths in sorted(verdict["missing_data"].items()):
        problems.append(
            f"task {name!r} reads {', '.join(paths)}, which does not exist "
            "(fix dataset_kwargs.data_files in its YAML)"
        )
    if not problems:  # the subprocess has written the cache
        log.info("tasks.checked", cached=False, tasks=len(names))
    return problems


def harness_problems(cfg: WatcherConfig) -> tuple[dict[str, str], list[str]]:
    """Each other harness entry's version, read in its own interpreter, and one line per entry
    whose interpreter is missing or lacks its harness."""
    from ckpt_watcher.harnesses import interp

    versions: dict[str, str] = {}
    problems = []
    for h in cfg.eval.harness_tasks:
        try:
            versions[h.name] = interp.probe(h.harness, h.spec())
        except interp.InterpreterProblem as e:
            problems.append(f"entry {h.name!r} ({h.harness}): {e}")
            continue
        if h.harness == "olmes":  # its task names, suites and files resolve
            from ckpt_watcher.harnesses.olmes import dry_run_problem

            said = dry_run_problem(h.spec())
            if said is not None:
                problems.append(f"entry {h.name!r} (olmes): {said}")
    return versions, problems


def sandbox_problem(cfg: WatcherConfig) -> str | None:
    """Why the entries that run model-written code cannot run on this host (the sandbox does
    not start here), or None. Run-unsandboxed is said loudly in the log, never silently."""
    code = cfg.eval.code_entries
    if not code:
        return None
    from ckpt_watcher.sandbox import SandboxUnavailable, open_sandbox

    settings = cfg.eval.sandbox
    if settings.run_model_code_unsandboxed:
        log.warning(
            "sandbox.unsandboxed",
            entries=code,
            message="eval.sandbox.run_model_code_unsandboxed is true: model-written code runs "
            "as this user, with its files, network and credentials in reach",
        )
    try:
        box = open_sandbox(settings)
    except SandboxUnavailable as e:
        return (
            f"config field eval.sandbox: {', '.join(code)} run model-written code, and {e} "
            "(or leave those entries out)"
        )
    box.close()
    log.info("sandbox.ready", sandbox=box.name, entries=code)
    return None


def require_known_tasks(cfg: WatcherConfig) -> None:
    """Raise ConfigError (exit 2) naming every task problem, or why the code tasks' sandbox
    cannot run here; records each other harness's version in the config (part of its results'
    settings hash)."""
    versions, problems = harness_problems(cfg)
    cfg.eval.set_harness_versions(versions)
    problems += task_problems(cfg)
    if problems:
        raise ConfigError("config field eval.tasks: " + "; ".join(problems))
    sandbox = sandbox_problem(cfg)
    if sandbox:
        raise ConfigError(sandbox)
