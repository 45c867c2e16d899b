"""The warm executor's process work, with a stand-in worker that speaks the warm protocol (job
folders on stdin, status lines on the status fd) but loads no model: jobs handed to one worker,
a packed job on a one-shot worker, a worker dying mid-job, kill, idle exit, close."""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import time
from pathlib import Path

import pytest

from ckpt_watcher.executors.warm import WarmExecutor
from ckpt_watcher.jobfolder import (
    KILLED_FILE,
    PREPARE_DIR,
    EvalRequest,
    JobFolder,
    JobSpec,
    warm_home,
)

from .helpers import alive, gone

# Stands in for `python`: `-m ckpt_watcher.worker --serve HOME SETTINGS` serves jobs, and
# `-m ckpt_watcher.worker JOB_DIR` runs one. A job's `fake.json` says how long it takes and its
# code; "die": the whole worker exits mid-job with that code; "fork": it forks a child that
# outlives it.
FAKE_PYTHON = f"""#!{sys.executable}
import json, os, select, sys, time
from pathlib import Path

def run(job_dir):
    spec = json.loads((Path(job_dir) / "fake.json").read_text())
    if spec.get("fork"):  # a child that outlives it, holding what it inherited (vLLM's engine)
        child = os.fork()
        if child == 0:
            time.sleep(600)
            os._exit(0)
        (Path(job_dir) / "forked").write_text(str(child))
    (Path(job_dir) / "ran_by").write_text(str(os.getpid()))
    time.sleep(spec.get("seconds", 0))
    if "die" in spec:
        os._exit(spec["die"])
    return spec.get("rc", 0)

args = sys.argv[1:]
if args[2] != "--serve":
    sys.exit(run(args[2]))
fd, idle = int(os.environ["CKPT_WATCHER_STATUS_FD"]), json.loads(args[4])["idle_seconds"]
while select.select([sys.stdin], [], [], idle)[0]:
    line = sys.stdin.readline()
    if not line:
        break
    if line.startswith("prepare "):  # an engine ahead of its weights: 0 ready, 1 failed
        folder = line[len("prepare "):].strip()
        os.write(fd, f"{{run(folder)}} {{folder}}\\n".encode())
        continue
    os.write(fd, f"{{run(line.strip())}} {{line.strip()}}\\n".encode())
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    return str(path)


def _job(
    tmp: Path, job_id: str, device: str = "cuda:0", run: str = "", **fake: object
) -> JobFolder:
    folder = JobFolder.of(tmp / "state", job_id, 1)
    request = EvalRequest("/ckpt", "hf", {}, [], 42, {}, None, None, None, None, "/r", "cpu")
    folder.write_spec(JobSpec(job_id, device, request, run_path=run))
    (folder.path / "fake.json").write_text(json.dumps(fake))
    return folder


def _prepare(tmp: Path, run: str, device: str = "cuda:0", **fake: object) -> JobFolder:
    """A request for an engine ahead of `run`'s weights (jobs/early.py writes it there)."""
    folder = JobFolder(warm_home(tmp / "state", device) / PREPARE_DIR)
    request = EvalRequest("/step", "vllm", {}, [], 42, {}, None, None, None, None, "/r", "cpu")
    folder.write_spec(JobSpec(run, device, request))
    (folder.path / "fake.json").write_text(json.dumps(fake))
    return folder


def test_an_engine_prepared_ahead_is_known_by_its_run_until_it_fails_serves_or_is_given_back(
    tmp_path: Path, fake_python: str
) -> None:
    """What jobs/early.py and scheduler.assign read of the warm workers: the run whose model
    each idle engine holds. A prepare that failed holds none (its device is not kept for the
    run, which may be tried elsewhere); a job's run replaces it; a worker given back is killed
    on purpose (counted as no failure) and known no more."""
    ex, q = _executor(tmp_path, fake_python)
    try:
        assert ex.prepare("cuda:0", _prepare(tmp_path, "A", rc=1, seconds=0.5), {})
        assert ex.idle_engines() == {"cuda:0": "A"}  # starting
        assert _wait(lambda: ex.idle_engines() == {"cuda:0": None})  # it failed
        assert ex.prepare("cuda:0", _prepare(tmp_path, "A", rc=0), {})
        time.sleep(0.5)
        assert ex.idle_engines() == {"cuda:0": "A"}  # ready
        b = _job(tmp_path, "b", run="B", seconds=0.5)
        ex.start("b", b, {})
        assert ex.idle_engines() == {}  # busy
        assert _exits(q, 1) == {"b": 0}
        assert ex.idle_engines() == {"cuda:0": "B"}  # its engine now holds B's model
        (pid,) = ex.worker_pids()
        ex.release("cuda:0")
        assert gone(pid) and ex.idle_engines() == {}
        assert (warm_home(tmp_path / "state", "cuda:0") / KILLED_FILE).read_text() == str(pid)
        assert q.empty()  # no job of its
    finally:
        ex.close(timeout=5)


