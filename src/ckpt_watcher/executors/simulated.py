"""An in-memory executor whose "workers" are threads that take a known time per task and write
the same outcome files a real worker writes. For scheduling tests and benchmarks, where what
matters is when jobs start and end, not what a model scores."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from itertools import count
from pathlib import Path

from ckpt_watcher.clock import utcnow
from ckpt_watcher.executors.base import ExitCallback, WorkerHandle

_pids = count(10_000_000)  # never a real pid


class SimulatedExecutor:
    def __init__(self, on_exit: ExitCallback, duration: Callable[[str, int | None], float]) -> None:
        self.on_exit = on_exit
        self.duration = duration
        self._cancel: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def start(
        self, job_id: str, job_dir: Path, env: dict[str, str], log_path: Path
    ) -> WorkerHandle:
        spec = json.loads((job_dir / "spec.json").read_text())
        cancel = threading.Event()
        with self._lock:
            self._cancel[job_id] = cancel
        threading.Thread(
            target=self._run, args=(job_id, job_dir, spec, cancel), daemon=True
        ).start()
        return WorkerHandle(job_id, next(_pids), "simulated")

    def _run(self, job_id: str, job_dir: Path, spec: dict, cancel: threading.Event) -> None:
        rc = 0
        for i, t in enumerate(spec["request"]["tasks"]):
            started = utcnow()
            if cancel.wait(self.duration(t["task"], t["num_fewshot"])):
                rc = -9
                break
            outcome = {
                "task": t["task"],
                "num_fewshot": t["num_fewshot"],
                "status": "ok",
                "metrics": {"acc,none": 1.0},
                "n_samples": 1,
                "clamped_requests": 0,
                "truncated_prompts": 0,
                "started_at": started,
                "finished_at": utcnow(),
                "results_file": None,
                "error": None,
                "lm_eval_version": "simulated",
            }
            path = job_dir / f"outcome-{i}.json"
            path.with_suffix(".tmp").write_text(json.dumps(outcome))
            path.with_suffix(".tmp").replace(path)
        with self._lock:
            self._cancel.pop(job_id, None)
        self.on_exit(job_id, rc)

    def kill(self, job_id: str) -> None:
        with self._lock:
            ev = self._cancel.get(job_id)
        if ev is not None:
            ev.set()

    def running(self) -> set[str]:
        with self._lock:
            return set(self._cancel)
