"""The worker process: `python -m ckpt_watcher.worker JOB_DIR`.

Reads `JOB_DIR/spec.json`, runs every task on one checkpoint with the model loaded once, and
writes one outcome file per task (`outcome-<i>.json`, tmp + fsync + rename) as it finishes, so
a crash later in the job keeps the tasks already done. The daemon reads the outcomes and is the
only writer of the ledger. Exit codes: 0 all tasks ok, 3 some task failed, other: a crash.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path

EXIT_OK = 0
EXIT_TASK_FAILED = 3
EXIT_CRASH = 4


def outcome_path(job_dir: Path, index: int) -> Path:
    return job_dir / f"outcome-{index}.json"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ckpt_watcher.worker JOB_DIR", file=sys.stderr)
        return 2
    job_dir = Path(args[0])
    spec = json.loads((job_dir / "spec.json").read_text(encoding="utf-8"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The daemon decided the device; we only read it.
    print(
        f"worker pid {os.getpid()} job {spec['job_id']} on {spec['device_label']} "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r})",
        flush=True,
    )
    from ckpt_watcher.evaluators.harness import EvalRequest, TaskOutcome, TaskRun, run_tasks

    req_fields = dict(spec["request"])
    stage = spec.get("stage")
    if stage:
        from ckpt_watcher.sources.staging import stage as stage_checkpoint

        try:
            local = stage_checkpoint(
                stage["location"], Path(stage["cache_dir"]), stage.get("endpoint_url")
            )
        except Exception:
            traceback.print_exc()
            return EXIT_CRASH
        print(f"staged {stage['location']} at {local}", flush=True)
        req_fields["checkpoint"] = str(local)
    req_fields["tasks"] = [TaskRun(**t) for t in req_fields["tasks"]]
    req = EvalRequest(**req_fields)
    index = {(t.task, t.num_fewshot): i for i, t in enumerate(req.tasks)}

    def record(outcome: TaskOutcome) -> None:
        path = outcome_path(job_dir, index[(outcome.task, outcome.num_fewshot)])
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(outcome), f, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        print(f"task {outcome.task} ({outcome.num_fewshot}-shot): {outcome.status}", flush=True)
        if outcome.error:
            print(f"  error: {outcome.error}", flush=True)

    try:
        outcomes = run_tasks(req, record)
    except Exception:
        traceback.print_exc()
        return EXIT_CRASH
    return EXIT_OK if all(o.status == "ok" for o in outcomes) else EXIT_TASK_FAILED


if __name__ == "__main__":
    sys.exit(main())