def _wait(ok, seconds: float = 10) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not ok():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _exits(q: queue.Queue[tuple[str, int]], n: int, timeout: float = 20) -> dict[str, int]:
    out = {}
    deadline = time.monotonic() + timeout
    while len(out) < n:
        job_id, rc = q.get(timeout=max(0.1, deadline - time.monotonic()))
        out[job_id] = rc
    return out


def _executor(tmp: Path, fake_python: str, idle: float = 30) -> tuple[WarmExecutor, queue.Queue]:
    q: queue.Queue[tuple[str, int]] = queue.Queue()
    ex = WarmExecutor(
        lambda j, rc: q.put((j, rc)),
        tmp / "state",
        idle_seconds=idle,
        verify_every=20,
        python=fake_python,
    )
    return ex, q


def test_jobs_for_one_device_go_to_one_worker_and_a_packed_job_gets_its_own(
    tmp_path: Path, fake_python: str
) -> None:
    ex, q = _executor(tmp_path, fake_python)
    try:
        a = _job(tmp_path, "a", seconds=0.5)
        # both still running when asked (a packed job that ends at once can be done and gone
        # before `running()` looks: seen once in CI)
        packed = _job(tmp_path, "packed", rc=3, seconds=0.5)
        ha = ex.start("a", a, {})
        hp = ex.start("packed", packed, {})  # device busy with "a"
        assert hp.pid != ha.pid and ex.running() == {"a", "packed"}
        assert _exits(q, 2) == {"a": 0, "packed": 3}
        b = _job(tmp_path, "b", rc=3)
        hb = ex.start("b", b, {})
        assert _exits(q, 1) == {"b": 3}
        assert hb.pid == ha.pid  # the same warm worker, kept between jobs
        assert (a.path / "ran_by").read_text() == (b.path / "ran_by").read_text() == str(ha.pid)
        assert ex.worker_pids() == {ha.pid} and ex.running() == set()
    finally:
        ex.close(timeout=5)
    assert ex.worker_pids() == set()


def test_a_worker_that_dies_mid_job_fails_that_job_and_the_next_gets_a_new_worker(
    tmp_path: Path, fake_python: str
) -> None:
    ex, q = _executor(tmp_path, fake_python)
    try:
        a = _job(tmp_path, "a", die=0)  # even a clean exit mid-job must not read as success
        ha = ex.start("a", a, {})
        assert _exits(q, 1)["a"] != 0
        b = _job(tmp_path, "b")
        hb = ex.start("b", b, {})
        assert _exits(q, 1) == {"b": 0} and hb.pid != ha.pid
    finally:
        ex.close(timeout=5)


def _forked(folder: JobFolder) -> tuple[int, int]:
    """(the worker, the child it forked) once the job runs."""
    deadline = time.monotonic() + 20
    while not (folder.path / "ran_by").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return int((folder.path / "ran_by").read_text()), int((folder.path / "forked").read_text())


def test_a_worker_killed_while_a_child_it_forked_holds_its_report_pipe_ends_its_job(
    tmp_path: Path, fake_python: str
) -> None:
    """vLLM's engine core on CUDA is forked from the worker, so it holds the write end of the
    worker's report pipe. Seen on an H100: the worker killed -9, its engine lived on holding
    25 GB, the pipe never ended and the job waited for its time-out. The worker's exit is what
    ends its job, and the rest of its process group goes with it."""
    ex, q = _executor(tmp_path, fake_python)
    try:
        a = _job(tmp_path, "a", seconds=60, fork=True)
        ex.start("a", a, {})
        worker, child = _forked(a)
        os.kill(worker, signal.SIGKILL)
        assert _exits(q, 1, timeout=10)["a"] == -signal.SIGKILL
        assert gone(worker, child)
        b = _job(tmp_path, "b")
        hb = ex.start("b", b, {})
        assert _exits(q, 1) == {"b": 0} and hb.pid != worker
    finally:
        ex.close(timeout=5)


