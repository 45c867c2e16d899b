"""Programs to verdicts, up to `parallel` at once, each one in a child forked for it by one of
the sandbox's servers (forkserver.py): a server is one bubblewrap sandbox around one warm
interpreter, started when first needed and kept for the next programs, so that a program costs a
fork, not a sandbox and an interpreter (about 30 ms each).

A program's request goes in on a pipe of its own; what it prints is read as it comes, up to
`OUTPUT_BYTES` (the rest is dropped, never held), and its runner reports its verdict on another.
A program that leaves no report is judged by how its process ended (the server says: its wait
status and CPU time): by CPU time or the wall-clock backstop (`timeout`), else `runtime_error`
naming the signal or exit. A server is ended, and a new one started for the next program, after
a program that reached the backstop, one that may start processes, or one that left the server
other than it was; a server that ended or stopped answering is replaced the same way. A sandbox
that cannot start or run a program raises `SandboxFailure`: no verdict is ever made up.
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import termios
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ckpt_watcher.sandbox import bwrap, judge, seccomp
from ckpt_watcher.sandbox.program import (
    Limits,
    Program,
    SandboxFailure,
    SandboxUnavailable,
    Verdict,
)
from ckpt_watcher.sandbox.runner import INLINE_JSON

RUNNER = (Path(__file__).parent / "runner.py").read_text(encoding="utf-8")
SERVER = (Path(__file__).parent / "forkserver.py").read_text(encoding="utf-8")
OUTPUT_BYTES = 4 << 20  # of a program's stdout kept (a stdin/stdout test's answer)
ERROR_BYTES = 64 << 10  # of its stderr kept
START_SECONDS = 60.0  # for a server to start (bwrap, then the interpreter) at most
REPORT_FD = 3  # where the runner reports, in the program's process
REPORT_BYTES = 1 << 20  # of a runner's report kept, and more for each test of a program


class Sandbox:
    """Runs programs (`run`, `run_many`) in bubblewrap, or, where `jail` is false (the explicit
    unsandboxed setting), with the same runner, servers and limits and no isolation. `close`
    ends its servers (also when it is collected, and at exit)."""

    def __init__(
        self,
        limits: Limits,
        jail: bool = True,
        bwrap_setting: str = "auto",
        parallel: int | None = None,
        python: str = sys.executable,
    ) -> None:
        self.limits = limits
        self.jail = jail
        self.python = python
        self.parallel = max(1, parallel or len(os.sched_getaffinity(0)))
        self.bwrap: Path | None = None
        self._version: tuple[int, ...] = ()
        if limits.processes > 1 and not jail:
            raise SandboxUnavailable(
                "eval.sandbox.processes above 1 needs the sandbox: unsandboxed, a process a "
                "program starts could outlive it. Set processes: 1"
            )
        if limits.processes > 1 and os.geteuid() == 0:
            raise SandboxUnavailable(
                f"eval.sandbox.processes is {limits.processes}: a program may start processes "
                "only where the watcher runs as an unprivileged user (systemd's User=); as root "
                "the kernel's process limit (RLIMIT_NPROC) does not bind, and one fork bomb "
                "would take the host. Set processes: 1, or run the watcher as another user"
            )
        try:
            self._filter = seccomp.program_filter(processes=limits.processes > 1)
        except seccomp.Unsupported as e:
            if jail:
                raise SandboxUnavailable(str(e)) from None
            self._filter = b""  # unsandboxed: its limits, without the filter
        if jail:
            self.bwrap = bwrap.find(bwrap_setting)
            self._version = bwrap.version(self.bwrap)
        self._idle: list[_Server] = []
        self._lock = threading.Lock()
        self._closed = 0  # times closed: a server taken before the last close is not kept
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _end_all, self._idle)

    @property
    def name(self) -> str:
        if not self.jail:
            return "unsandboxed"
        return f"bwrap {'.'.join(map(str, self._version))} ({self.bwrap})"

    def check(self) -> None:
        """SandboxUnavailable unless a program runs and passes here (at the worker's start and
        in `watcher doctor`)."""
        try:
            said = self.run(Program("import sys\nassert sys.version_info >= (3,)\n"))
        except SandboxFailure as e:
            raise SandboxUnavailable(str(e)) from None
        if not said.passed:
            raise SandboxUnavailable(
                f"a trivial program did not pass in the sandbox ({said.status}: {said.error})"
            )

    def close(self) -> None:
        """End the servers (a program being judged ends its own when it is done)."""
        with self._lock:
            servers, self._idle[:] = list(self._idle), []
            self._closed += 1
        _end_all(servers)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_many(self, programs: Sequence[Program]) -> list[Verdict]:
        """Each program's verdict, in order, up to `parallel` at once."""
        if len(programs) <= 1 or self.parallel == 1:
            return [self.run(p) for p in programs]
        with ThreadPoolExecutor(self.parallel, thread_name_prefix="sandbox") as pool:
            return list(pool.map(self.run, programs))

    def run(self, program: Program) -> Verdict:
        limits = self.limits
        if program.tests:  # each test has the CPU limit: the process, all of them
            n = len(program.tests)
            limits = replace(
                limits,
                cpu_seconds=limits.cpu_seconds * n,
                wall_seconds=limits.wall_seconds + limits.cpu_seconds * n,
            )
        request = {"source": program.source, "stdin": program.stdin, "as_main": program.as_main,
                   "limits": asdict(self.limits), "report_fd": REPORT_FD,
                   "tests": judge.inputs_only(program.tests) if program.tests else None,
                   "call": program.call}  # fmt: skip
        data = json.dumps(request).encode()
        # a report holds each test's result: up to INLINE_JSON characters, escaped once more
        report_cap = REPORT_BYTES + len(program.tests or ()) * (2 * INLINE_JSON + 1024)
        server, closed = self._take()
        try:
            try:
                ran = server.judge(data, limits.wall_seconds, report_cap)
            except _Gone:  # it ended between two programs (one before stopped or killed it)
                server.end()
                server = _Server(self)
                ran = server.judge(data, limits.wall_seconds, report_cap)
        except _Gone:
            server.end()
            raise SandboxFailure(
                "the sandbox's server ended twice before a program could run: see its host's "
                "memory (the kernel's OOM killer) and what else ends processes there"
            ) from None
        except BaseException:
            server.end()
            raise
        if ran.answer is not None and not ran.answer.get("setup"):
            server.end()
            raise SandboxFailure(
                f"the sandbox's server could not start a program: {ran.answer.get('error')}"
            )
        # a server goes on only as it was: not past the backstop, nothing of a program left
        # (one whose programs may start processes was ended once its program was: `_collect`)
        if ran.timed_out or ran.answer is None or not ran.answer.get("clean"):
            server.end()
        else:
            self._keep(server, closed)
        return _verdict(program, limits, ran)

    def _take(self) -> tuple[_Server, int]:
        """An idle server, else a new one; and how many times this sandbox was closed then."""
        with self._lock:
            if self._pid != os.getpid():  # a fork of the process that started them
                self._idle.clear()
                self._pid = os.getpid()
            closed = self._closed
            if self._idle:
                return self._idle.pop(), closed
        return _Server(self), closed

    def _keep(self, server: _Server, closed: int) -> None:
        """Keep a server for the next program: not past `parallel` idle ones, not one taken
        before this sandbox was closed."""
        with self._lock:
            if not server.ended and self._closed == closed and len(self._idle) < self.parallel:
                self._idle.append(server)
                return
        server.end()


