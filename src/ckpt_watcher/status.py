"""`watcher status`: what the daemon is doing, read from its state and the ledger, without it.

Liveness comes from the daemon's lock (held only by a live process, so a kill -9 never leaves a
stale "running") and its heartbeat (a hung daemon shows as stale).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ckpt_watcher import ledger as ledger_mod
from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.jobfolder import (
    LOG_FILE,
    WARM_FAILING_JOBS,
    JobFolder,
    engine_files,
    warm_home,
)
from ckpt_watcher.ledger import LedgerIndex, Subject
from ckpt_watcher.pins import Pin, held_alone
from ckpt_watcher.proctable import process_alive
from ckpt_watcher.report.table import entry_name, newest_versions, task_label
from ckpt_watcher.sinks.alerts import Regression
from ckpt_watcher.sources.baseline import source_name
from ckpt_watcher.state import HEARTBEAT_SECONDS, Job, State
from ckpt_watcher.timestamps import iso

STALE_AFTER = 10 * HEARTBEAT_SECONDS
EXIT_RUNNING = 0
EXIT_DOWN = 3
EXIT_STALE = 4
EXIT_DEGRADED = 5  # running, but not doing all it should (`degraded` says why)
# a source counts as down (not a passing blip) once unreachable for this many of its polls,
# and at least this long
DEGRADED_POLLS = 3
DEGRADED_MIN_SECONDS = 30.0
# Non-final states listed one by one (done/skipped only counted).
_LISTED = ("incomplete", "invalid", "unrecognised", "ready", "planned", "failed", "missed")


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    s = int(max(0, seconds))
    if s < 120:
        return f"{s}s ago"
    if s < 7200:
        return f"{s // 60}m ago"
    return f"{s // 3600}h ago"


def gather(cfg: WatcherConfig, now: float | None = None) -> dict[str, Any]:
    """Everything `status` shows, as plain data (also the --json output)."""
    now = time.time() if now is None else now
    state = State(cfg.state_dir, readonly=True)
    try:
        alive = state.daemon_lock_held()
        heartbeat = state.get_meta("heartbeat")
        age = now - heartbeat if heartbeat else None
        daemon = {
            "alive": alive,
            "stale": bool(alive and age is not None and age > STALE_AFTER),
            "pid": state.get_meta("daemon_pid") if alive else None,
            "started_at": _iso_or_none(state.get_meta("daemon_started_at")),
            "stopped_at": None
            if alive
            else _iso_or_none(state.get_meta("daemon_stopped_at") or heartbeat),
            "heartbeat_age_s": round(age, 1) if age is not None else None,
            "stopping": bool(state.get_meta("stopping")) if alive else False,
            "mode": state.get_meta("mode"),
            "metrics_url": state.get_meta("metrics_url") if alive else None,
        }
        scanned = {r["name"]: r for r in state.sources()}
        names = [s.name for s in cfg.sources]
        if cfg.baseline is not None and cfg.baseline.checkpoint is not None:
            names.append(source_name(cfg.baseline.checkpoint))
        sources = [_source(scanned.get(name), name, now) for name in names]
        polls = {s.name: s.poll_seconds for s in cfg.sources}
        degraded = [
            f"source {name} unreachable for {now - row['unreachable_since']:.0f}s: "
            f"{row['last_error']}"
            for name in names
            if (row := scanned.get(name)) is not None
            and row["unreachable_since"]
            and now - row["unreachable_since"]
            >= max(DEGRADED_MIN_SECONDS, DEGRADED_POLLS * polls.get(name, 30.0))
        ]
        checkpoints = [
            {
                "location": r.location,
                "run": r.run or None,
                "run_path": r.run_path or None,
                "step": r.step,
                "label": r.label or None,
                "state": r.state,
                "reason": r.reason,
                "fingerprint": r.fingerprint,
                # its content changed after it was evaluated: evaluated again as a new version
                "rewritten": r.rewritten_at is not None,
                "rewritten_at": _iso_or_none(r.rewritten_at),
                "previous_fingerprint": r.previous_fingerprint,
            }
            for r in state.checkpoints()
            if r.state in _LISTED or r.rewritten_at is not None
        ]
        queued = [
            {
                "job_id": j.id,
                "run": j.run,
                "step": j.step,
                "label": j.label,
                "tasks": [entry_name(t) for t in j.tasks],
                "attempt": j.attempt,
                "retry_in_s": round(j.not_before - now, 1) if j.not_before > now else None,
                "last_error": j.error,
            }
            for j in state.jobs("queued")
        ]
        helping = state.get_meta("helpers") or []
        running = [
            {
                "job_id": j.id,
                "run": j.run,
                "step": j.step,
                "label": j.label,
                "device": j.device_label,
                "node": j.host,
                "pid": j.pid,
                "attempt": j.attempt,
                "tasks": [entry_name(t) for t in j.tasks],
                "running_s": round(now - j.started_at, 1) if j.started_at else None,
                "progress": _progress(JobFolder.of(cfg.state_dir, j.id, j.attempt)),
                # devices that joined its tasks (one task spread over idle devices)
                "helpers": [h["device"] for h in helping if h["job_id"] == j.id],
            }
            for j in state.jobs("running")
        ]
        failed_jobs = state.jobs("failed")
        ledger = LedgerIndex(cfg.ledger_dir).load() if failed_jobs else None
        history = [
            {
                "job_id": j.id,
                "run": j.run,
                "step": j.step,
                "label": j.label,
                "error": j.error,
                # a later ok for every task of the job (a requeue) resolves it
                "resolved": bool(
                    ledger
                    and not ledger.due(
                        Subject.of_job(j),
                        j.tasks,
                        j.settings_hash,
                    )
                ),
            }
            for j in failed_jobs
        ]
        failures = [f for f in history if not f["resolved"]]
        counts = state.checkpoint_counts()
        behind = _behind(cfg, state.jobs("queued") + state.jobs("running"))
        zombies = state.get_meta("suspected_zombies") or []
        # as a live daemon's last heartbeat saw them (a stopped daemon's would be stale)
        devices = (state.get_meta("devices") or []) if alive else []
        pins = {k: Pin(**v) for k, v in (state.get_meta("pins") or {}).items()}
        alone = held_alone(pins)
        pinned = [  # bytes: of the files pinned; held_bytes: the disk only the pin holds
            {"location": k, "path": p.path, "bytes": p.bytes, "held_bytes": alone[k]}
            for k, p in sorted(pins.items())
        ]
        regressions = state.get_meta("regressions") or []
        no_ops = state.get_meta("no_ops") or []
        # set by a live daemon's heartbeat while its ledger folder cannot be written
        unwritable = state.get_meta("ledger_unwritable") if alive else None
        journals = state.get_meta("journals")
        starter = state.get_meta("worker_starter")
        # Ray's nodes' warm engines, as the daemon's last heartbeat saw them
        elsewhere = (state.get_meta("engines_elsewhere") or []) if alive else []
    finally:
        state.close()
    engines = warm_engines(cfg.state_dir) + elsewhere
    degraded += [
        f"warm engine on {e.get('device')}: {len(jobs)} jobs in a row crashed on it "
        f"(last: {e['failing'].get('last')}); jobs are retried, but see "
        f"{warm_home(cfg.state_dir, str(e.get('device'))) / LOG_FILE} and the jobs' worker.log"
        for e in engines
        if len(jobs := (e.get("failing") or {}).get("jobs") or []) >= WARM_FAILING_JOBS
    ]
    if unwritable:
        waiting = len(unwritable.get("waiting_jobs") or [])
        filed = f"{waiting} finished job(s) wait to be filed, and " if waiting else ""
        degraded.insert(
            0,
            f"ledger_dir {unwritable['ledger_dir']} cannot be written since "
            f"{unwritable['since']}: {unwritable['error']}; {filed}no eval starts until it can "
            "be written (free space on it, or fix it: nothing is lost)",
        )
    return {
        "daemon": daemon,
        "degraded": degraded,  # why a running daemon is not doing all it should (exit 5)
        "sources": sources,
        "checkpoint_counts": counts,
        "checkpoints": checkpoints,
        "queue": queued,
        "running": running,
        "failures": failures,  # current: not covered by a later ok
        "regressions": [
            r | {"text": Regression(**{k: v for k, v in r.items() if k != "at"}).text()}
            for r in regressions
        ],
        "failure_history": history,
        "no_ops": no_ops,  # checkpoints that change nothing (the newest, oldest first)
        "suspected_zombies": zombies,
        # each device at the daemon's last heartbeat: running, helping, busy (why) or free
        "devices": devices,
        "ledger_unwritable": unwritable,
        "pinned": pinned,  # checkpoints whose files are held until their results are in
        # resume journals under state_dir: {folders, bytes, max_bytes} at the last sweep
        "journals": journals,
        "behind": behind,  # per run: checkpoints due, and the time they take at today's rate
        "warm_engines": engines,
        # executors/starter.py: {pid, state: starting|ready|off, since, why}, or None
        "worker_starter": _starter(starter, now) if alive else None,
        "latest_results": latest_results(cfg),
    }


def _progress(folder: JobFolder) -> dict[str, Any] | None:
    """The running job's task and units done of its total, with an ETA (None before the worker
    has said: it is still loading, or the task keeps no journal)."""
    p = folder.progress()
    if p is None:
        return None
    return {"task": p.task, "done": p.done, "total": p.total, "unit": p.unit, "eta_s": p.eta_s()}


def _progress_text(p: dict[str, Any] | None) -> str:
    if p is None:
        return ""
    left = f", ~{_duration(p['eta_s'])} left" if p["eta_s"] is not None else ""
    return f"; {p['task']}: {p['done']}/{p['total']} {p['unit']}{left}"


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def warm_engines(state_dir: Path) -> list[dict[str, Any]]:
    """Each device's warm worker as its `engine.json` says (`warm_worker.py`); a worker whose
    process is gone is shown as released."""
    out = []
    for data in engine_files(state_dir):
        if data.get("state") != "released" and not process_alive(int(data.get("pid") or 0)):
            data["state"] = "released"
        data["since"] = _iso_or_none(data.get("since"))
        out.append(data)
    return out


def _source(row: Any, name: str, now: float) -> dict[str, Any]:
    """A configured source as status shows it (`row` None: no scan has finished yet)."""
    if row is None:
        return {
            "name": name,
            "last_scan_at": None,
            "last_scan_age_s": None,
            "error": None,
            "unreachable_since": None,
            "checkpoints": None,
        }
    return {
        "name": name,
        "last_scan_at": _iso_or_none(row["last_scan_at"]),
        "last_scan_age_s": round(now - row["last_scan_at"], 1) if row["last_scan_at"] else None,
        "error": row["last_error"],
        "unreachable_since": _iso_or_none(row["unreachable_since"]),
        "checkpoints": row["n_checkpoints"],
    }


def _iso_or_none(ts: float | None) -> str | None:
    return iso(ts) if ts else None


def _behind(cfg: WatcherConfig, jobs: list[Job]) -> list[dict[str, Any]]:
    """Per run with checkpoints due (queued or running): how many, and about how long they
    take at the rate of its recent results (seconds per checkpoint, over the devices busy)."""
    due: dict[str, set[str]] = {}
    for job in jobs:
        due.setdefault(job.run_path, set()).add(job.location)
    busy = max(1, len({j.device for j in jobs if j.state == "running" and j.device}))
    out = []
    for run_path, locations in sorted(due.items()):
        path = ledger_mod.ledger_path(cfg.ledger_dir, run_path)
        seconds: dict[str, float] = {}  # per checkpoint: its tasks' eval seconds
        for ln in ledger_mod.read_lines(path).lines if path.exists() else []:
            if ln.get("status") == "ok" and isinstance(ln.get("duration_s"), int | float):
                key = ln.get("checkpoint", "")
                seconds[key] = seconds.get(key, 0.0) + float(ln["duration_s"])
        recent = list(seconds.values())[-5:]
        per = sum(recent) / len(recent) if recent else None
        eta = round(len(locations) * per / busy, 1) if per is not None else None
        out.append({"run_path": run_path, "due": len(locations), "eta_s": eta})
    return out


def latest_results(cfg: WatcherConfig, per_run: int = 3) -> list[dict[str, Any]]:
    """The newest ok lines of each run path (its highest steps, newest version of each)."""
    out = []
    for run_path in ledger_mod.iter_runs(cfg.ledger_dir):
        every = ledger_mod.read_lines(ledger_mod.ledger_path(cfg.ledger_dir, run_path)).lines
        lines = [ln for ln in newest_versions(every) if ledger_mod.is_result(ln)]
        steps = sorted({int(ln["step"]) for ln in lines if ln.get("step") is not None})[-per_run:]
        for ln in lines:
            if ln.get("step") in steps or ln.get("step") is None:
                metrics = {k: v for k, v in ln.get("metrics", {}).items() if "_stderr" not in k}
                out.append(
                    {
                        "run": ln["run"],
                        "run_path": run_path,
                        "step": ln.get("step"),
                        "fingerprint": ln.get("fingerprint"),
                        "label": ln.get("label"),
                        "task": entry_name(ln),
                        "num_fewshot": ln.get("num_fewshot"),
                        "metrics": metrics,
                    }
                )
    return out


def exit_code(data: dict[str, Any]) -> int:
    d = data["daemon"]
    if not d["alive"]:
        return EXIT_DOWN
    if d["stale"]:
        return EXIT_STALE
    return EXIT_DEGRADED if data.get("degraded") else EXIT_RUNNING


def render(data: dict[str, Any]) -> str:
    d = data["daemon"]
    lines = []
    if d["alive"]:
        hb = d["heartbeat_age_s"]
        word = f"STALE (no heartbeat for {hb}s: hung?)" if d["stale"] else "running"
        extra = ", stopping (draining)" if d["stopping"] else ""
        lines.append(
            f"daemon: {word}, pid {d['pid']}, since {d['started_at']}, heartbeat {_ago(hb)}{extra}"
        )
        if d.get("metrics_url"):
            lines.append(f"metrics: {d['metrics_url']}")
    else:
        lines.append(f"daemon: DOWN since {d['stopped_at'] or 'unknown'}")
    if d["alive"]:
        lines += [f"DEGRADED: {why}" for why in data.get("degraded", [])]
    lines.append("sources:")
    for s in data["sources"]:
        if s["unreachable_since"]:
            lines.append(f"  {s['name']}: unreachable since {s['unreachable_since']}: {s['error']}")
            continue
        err = f"  ERROR: {s['error']}" if s["error"] else ""
        lines.append(
            f"  {s['name']}: last scan {_ago(s['last_scan_age_s'])}, {s['checkpoints'] or 0} checkpoints{err}"
        )
    counts = data["checkpoint_counts"]
    lines.append(
        "checkpoints: " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none yet")
    )
    for c in data["checkpoints"]:
        who = _who(c)
        rewritten = f"  rewritten {c['rewritten_at']}" if c["rewritten"] else ""
        lines.append(f"  {c['state']:<12} {who}{rewritten}  {c['reason'] or ''}".rstrip())
    lines.append(f"queue: {len(data['queue'])} job(s)")
    for q in data["queue"]:
        retry = f", retry in {q['retry_in_s']}s after: {q['last_error']}" if q["retry_in_s"] else ""
        lines.append(f"  {q['label']}  tasks {', '.join(q['tasks'])}{retry}")
    lines.append(f"running: {len(data['running'])}")
    for r in data["running"]:
        node = f" on node {r['node']}" if r["node"] else ""
        pid = f"pid {r['pid']}, " if r["pid"] else ""
        lines.append(
            f"  {r['device']}{node}: {r['label']} ({pid}attempt {r['attempt']}, "
            f"{r['running_s']}s, tasks {', '.join(r['tasks'])}{_progress_text(r['progress'])})"
            + (f", helped by {', '.join(r['helpers'])}" if r.get("helpers") else "")
        )
    devices = data.get("devices") or []
    if devices:
        free = sum(d["state"] == "free" for d in devices)
        lines.append(f"devices: {len(devices)}, {free} free")
        for d in devices:
            why = d.get("job") or d.get("why")
            lines.append(f"  {d['device']}: {d['state']}" + (f" ({why})" if why else ""))
    lines.append(f"failures: {len(data['failures'])}")
    for f in data["failures"]:
        lines.append(f"  {f['label']}: {(f['error'] or '').splitlines()[0] if f['error'] else ''}")
    if data["regressions"]:
        lines.append(f"regressions (the newest {len(data['regressions'])}, oldest first):")
        lines.extend(f"  {r['text'].removeprefix('regression: ')}" for r in data["regressions"])
    if data.get("no_ops"):
        lines.append(f"checkpoints that change nothing (the newest {len(data['no_ops'])}):")
        lines.extend(
            f"  {n['run_path']} step {n['step']} ({n['label']}): {n['why']}" for n in data["no_ops"]
        )
    for b in data["behind"]:
        eta = f", ~{_duration(b['eta_s'])} at the current rate" if b["eta_s"] is not None else ""
        lines.append(f"behind: {b['run_path']}: {b['due']} checkpoint(s) due{eta}")
    if data["pinned"]:
        held = sum(p["held_bytes"] for p in data["pinned"]) / 2**30
        named = sum(p["bytes"] for p in data["pinned"]) / 2**30
        lines.append(
            f"pinned: {len(data['pinned'])} checkpoint(s) ({named:.2f} GiB), {held:.2f} GiB "
            "held only by pins"
        )
    j = data.get("journals")
    if j and j["folders"]:
        limit = f" of {j['max_bytes'] / 2**30:g} GiB" if j["max_bytes"] else ""
        lines.append(f"journals: {j['folders']}, {j['bytes'] / 2**20:.1f} MiB{limit}")
    if data["suspected_zombies"]:
        lines.append(
            f"suspected zombies (not ours: never killed unless devices.reap_foreign_zombies): {len(data['suspected_zombies'])}"
        )
        for z in data["suspected_zombies"]:
            lines.append(
                f"  {z['device']}: pid {z['pid']} holds {z['used_mib']} MiB at 0% for {z['idle_s']}s"
            )
    s = data.get("worker_starter")
    if s is not None:
        lines.append(_starter_text(s))
    live = [w for w in data["warm_engines"] if w["state"] != "released"]
    lines.append("warm engines:" if live else "warm engines: none")
    for w in live:
        if w.get("ready_for"):  # started ahead of its run's first checkpoint (jobs/early.py)
            state = "ready" if w["state"] == "ready" else "starting"
            lines.append(
                f"  {w['device']}: {state} for {w['ready_for']} since {w['since']}, "
                f"placeholder weights until its first checkpoint (pid {w['pid']})"
            )
            continue
        what = w["checkpoint"] or "no model loaded"
        lines.append(
            f"  {w['device']}: {w['state']} since {w['since']}, holds {what} "
            f"(pid {w['pid']}, {w['swaps']} swaps)"
        )
    for w in data["warm_engines"]:
        for why in (w.get("cold_for_good") or {}).values():
            lines.append(f"  {w['device']}: swaps off for this architecture: {why}")
    lines.append("latest results:")
    for r in data["latest_results"]:
        metrics = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["metrics"].items()
        )
        lines.append(f"  {_who(r)}  {task_label(r)}  {metrics}")
    return "\n".join(lines)


def _starter(meta: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
    if not meta:
        return None
    since = meta.get("since")
    return {**meta, "for_s": round(now - since, 1) if since else None}


def _starter_text(s: dict[str, Any]) -> str:
    if s["state"] == "starting":
        return (
            f"worker starter: importing torch, transformers and lm-eval for {s['for_s']}s "
            f"(pid {s['pid']}); jobs start once it is ready"
        )
    if s["state"] == "ready":
        return f"worker starter: ready (pid {s['pid']}), workers are forked from it"
    return f"worker starter: off ({s['why']}); workers start as fresh processes"


def _who(item: dict[str, Any]) -> str:
    """A checkpoint as status names it: its label, under its run path where that says more."""
    label = item["label"] or item.get("location", "")
    run_path = item.get("run_path") or item["run"]
    return label if label.startswith(run_path) else f"{run_path}: {label}"
