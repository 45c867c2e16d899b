"""Pure scheduling decisions: queued jobs x free devices -> assignments.

No filesystem, GPU or clock access here: `now` and every input are passed in, so the rules
can be tested exhaustively and the daemon only carries decisions out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckpt_watcher.config import BASELINE_RUN
from ckpt_watcher.devices import Device, device_kind
from ckpt_watcher.state import Job


def eligible(jobs: Sequence[Job], now: float) -> list[Job]:
    """Queued jobs whose retry back-off has passed."""
    return [j for j in jobs if j.state == "queued" and j.not_before <= now]


def order_jobs(jobs: Sequence[Job], order: str) -> list[Job]:
    """The baseline first (every result is compared with it); then newest_first: highest order
    key (step) first; oldest_first: lowest first. Ties: FIFO."""
    sign = -1 if order == "newest_first" else 1
    return sorted(
        jobs,
        key=lambda j: (j.run_path != BASELINE_RUN, sign * j.order_key, j.created_at, j.id),
    )


def assign(
    jobs: Sequence[Job],
    free: Sequence[Device],
    now: float,
    order: str,
    prefer: Mapping[str, str] | None = None,
) -> list[tuple[Job, Device]]:
    """Give each free device the next eligible job, in policy order (GPUs before CPU slots).
    `prefer`: run path -> the label of the device whose engine waits for that run (jobs/early.py):
    the run's next job goes there, and other jobs go there only when no other device is left."""
    devices = sorted(free, key=lambda d: (d.kind != "cuda", d.id))
    waiting = dict(prefer or {})
    out = []
    for job in order_jobs(eligible(jobs, now), order):
        if not devices:
            break
        mine = waiting.pop(job.run_path, None)
        reserved = set(waiting.values())
        best = devices[0].kind  # a waiting engine on a CPU slot never keeps a job off a GPU
        device = (
            next((d for d in devices if d.label == mine and d.kind == best), None)
            or next((d for d in devices if d.label not in reserved), None)
            or devices[0]
        )
        devices.remove(device)
        out.append((job, device))
    return out


TaskEstimate = Callable[[dict[str, Any]], float]


def split_plan(
    jobs: Sequence[Job], free: int, estimate: TaskEstimate
) -> dict[str, list[list[dict[str, Any]]]]:
    """When more devices are free than jobs wait, split the biggest jobs' tasks over the spare
    devices so each checkpoint finishes sooner. Returns job id -> task groups (only for jobs
    that are split); each group becomes one job. Groups are balanced longest-processing-time
    first, with task durations estimated from earlier results."""
    if free <= len(jobs) or not jobs:
        return {}
    devices = {j.id: 1 for j in jobs}
    work = {j.id: sum(estimate(t) for t in j.tasks) for j in jobs}
    by_id = {j.id: j for j in jobs}
    for _ in range(free - len(jobs)):
        splittable = [j for j in jobs if devices[j.id] < len(j.tasks)]
        if not splittable:
            break
        most = max(splittable, key=lambda j: (work[j.id] / devices[j.id], -j.created_at))
        devices[most.id] += 1
    plan = {}
    for jid, n in devices.items():
        if n > 1:
            groups: list[list[dict[str, Any]]] = [[] for _ in range(n)]
            loads = [0.0] * n
            for t in sorted(by_id[jid].tasks, key=estimate, reverse=True):
                k = loads.index(min(loads))
                groups[k].append(t)
                loads[k] += estimate(t)
            plan[jid] = groups
    return plan


def help_plan(
    running: Sequence[Job],
    spare: Sequence[Device],
    helping: dict[str, int],
    tried: set[tuple[str, int, str]],
) -> list[tuple[Job, Device]]:
    """Devices still free once every eligible job has one join a running job's tasks (one
    task spread over idle devices): each to the job with the fewest helpers (then the one
    running longest). Only jobs with a journal (a content fingerprint) can be shared, and only
    by devices of the job's own kind (a CPU slot never holds a chunk a GPU job waits for, and
    never mixes its numerics into a GPU's result); a device helps one attempt of a job at most
    once (`tried`: job id, attempt, device id), so a helper that found nothing left is not
    started again."""
    count = dict(helping)
    plan = []
    for device in sorted(spare, key=lambda d: (d.kind != "cuda", d.id)):
        options = [
            j
            for j in running
            if j.fingerprint
            and j.device
            and device_kind(j.device) == device.kind
            and (j.id, j.attempt, device.id) not in tried
        ]
        if not options:
            continue
        job = min(options, key=lambda j: (count.get(j.id, 0), j.started_at or 0.0, j.id))
        count[job.id] = count.get(job.id, 0) + 1
        plan.append((job, device))
    return plan


def next_retry_at(jobs: Sequence[Job], now: float) -> float | None:
    """When the earliest backed-off job becomes eligible (None if none is waiting)."""
    waits = [j.not_before for j in jobs if j.state == "queued" and j.not_before > now]
    return min(waits) if waits else None


def step_due(step: int | None, final: bool, every_n_steps: int) -> bool:
    """policy.every_n_steps: steps divisible by N are evaluated; final checkpoints always."""
    return final or step is None or step % every_n_steps == 0


def order_key(step: int | None, final: bool) -> float:
    """Sort key for a checkpoint in its run: its step; a final just after its step; a final with
    no known step after everything."""
    if step is None:
        return 1e18
    return step + (0.5 if final else 0.0)
