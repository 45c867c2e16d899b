"""Jobs: the daemon's side of evaluating a checkpoint, from queue to ledger line.

- `dispatch.py`: queue the planner's jobs; start the next ones on free devices.
- `supervise.py`: running jobs: workers' exits, time-outs, the stop's kills.
- `gpus.py`: free devices, GPUs given back when training wants them, zombies.
- `recovery.py`: at start, what an earlier daemon left behind.
- `book.py`: how an attempt ends: ledger lines, requeue, failure, the checkpoint's mark.
- `settle.py`: the pure verdicts on an attempt that ended (retry, fail, requeue, missed).

The worker's side is `ckpt_watcher.worker`; the two meet only in the job folder
(`ckpt_watcher.jobfolder`), through an Executor (`ckpt_watcher.executors`).

Crash-safe order for one job: (1) the job row goes `running` (commit) before its worker starts;
(2) the worker writes each task's outcome file (tmp + fsync + rename); (3) the book appends the
ledger line (fsync), then marks the job `ok`. On start, workers left by an earlier daemon are
killed, outcome files they finished are filed first, and ledger `ok` lines win over job states,
so nothing is lost and nothing is appended twice.
"""
