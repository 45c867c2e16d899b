"""What runs inside the sandbox, in front of one model-written program: the standard library
only (it is run as `python -c` with this file's text, under the limits the host gives it).

It reads one request (JSON on stdin until EOF): the program's source, its stdin, whether it
runs as `__main__` (a stdin/stdout program) or as lm-eval's `code_eval` runs it (in an empty
namespace, its output swallowed, `code_eval`'s `reliability_guard` applied: the same verdicts
on the same programs), and the limits. It sets the limits on itself, runs the program, and
writes its verdict (JSON) to the file descriptor the request names: `passed`, `failed` (an assertion),
`runtime_error`, `memory`, `timeout` (CPU time) or `syntax_error`, with the first lines of the
error. A program that ends the process itself leaves no verdict; the host then judges by how it
ended. What the program prints goes to stdout, which the host reads.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import resource
import signal
import sys
import traceback

PROGRAM = "<program>"
ERROR_LINES = 6
_report_fd = 3  # the request names it


def _report(verdict: dict) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    verdict["cpu_seconds"] = round(usage.ru_utime + usage.ru_stime, 3)
    os.write(_report_fd, json.dumps(verdict).encode())


def _error(e: BaseException) -> str:
    """The error, with the program's own frames only (never the runner's)."""
    te = traceback.TracebackException.from_exception(e, limit=None)
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename == PROGRAM])
    lines = [ln for ln in "".join(te.format()).strip().splitlines() if ln.strip()]
    if lines and lines[0].startswith("Traceback"):
        lines = lines[1:]
    return "\n".join(lines[-ERROR_LINES:])[:1000]


def _limits(limits: dict) -> None:
    cpu = int(limits["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL
    memory = int(limits["memory_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    size = int(limits["file_size_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    files = int(limits["open_files"])
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    processes = int(limits["processes"])
    if processes > 1:  # else the seccomp filter refuses every new process
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))


def _on_cpu_limit(signum: int, frame: object) -> None:
    _report({"status": "timeout", "error": "CPU time limit reached"})
    os._exit(0)


class _Unreadable(io.StringIO):
    """code_eval's stdin: reading it raises."""

    def read(self, *args: object, **kwargs: object) -> str:
        raise OSError("stdin is not readable here")

    readline = readlines = read  # type: ignore[assignment]

    def readable(self) -> bool:
        return False


def _guard() -> None:
    """What lm-eval's `code_eval` takes away from a program before running it (its
    `reliability_guard`), so that a program relying on any of these fails here as there."""
    import shutil
    import subprocess

    os.environ["OMP_NUM_THREADS"] = "1"  # (before putenv goes)
    builtins.exit = None  # type: ignore[assignment]
    builtins.quit = None  # type: ignore[assignment]
    builtins.help = None  # type: ignore[assignment]
    for name in (
        "kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork",
        "forkpty", "killpg", "rename", "renames", "truncate", "replace", "unlink", "fchmod",
        "fchown", "chmod", "chown", "chroot", "lchflags", "lchmod", "lchown", "getcwd", "chdir",
    ):  # fmt: skip
        if hasattr(os, name):
            setattr(os, name, None)
    shutil.rmtree = shutil.move = shutil.chown = None  # type: ignore[assignment]
    subprocess.Popen = None  # type: ignore[assignment,misc]
    for name in ("ipdb", "joblib", "resource", "psutil", "tkinter"):
        sys.modules[name] = None  # type: ignore[assignment]


def main() -> None:
    global _report_fd
    request = json.loads(sys.stdin.buffer.read())
    _report_fd = int(request["report_fd"])
    _limits(request["limits"])
    signal.signal(signal.SIGXCPU, _on_cpu_limit)
    # the program's own stdin, as a real file descriptor 0
    fd = os.open("/tmp/.program-stdin", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, request.get("stdin", "").encode())
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(fd, 0)
    os.close(fd)
    os.unlink("/tmp/.program-stdin")
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    as_main = bool(request.get("as_main"))
    try:
        code = compile(request["source"], PROGRAM, "exec")
    except (SyntaxError, ValueError) as e:
        _report({"status": "syntax_error", "error": _error(e)})
        return
    namespace: dict = {"__name__": "__main__", "__builtins__": builtins} if as_main else {}
    if not as_main:
        _guard()
        sys.stdout = sys.stderr = io.StringIO()  # swallowed, as code_eval swallows them
        sys.stdin = _Unreadable()
    status, error = "passed", ""
    try:
        exec(code, namespace)
    except SystemExit as e:
        if not as_main or e.code not in (None, 0):
            status, error = ("failed" if not as_main else "runtime_error"), _error(e)
    except AssertionError as e:
        status, error = "failed", _error(e)
    except MemoryError as e:
        status, error = "memory", _error(e)
    except BaseException as e:  # anything a program can raise is its verdict
        status, error = "runtime_error", _error(e)
    finally:
        try:
            sys.__stdout__.flush()  # type: ignore[union-attr]
        except Exception:  # a program that closed its stdout
            pass
    _report({"status": status, "error": error})


if __name__ == "__main__":  # `python -c` with this text: the host's launch
    main()
    os._exit(0)  # nothing the program left behind (atexit, threads) runs after its verdict