def test_an_adopted_worker_killed_takes_what_it_forked_with_it(
    tmp_path: Path, fake_python: str
) -> None:
    """A worker the last daemon started, killed -9 under the next one: the child it forked (its
    engine) must not live on holding the GPU."""
    import subprocess
    import threading

    from ckpt_watcher.executors.base import WorkerHandle
    from ckpt_watcher.jobfolder import WORKER_MODULE
    from ckpt_watcher.proctable import process_start_token

    a = _job(tmp_path, "a", seconds=60, fork=True)
    earlier = subprocess.Popen(  # as the dead daemon started it: a session of its own
        [fake_python, "-m", WORKER_MODULE, str(a.path)], start_new_session=True
    )
    threading.Thread(target=earlier.wait, daemon=True).start()  # its parent here reaps it
    worker, child = _forked(a)
    ex, q = _executor(tmp_path, fake_python)
    try:
        token = process_start_token(worker)
        assert token and ex.adopt("a", WorkerHandle("a", worker, token), a)
        os.kill(worker, signal.SIGKILL)
        assert _exits(q, 1)["a"] == -signal.SIGKILL
        assert gone(worker, child)
    finally:
        ex.close(timeout=5)


def test_kill_ends_the_job_and_its_worker_and_idle_workers_exit_alone(
    tmp_path: Path, fake_python: str
) -> None:
    ex, q = _executor(tmp_path, fake_python, idle=1)
    try:
        a = _job(tmp_path, "a", seconds=60)
        ha = ex.start("a", a, {})
        ex.kill("a")
        assert _exits(q, 1)["a"] < 0
        # killed on purpose: the next worker of cuda:0 must not count it as a failing engine
        killed = warm_home(tmp_path / "state", "cuda:0") / KILLED_FILE
        assert killed.read_text() == str(ha.pid)
        b = _job(tmp_path, "b", device="cuda:1")
        hb = ex.start("b", b, {})
        assert _exits(q, 1) == {"b": 0}
        deadline = time.monotonic() + 10  # idle for 1 s: it exits by itself
        while ex.worker_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ex.worker_pids() == set()
        for pid in (ha.pid, hb.pid):
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        ex.close(timeout=5)


