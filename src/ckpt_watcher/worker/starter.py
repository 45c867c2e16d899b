"""The worker starter: one process per daemon that imports what every worker imports (torch,
transformers, datasets, lm-eval) once, then forks a worker from itself for each job.

A cold worker spent 11 of its 13 s importing those (a CPU host, docs/benchmarks.md), and a GPU
host's about 31 s before its engine started; a daemon evaluating every checkpoint of a run paid
that again for each one. A forked worker starts with them imported and becomes the process
`python -m ckpt_watcher.worker JOB_DIR` would be: its own session, the job's log as stdout and
stderr, the job's environment, its share of the cores, and the same path to its exit code.

The daemon's side is `executors/starter.py`. The starter dies with its daemon (its workers do
not: a next daemon adopts them). The protocol, one JSON object a message or line:
- fd 0, a Unix socket from the daemon, one message per request: `{"job": DIR, "log": FILE,
  "env": {...}}` for a job's worker, or `{"serve": HOME, "settings": {...}, "log": FILE, "env":
  {...}}` for a warm worker (worker/serve.py), with two file descriptors passed along: the
  read end of its job pipe (its stdin) and the write end of its status pipe, both the
  daemon's pipes, as a plain warm worker's are. The socket's end (the daemon stopped or died)
  ends the starter, never its workers;
- fd 1, to the daemon: `{"ready": true}` once the imports are done (or `{"ready": false,
  "why": ...}` and the starter exits), then `{"started": PID}` or `{"failed": WHY}` for each
  job, in order, and `{"exited": PID, "rc": RC}` as each worker ends (RC negative: killed by
  that signal, as `subprocess` says it);
- fd 2: the starter's own log.

Forking is safe only while nothing has touched CUDA: a driver initialized before a fork is
unusable in the child, and which GPU a worker sees (CUDA_VISIBLE_DEVICES) is read then. So
torch's availability checks go through NVML here (PYTORCH_NVML_BASED_CUDA_CHECK), vLLM (which
probes its platform) is not imported, and after the imports the starter checks that neither
torch nor the driver was initialized; if either was, it says so and exits, and the daemon
starts its workers as plain processes. The native thread pools the imports start (OpenBLAS,
jemalloc) have their own fork handlers, as for any fork after `import numpy`.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ckpt_watcher.jobfolder import STATUS_FD_ENV, WORKER_NAME
from ckpt_watcher.proctable import set_name

REPORTS_FD = 1
REQUEST_BYTES = 1 << 20  # a request's most: its environment, mostly
# What a worker imports before its first task, on either backend (vLLM excepted, see above).
PRELOAD = (
    "torch",
    "transformers",
    "datasets",
    "lm_eval.evaluator",
    "lm_eval.models.huggingface",
    # what loading any architecture imports first (its loss functions import SciPy's optimize):
    # 0.27 s of each hf worker's CPU when left to the worker
    "transformers.modeling_utils",
    "ckpt_watcher.worker.job",
    "ckpt_watcher.evaluators.harness",
)
CUDA_ERROR_NOT_INITIALIZED = 3
forked_from: int | None = None  # in a forked worker: the starter's pid (its log says so)


def _report(message: dict[str, Any]) -> None:
    os.write(REPORTS_FD, (json.dumps(message) + "\n").encode())


def _note(text: str) -> None:
    sys.stderr.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} starter: {text}\n")
    sys.stderr.flush()


def preload(modules: tuple[str, ...] = PRELOAD) -> list[str]:
    """Import what can be imported of `modules`; returns those that were."""
    done = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # a worker that needs it fails on its own, and says why
            _note(f"not preloaded: {name}: {type(e).__name__}: {e}")
        else:
            done.append(name)
    return done


def fork_hazard(maps: str | None = None, driver: Any = None) -> str | None:
    """Why forking workers from this process would be unsafe (CUDA was initialized), or None.
    `maps` and `driver` are this process's memory map and CUDA driver unless given."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch initialized CUDA while importing"
    if maps is None:
        maps = Path("/proc/self/maps").read_text()
    if "libcuda.so" not in maps:
        return None  # the driver was never loaded, so never initialized
    if driver is None:
        driver = ctypes.CDLL("libcuda.so.1")  # loaded already: this only finds it
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED:
        return "the CUDA driver was initialized while importing"
    return None


def serve() -> list[str] | None:
    """The starter's life. Returns None when it ends (the daemon closed its socket); in a forked
    worker, returns that worker's arguments (`JOB_DIR`, or `--serve HOME SETTINGS_JSON`), which
    the caller runs as `python -m ckpt_watcher.worker` would."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # see the module's docstring
    began = time.monotonic()
    loaded = preload()
    hazard = fork_hazard()
    if hazard is not None:
        _note(f"not forking workers: {hazard}")
        _report({"ready": False, "why": hazard})
        return None
    from ckpt_watcher.evaluators import heap

    heap.settle()  # the workers share these pages, and their collections never walk them
    _note(f"ready in {time.monotonic() - began:.1f} s: {', '.join(loaded)}")
    _report({"ready": True, "preloaded": loaded})

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    requests = socket.socket(fileno=0)  # a SOCK_SEQPACKET: one request a message
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fd == wake_r:
                while _drain(wake_r):
                    pass
                continue
            data, fds, _, _ = socket.recv_fds(requests, REQUEST_BYTES, 2)
            if not data:
                _note("the daemon closed its socket: ending (running workers go on)")
                return None
            request = json.loads(data)
            named_r, named_w = os.pipe()
            try:
                pid = os.fork()
            except OSError as e:
                _report({"failed": str(e)})
                pid = -1
            if pid == 0:
                # Named before the daemon learns its pid: a worker the daemon (or its recovery)
                # looks at is never taken for the starter whose name it was forked with.
                set_name(WORKER_NAME)
                os.close(named_r)
                os.close(named_w)
                selector.close()
                requests.detach()  # fd 0 is the worker's stdin from here on
                os.close(wake_r)
                os.close(wake_w)
                return _become_worker(request, fds)
            for fd in fds:  # the worker's, and the daemon's: the starter keeps none
                os.close(fd)
            os.close(named_w)
            os.read(named_r, 1)  # end of file once the child has named itself (or is gone)
            os.close(named_r)
            if pid > 0:
                _report({"started": pid})
        _reap()


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _report({"exited": pid, "rc": os.waitstatus_to_exitcode(status)})


def _become_worker(request: dict[str, Any], fds: list[int]) -> list[str]:
    """In the forked child: the process a plain `python -m ckpt_watcher.worker ARGS` would have
    been, from here on (a warm worker's stdin and status pipe are the daemon's, passed in
    `fds`); returns ARGS."""
    global forked_from
    forked_from = os.getppid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    env = dict(request["env"])
    if "serve" in request:
        jobs, status = fds
        args = ["--serve", str(request["serve"]), json.dumps(request["settings"])]
        env[STATUS_FD_ENV] = str(status)
    else:
        jobs = os.open(os.devnull, os.O_RDONLY)
        args = [str(request["job"])]
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(jobs, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(jobs)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [sys.argv[0], *args]
    threads = env.get("OMP_NUM_THREADS")
    torch = sys.modules.get("torch")
    if threads and threads.isdigit() and torch is not None:
        torch.set_num_threads(int(threads))  # OpenMP read the starter's environment at import
    return args
