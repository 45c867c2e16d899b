"""What runs inside the sandbox, in front of one model-written program: the standard library
only. The sandbox's server (forkserver.py) holds this file's text as a module and calls `main`
in a child forked for each program; the child then ends at once (`os._exit`: nothing the
program left behind, atexit or threads, runs after its verdict).

It reads one request (JSON on stdin until EOF): the program's source, its stdin, whether it
runs as `__main__` (a stdin/stdout program) or as lm-eval's `code_eval` runs it (in an empty
namespace, its output swallowed, `code_eval`'s `reliability_guard` applied: the same verdicts
on the same programs), and the limits. It sets the limits on itself, runs the program, and
writes its verdict (JSON) to the file descriptor the request names: `passed`, `failed` (an assertion),
`runtime_error`, `memory`, `timeout` (CPU time) or `syntax_error`, with the first lines of the
error. A program that ends the process itself leaves no verdict; the host then judges by how it
ended. What the program prints goes to stdout, which the host reads.

A request with `tests` (their inputs only) runs the program on each, in order, in this one
process, as LiveCodeBench's own grader does (its `testing_util.py`): a fresh run of the program
(`call` absent: as `__main__`, the test's input as stdin, its stdout kept in the form
LiveCodeBench compares, `canonical_output`) or a call (`call` names a function, or a method of
one `Solution()`: the input's lines are its JSON arguments, the result kept as JSON, a tuple as a
list). LiveCodeBench's import header comes first. Each test gets the CPU and wall-clock limits
on its own; an error or a limit ends the run. The expected outputs never come in: the host
compares what each test gave (`sandbox/judge.py`), so a program cannot read them or change the
comparison.
"""

from __future__ import annotations

import builtins
import io
import json
import math
import os
import resource
import signal
import sys
import time
import traceback
import types

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


def _limits(limits: dict, tests: int = 1) -> None:
    # each test has its own limit (a timer, _run_tests): the process, all of theirs, whole
    # seconds up, and one for the runner itself where there are tests
    cpu = math.ceil(float(limits["cpu_seconds"]) * max(1, tests)) + (1 if tests else 0)
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
        # beside the program's own: the sandbox's init and the server it was forked from
        processes += 2
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


def _guard(exit_too: bool = True) -> None:
    """What lm-eval's `code_eval` takes away from a program before running it (its
    `reliability_guard`), so that a program relying on any of these fails here as there
    (LiveCodeBench's own guard keeps `exit`: `exit_too` false)."""
    import shutil
    import subprocess

    os.environ["OMP_NUM_THREADS"] = "1"  # (before putenv goes)
    if exit_too:
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


# --- a program judged against tests (LiveCodeBench's protocol) -----------------------------

# LiveCodeBench's header (lcb_runner/evaluation/testing_util.py), before every program it runs
IMPORTS = (
    "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\n"
    "from heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\n"
    "from random import *\nfrom statistics import *\nfrom itertools import *\n"
    "from functools import *\nfrom operator import *\nfrom io import *\nfrom sys import *\n"
    "from json import *\nfrom builtins import *\nfrom typing import *\nimport string\nimport re\n"
    "import datetime\nimport collections\nimport heapq\nimport bisect\nimport copy\nimport math\n"
    "import random\nimport statistics\nimport itertools\nimport functools\nimport operator\n"
    "import io\nimport sys\nimport json\nsys.setrecursionlimit(50000)\n"
)
SHOWN = 200  # characters of an input, output or answer quoted in a verdict
LONGEST_INT = 50_000  # digits of an int <-> str, as LiveCodeBench's grader allows


class _TestTimeLimit(BaseException):
    """One test's CPU time is spent (not an Exception: a program's `except Exception` must not
    swallow it)."""


def _on_test_clock(signum: int, frame: object) -> None:
    raise _TestTimeLimit