def open_sandbox(settings: Any) -> Sandbox:
    """The sandbox `eval.sandbox` describes (SandboxConfig), proven to run a program here."""
    limits = Limits(
        cpu_seconds=settings.cpu_seconds,
        wall_seconds=settings.wall_seconds,
        memory_mb=settings.memory_mb,
        processes=settings.processes,
        file_size_mb=settings.file_size_mb,
        open_files=settings.open_files,
        tmp_mb=settings.tmp_mb,
    )
    box = Sandbox(
        limits,
        jail=not settings.run_model_code_unsandboxed,
        bwrap_setting=settings.bwrap,
        parallel=settings.parallel,
    )
    try:
        box.check()  # its first server, kept for the programs to come
    except BaseException:
        box.close()
        raise
    return box


@dataclass
class _Ran:
    """What one program's run gave: its streams, its runner's report, the server's answer
    (None where the server ended first or was ended), whether the backstop ended it."""

    stdout: bytes
    stderr: bytes
    report: bytes
    answer: dict[str, Any] | None
    timed_out: bool
    wall: float


class _Gone(Exception):
    """The server had ended before it took the program."""


class _Server:
    """One forking server in a sandbox of its own, and the socket the host talks to it on."""

    def __init__(self, box: Sandbox) -> None:
        self.jail = box.jail
        self.processes = box.limits.processes
        self.ended = False
        self.owner = os.getpid()  # a fork of this process must not end it
        host_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = host_end
        # the programs' folder: the sandbox's private /tmp, or a folder of its own unsandboxed
        self.folder = "/tmp" if box.jail else tempfile.mkdtemp(prefix="ckpt-watcher-unsandboxed-")
        self.errors = tempfile.TemporaryFile()
        command = [box.python, "-s", "-P", "-c", SERVER, str(server_end.fileno()), self.folder,
                   box._filter.hex(), "jail" if box.jail else "host"]  # fmt: skip
        if box.jail:
            assert box.bwrap is not None
            argv = bwrap.argv(box.bwrap, box._version, box.limits, command)
            env: dict[str, str] = {}
            cwd = None
        else:
            argv, env, cwd = command, dict(bwrap.CLEAN_ENV) | {"HOME": self.folder}, self.folder
        try:
            self.proc = _spawn(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self.errors,
                pass_fds=[server_end.fileno()],
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        except BaseException:
            server_end.close()
            self._release()
            raise
        server_end.close()
        try:
            self._start(box)
        except BaseException:
            self.end()
            raise

    def _start(self, box: Sandbox) -> None:
        """Give it the runner, and wait for it to say it is ready."""
        runner = RUNNER.encode()
        self.sock.settimeout(START_SECONDS)
        try:
            self.sock.send(str(len(runner)).encode())
            for at in range(0, len(runner), 1 << 16):
                self.sock.send(runner[at : at + (1 << 16)])
            ready = self.sock.recv(64)
        except OSError:
            ready = b""
        self.sock.settimeout(None)
        if not ready:
            try:
                self.proc.wait(timeout=5)  # what it said, whole
            except subprocess.TimeoutExpired:
                pass
            self.errors.seek(0)
            said = self.errors.read(ERROR_BYTES).decode("utf-8", errors="replace")
            if box.jail:
                raise SandboxFailure(bwrap.unavailable(said))
            raise SandboxFailure(f"the sandbox's server could not start: {said.strip()[-500:]}")

    def judge(self, request: bytes, wall_seconds: float, report_cap: int) -> _Ran:
        """Run one program (its runner's request) in a child of this server."""
        pipes = [os.pipe() for _ in range(4)]  # request, stdout, stderr, report
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
        feed, out, err, report = pipes[0][1], pipes[1][0], pipes[2][0], pipes[3][0]
        began = time.monotonic()
        try:
            socket.send_fds(self.sock, [b"{}"], theirs)
        except OSError:
            for fd in (*theirs, feed, out, err, report):
                os.close(fd)
            raise _Gone from None
        for fd in theirs[1:]:
            os.close(fd)
        # the request's read end stays open here (its reader still meets the end of it): what
        # is left unread in it says whether a child ever took the request
        unread = theirs[0]
        try:
            fed = _Feed(feed, request)
            ran = self._collect(out, err, report, began + wall_seconds, report_cap)
            untouched = _unread(unread) == fed.sent  # (written PIPE_BUF at a time: exact)
        finally:
            for fd in (out, err, report, unread):
                os.close(fd)  # a feeder still writing meets a closed pipe and ends
        if ran.answer is None and not ran.timed_out and untouched:
            raise _Gone  # it ended after taking the message, before a child read the request
        ran.wall = round(time.monotonic() - began, 3)
        return ran

    def _collect(self, out: int, err: int, report: int, deadline: float, report_cap: int) -> _Ran:
        """Read the streams as they come (capped) and the server's answer, until the streams
        close and the answer is in (or the server is gone), or the backstop passes (this
        server is then ended, and the program with it)."""
        names = {out: "stdout", err: "stderr", report: "report", self.sock.fileno(): "answer"}
        caps = {"stdout": OUTPUT_BYTES, "stderr": ERROR_BYTES, "report": report_cap}
        got = {name: bytearray() for name in caps}
        answer: dict[str, Any] | None = None
        timed_out = False
        with selectors.DefaultSelector() as sel:
            for fd in names:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    self.end()
                    break
                for key, _ in sel.select(min(left, 1.0)):
                    name = names[key.fd]
                    if name == "answer":
                        sel.unregister(key.fd)
                        try:
                            message = self.sock.recv(1 << 16)
                            answer = json.loads(message) if message else None
                        except (OSError, ValueError):
                            answer = None
                        if answer is not None and self.processes > 1:
                            # the program ended: what still holds its streams is a process
                            # it left, which ends with this server
                            self.end()
                        continue
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fd)
                    elif len(got[name]) < caps[name]:
                        got[name] += chunk[: caps[name] - len(got[name])]
        return _Ran(bytes(got["stdout"]), bytes(got["stderr"]), bytes(got["report"]), answer,
                    timed_out, 0.0)  # fmt: skip

    def end(self) -> None:
        """This server and whatever runs in its sandbox, ended; its folder removed."""
        if self.ended:
            return
        self.ended = True
        ours = os.getpid() == self.owner  # in a fork of its host: the host's to end
        if ours and getattr(self, "proc", None) is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # bwrap, and so its pid namespace
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._release(ours)

    def _release(self, ours: bool = True) -> None:
        self.sock.close()
        self.errors.close()
        if ours and not self.jail:
            shutil.rmtree(self.folder, ignore_errors=True)