def test_a_worker_near_its_idle_release_is_let_go_instead_of_handed_a_job(
    tmp_path: Path, fake_python: str
) -> None:
    # idle release after 2.5 s; within 2 s of it (here: idle for over 0.5 s) no new job
    ex, q = _executor(tmp_path, fake_python, idle=2.5)
    try:
        a = _job(tmp_path, "a")
        ha = ex.start("a", a, {})
        assert _exits(q, 1) == {"a": 0}
        time.sleep(1.0)
        b = _job(tmp_path, "b")
        hb = ex.start("b", b, {})
        assert _exits(q, 1) == {"b": 0} and hb.pid != ha.pid
        assert ha.pid in ex.worker_pids() or not alive(ha.pid)  # ours until it has gone
        deadline = time.monotonic() + 10
        while alive(ha.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(ha.pid) and ex.worker_pids() == {hb.pid}
    finally:
        ex.close(timeout=5)


SIGTERM_AFTER_FORK = """
import multiprocessing as mp, os, signal, sys
from ckpt_watcher.worker.serve import handle_sigterm
handle_sigterm()

def disposition(q):
    q.put(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)

q = mp.get_context("fork").SimpleQueue()
child = mp.get_context("fork").Process(target=disposition, args=(q,))
child.start()
child.join(30)
print(q.get(), signal.getsignal(signal.SIGTERM) != signal.SIG_DFL)
"""


def test_processes_a_warm_worker_forks_keep_the_default_sigterm() -> None:
    """lm-eval's bootstrap Pool forks from the worker; a pool child that inherited the warm
    worker's release-on-SIGTERM handler could ignore Pool.terminate() and hang the job."""
    import subprocess

    r = subprocess.run(
        [sys.executable, "-c", SIGTERM_AFTER_FORK], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr[-2000:]
    # the forked child dies on SIGTERM by default; the worker itself still releases on it
    assert r.stdout.split() == ["True", "True"], r.stdout


def test_a_warm_engine_that_keeps_crashing_jobs_makes_status_degraded(tmp_path: Path) -> None:
    """Three different jobs in a row that crash on one device's warm worker (a real one, served
    job folders whose spec cannot be read) is an engine problem: `watcher status` says so and
    exits 5. A job retried on the same device counts once; a worker the daemon killed on
    purpose is no failure; a job that ends well clears the count."""
    import subprocess

    from ckpt_watcher import status as status_mod
    from ckpt_watcher.config import load_config
    from ckpt_watcher.jobfolder import ENGINE_FILE, STATUS_FD_ENV, warm_home
    from ckpt_watcher.state import State
    from ckpt_watcher.worker.serve import Failing

    from .conftest import idle_config

    cfg = load_config(idle_config(tmp_path))
    State(cfg.state_dir).close()
    home = warm_home(cfg.state_dir, "cpu:0")
    home.mkdir(parents=True)
    read_fd, write_fd = os.pipe()
    settings = {"device": "cpu:0", "idle_seconds": 60, "verify_every": 0}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_watcher.worker", "--serve", str(home), json.dumps(settings)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=os.environ | {STATUS_FD_ENV: str(write_fd)},
        pass_fds=(write_fd,),
    )
    os.close(write_fd)
    assert proc.stdin is not None
    with os.fdopen(read_fd, "rb") as status_pipe:
        for job, attempt in [("j1", 1), ("j1", 2), ("j2", 1), ("j3", 1)]:
            folder = JobFolder.of(cfg.state_dir, job, attempt)
            folder.path.mkdir(parents=True)
            (folder.path / "spec.json").write_text("{not json")
            proc.stdin.write(f"{folder.path}\n".encode())
            proc.stdin.flush()
            assert status_pipe.readline()  # its exit, as the daemon reads it
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    engine = json.loads((home / ENGINE_FILE).read_text())
    assert engine["failing"]["jobs"] == ["j1", "j2", "j3"] and engine["state"] == "released"
    data = status_mod.gather(cfg)
    (why,) = data["degraded"]
    assert why.startswith(
        "warm engine on cpu:0: 3 jobs in a row crashed on it (last: job j3: exit 4"
    )
    assert status_mod.exit_code(data | {"daemon": {"alive": True, "stale": False}}) == 5
    # the next worker finds a predecessor that died in a job: counted, unless we killed it
    busy = {"state": "busy", "job": "j4", "pid": 4242, "failing": {"jobs": ["j2"], "last": "x"}}
    assert Failing(busy, killed=None).jobs == ["j2", "j4"]
    assert Failing(busy, killed="4242").jobs == ["j2"]
    failing = Failing(busy, killed="4242")  # the pid WarmExecutor.kill left in KILLED_FILE
    failing.ended("j5", 0)  # ok: the engine works
    assert failing.as_dict() == {"jobs": [], "last": None}


def test_a_real_warm_worker_reports_a_failed_prepare_then_lets_go_when_idle(
    tmp_path: Path,
) -> None:
    """`python -m ckpt_watcher.worker --serve` itself (no model is loaded): a request for an
    engine ahead of a step that has no config yet fails and is reported (its device is not
    kept for that run), and the worker, idle for `idle_seconds`, releases and exits by itself,
    saying so in its engine.json, while the executor runs on."""
    ex, q = _executor(tmp_path, sys.executable, idle=2)
    try:
        assert ex.prepare("cuda:0", _prepare(tmp_path, "A"), {})  # "/step": nothing there
        assert _wait(lambda: ex.idle_engines() == {"cuda:0": None}, 60)
        (pid,) = ex.worker_pids()
        assert gone(pid, seconds=30)  # let go when idle
        engine = json.loads((warm_home(tmp_path / "state", "cuda:0") / "engine.json").read_text())
        assert engine["state"] == "released" and engine["ready_for"] is None, engine
        said = (warm_home(tmp_path / "state", "cuda:0") / "worker.log").read_text()
        assert "engine.prepare_failed" in said and "idle for 2 s" in said, said[-2000:]
        assert ex.idle_engines() == {} and q.empty()
    finally:
        ex.close(timeout=5)


def test_a_prepare_and_its_job_sent_in_one_write_are_both_read() -> None:
    """The warm worker's stdin: a request for an engine ahead and the job of that step, sent
    in one pass, come in one read; the job is read once the engine is up, not left in a
    buffer `select` does not see (a Ray node's worker waited for ever so)."""
    from ckpt_watcher.worker.serve import Lines

    r, w = os.pipe()
    os.write(w, b"prepare /state/prepare\n/state/jobs/j/attempt-1\n/state/jobs/k")
    lines = Lines(r)
    assert lines.next(1.0) == "prepare /state/prepare\n"
    assert lines.next(1.0) == "/state/jobs/j/attempt-1\n"
    assert lines.next(0.05) is None  # half a line: not a job yet
    os.write(w, b"/attempt-1\n")
    assert lines.next(1.0) == "/state/jobs/k/attempt-1\n"
    os.close(w)
    assert lines.next(1.0) == ""
    os.close(r)