def shortened(value: object) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= SHOWN else text[: SHOWN // 2] + " ... " + text[-SHOWN // 2 :]


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def canonical_output(text: str) -> str:
    """A stdin program's output as LiveCodeBench compares it (stripped lines, each equal as
    text or as a row of decimal numbers), in one form: two outputs it takes for equal have the
    same form. The host compares these (`sandbox/judge.py`); also used there."""
    from decimal import Decimal, InvalidOperation

    rows: list[object] = []
    for line in _lines(text):
        try:
            numbers = [Decimal(t) for t in line.split()]
        except (InvalidOperation, ValueError):
            numbers = None
        if not numbers or any(n.is_nan() for n in numbers):
            rows.append(["t", line])
        else:
            rows.append(["d", ["0" if n.is_zero() else str(n.normalize()) for n in numbers]])
    return json.dumps(rows)


def digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def _has_tuple(value: object) -> bool:
    if isinstance(value, tuple):
        return True
    if isinstance(value, list):
        return any(_has_tuple(v) for v in value)
    if isinstance(value, dict):
        return any(_has_tuple(v) for v in value.values())
    return False


def _one_test(
    header: types.CodeType, code: types.CodeType, call: str | None, test: dict, solved: dict
) -> dict:
    """Run one test (its input only: its expected output never enters the sandbox); what the
    program gave, for the host to compare. `solved`: a functional program's function, made at
    its first test and called by every test (LiveCodeBench makes one `Solution()`)."""
    if call is None:
        namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
        stdin = io.TextIOWrapper(io.BytesIO(str(test["input"]).encode()), encoding="utf-8")
        out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
        sys.stdin, sys.stdout = stdin, out
        try:
            exec(header, namespace)
            exec(code, namespace)
        except SystemExit:  # any exit ends the run, as LiveCodeBench's grader takes it
            pass
        finally:
            sys.stdin, sys.stdout = sys.__stdin__, sys.__stdout__
        got = out.buffer.getvalue().decode("utf-8", errors="replace")
        return {"digest": digest(canonical_output(got)), "shown": shortened(got)}
    if "function" not in solved:
        namespace = {"__name__": "solution", "__builtins__": builtins}
        exec(header, namespace)
        exec(code, namespace)
        owner = namespace["Solution"]() if "Solution" in namespace else None
        solved["function"] = (
            getattr(owner, call, None) if owner is not None else namespace.get(call)
        )
    function = solved["function"]
    if function is None:
        raise NameError(f"the program defines no {call}()")
    args = [json.loads(line) for line in str(test["input"]).split("\n")]
    result = function(*args)
    if isinstance(result, tuple):  # LiveCodeBench's one allowance
        result = list(result)
    if _has_tuple(result):  # equal to no JSON value, as in LiveCodeBench's comparison
        return {"unequal": "a tuple inside the result", "shown": shortened(result)}
    try:
        text = json.dumps(result, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        return {
            "unequal": f"a {type(result).__name__}, not a JSON value",
            "shown": shortened(result),
        }
    if len(text) <= INLINE_JSON:
        return {"json": text}
    return {
        "digest": digest(json.dumps(json.loads(text), sort_keys=True)),
        "shown": shortened(text),
    }


INLINE_JSON = 2048  # a functional test's result sent whole up to this; past it, its digest


def _run_tests(request: dict) -> dict:
    tests, call = request["tests"], request.get("call")
    cpu = float(request["limits"]["cpu_seconds"])
    wall = float(request["limits"]["wall_seconds"])
    # LiveCodeBench's grader lifts Python's 4300-digit limit on int <-> str (its tests have
    # longer numbers); the tests' own JSON is read under it too
    sys.set_int_max_str_digits(LONGEST_INT)
    header = compile(IMPORTS, "<imports>", "exec")
    try:
        code = compile(request["source"], PROGRAM, "exec")
    except (SyntaxError, ValueError) as e:
        return {"status": "syntax_error", "error": _error(e), "outputs": []}
    _guard(exit_too=False)
    signal.signal(signal.SIGPROF, _on_test_clock)
    signal.signal(signal.SIGALRM, _on_test_clock)
    solved: dict = {}
    outputs: list[dict] = []
    for i, test in enumerate(tests):
        which = f"test {i + 1} of {len(tests)}"
        signal.setitimer(signal.ITIMER_PROF, cpu)  # CPU time of this process, this test
        signal.setitimer(signal.ITIMER_REAL, wall)  # a test that waits instead of computing
        began = time.monotonic()
        try:
            outputs.append(_one_test(header, code, call, test, solved))
        except _TestTimeLimit:
            over = (f"no end after {wall:g} s of wall-clock time"
                    if time.monotonic() - began >= wall else f"over {cpu:g} s of CPU time")  # fmt: skip
            return {"status": "timeout", "error": f"{which}: {over}", "outputs": outputs}
        except MemoryError as e:
            return {"status": "memory", "error": f"{which}: {_error(e)}", "outputs": outputs}
        except BaseException as e:  # what the program raised is its verdict
            return {"status": "runtime_error", "error": f"{which}: {_error(e)}",
                    "outputs": outputs}  # fmt: skip
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.setitimer(signal.ITIMER_REAL, 0)
    return {"status": "ran", "error": "", "outputs": outputs}


def warm() -> None:
    """Import ahead what every run imports (`_guard`'s, the tests protocol's), once in the
    server each child is forked from: a child then starts with them, as after its own import."""
    import decimal  # noqa: F401
    import hashlib  # noqa: F401
    import shutil  # noqa: F401
    import subprocess  # noqa: F401


def main() -> None:
    global _report_fd
    request = json.loads(sys.stdin.buffer.read())
    _report_fd = int(request["report_fd"])
    # the program's own stdin, as a real file descriptor 0 (in its folder: the sandbox's /tmp,
    # emptied after it), written before the limits: the file size limit is the program's
    fd = os.open(".program-stdin", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    data = request.get("stdin", "").encode()
    while data:
        data = data[os.write(fd, data) :]
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(fd, 0)
    os.close(fd)
    os.unlink(".program-stdin")
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    _limits(request["limits"], len(request.get("tests") or ()))
    signal.signal(signal.SIGXCPU, _on_cpu_limit)
    if request.get("tests") is not None:
        _report(_run_tests(request))
        return
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