def _unread(fd: int) -> int:
    """Bytes waiting in a pipe."""
    got = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, got)
    return got[0]


def _end_all(servers: list[_Server]) -> None:
    for server in servers:
        server.end()


def _verdict(program: Program, limits: Limits, ran: _Ran) -> Verdict:
    """The verdict from what a program's run gave."""
    stdout = ran.stdout.decode("utf-8", errors="replace")
    err = ran.stderr.decode("utf-8", errors="replace")
    wall = ran.wall
    try:
        report = json.loads(ran.report) if ran.report else None
    except (ValueError, RecursionError):  # what a program wrote there: no report
        report = None
    if isinstance(report, dict) and program.tests:
        cpu_used = _seconds(report.get("cpu_seconds"))
        return judge.verdict(program.tests, program.call, report, stdout, cpu_used, wall)
    if isinstance(report, dict):
        return Verdict(
            str(report.get("status")),
            str(report.get("error") or ""),
            stdout,
            _seconds(report.get("cpu_seconds")),
            wall,
        )
    answer = ran.answer or {}
    cpu = float(answer.get("cpu") or 0.0)
    if ran.timed_out:
        why = f"no end after {limits.wall_seconds:g} s of wall-clock time"
        return Verdict("timeout", why, stdout, cpu, wall)
    if ran.answer is None:
        why = "it ended the sandbox's server it was run from"
        return Verdict("runtime_error", why, stdout, cpu, wall)
    rc = os.waitstatus_to_exitcode(int(answer["status"]))
    signum = -rc if rc < 0 else 0
    if signum in (signal.SIGXCPU, signal.SIGKILL) and cpu >= limits.cpu_seconds:
        return Verdict("timeout", "CPU time limit reached", stdout, cpu, wall)
    why = (
        f"its process ended by signal {signal.Signals(signum).name}"
        if signum in signal.Signals._value2member_map_
        else f"it ended its process itself (exit code {rc})"
    )
    tail = "\n".join(err.strip().splitlines()[-4:])
    return Verdict("runtime_error", f"{why}\n{tail}".strip(), stdout, cpu, wall)


class _Feed:
    """The request into its pipe, PIPE_BUF bytes at a time (each write whole or not at all, so
    `sent` less what the pipe holds is exactly what a reader took): at once where the pipe
    holds it all, else from a thread (the runner reads it whole before anything else)."""

    def __init__(self, fd: int, data: bytes) -> None:
        self.sent = 0
        if len(data) <= 65536:
            self._write(fd, data)
            return
        threading.Thread(target=self._write, args=(fd, data), daemon=True,
                         name="sandbox-feed").start()  # fmt: skip

    def _write(self, fd: int, data: bytes) -> None:
        try:
            view = memoryview(data)
            while self.sent < len(data):
                self.sent += os.write(fd, view[self.sent : self.sent + select.PIPE_BUF])
        except OSError:  # the child ended, or the host closed the pipe, before it read it all
            pass
        finally:
            os.close(fd)


def _seconds(value: object) -> float:
    """A report's CPU seconds (what a program wrote in place of a report: 0)."""
    try:
        return float(value or 0.0)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return 0.0


_LAUNCHER: tuple[int, ThreadPoolExecutor] | None = None
_LAUNCHER_LOCK = threading.Lock()


def _spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Popen from a thread that lives as long as this process: bwrap's `--die-with-parent`
    ends the sandbox when the *thread* that started it ends (the kernel's parent-death signal
    follows the thread), and servers outlive the threads that judge programs."""
    global _LAUNCHER
    with _LAUNCHER_LOCK:
        if _LAUNCHER is None or _LAUNCHER[0] != os.getpid():
            _LAUNCHER = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="sandbox-launch"))
        launcher = _LAUNCHER[1]
    return launcher.submit(_popen, argv, kwargs).result()


def _popen(argv: list[str], kwargs: dict[str, Any]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, **kwargs)
