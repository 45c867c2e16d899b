"""One program, one process of its own, one verdict; many at once up to the CPUs given.

The runner (runner.py, run as `python -s -P -c`) gets its request on stdin and reports on file
descriptor 3; what the program prints is read as it comes, up to `OUTPUT_BYTES` (the rest is
dropped, never held). A program that leaves no report is judged by how its process ended: by
CPU time or the wall-clock backstop (`timeout`), else `runtime_error` naming the signal or exit.
A sandbox that fails to start a program raises `SandboxFailure`: no verdict is ever made up.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
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

RUNNER = (Path(__file__).parent / "runner.py").read_text(encoding="utf-8")
OUTPUT_BYTES = 4 << 20  # of a program's stdout kept (a stdin/stdout test's answer)
ERROR_BYTES = 64 << 10  # of its stderr kept


class Sandbox:
    """Runs programs (`run`, `run_many`) in bubblewrap, or, where `jail` is false (the explicit
    unsandboxed setting), with the same runner and limits and no isolation."""

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
        self._filter = b""
        if jail:
            self.bwrap = bwrap.find(bwrap_setting)
            self._version = bwrap.version(self.bwrap)
            try:
                self._filter = seccomp.no_new_processes()
            except seccomp.Unsupported as e:
                raise SandboxUnavailable(str(e)) from None

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
        command = [self.python, "-s", "-P", "-c", RUNNER]
        report_r, report_w = os.pipe()
        info_r, info_w = os.pipe()
        keep = [report_w, info_w]
        cwd = None
        try:
            if self.jail:
                assert self.bwrap is not None
                filter_fd = os.memfd_create("ckpt-watcher-seccomp")
                os.write(filter_fd, self._filter)
                os.lseek(filter_fd, 0, os.SEEK_SET)
                keep.append(filter_fd)
                argv = bwrap.argv(self.bwrap, self._version, self.limits, filter_fd, command)
                argv[1:1] = ["--info-fd", str(info_w)]  # written once the sandbox is up
                env: dict[str, str] = {}
            else:
                cwd = tempfile.mkdtemp(prefix="ckpt-watcher-unsandboxed-")
                argv, env = command, dict(bwrap.CLEAN_ENV) | {"HOME": cwd}
                os.write(info_w, b"{}")  # nothing to set up
            began = time.monotonic()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=keep,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        except BaseException:
            for fd in (report_r, info_r):
                os.close(fd)
            raise
        finally:
            for fd in keep:
                os.close(fd)
        request = {"source": program.source, "stdin": program.stdin, "as_main": program.as_main,
                   "limits": asdict(self.limits), "report_fd": report_w,
                   "tests": judge.inputs_only(program.tests) if program.tests else None,
                   "call": program.call}  # fmt: skip
        try:
            read, timed_out = _collect(proc, [report_r, info_r], request, limits)
            rc, usage = _reap(proc)
        finally:
            os.close(report_r)
            os.close(info_r)
            if cwd is not None:
                shutil.rmtree(cwd, ignore_errors=True)
        wall = round(time.monotonic() - began, 3)
        stdout = read["stdout"].decode("utf-8", errors="replace")
        err = read["stderr"].decode("utf-8", errors="replace")
        if not read[info_r] and not timed_out:  # bwrap never started the sandbox
            raise SandboxFailure(bwrap.unavailable(err))
        try:
            report = json.loads(read[report_r]) if read[report_r] else None
        except ValueError:
            report = None
        if isinstance(report, dict) and program.tests:
            cpu_used = float(report.get("cpu_seconds") or 0.0)
            return judge.verdict(program.tests, program.call, report, stdout, cpu_used, wall)
        if isinstance(report, dict):
            return Verdict(
                str(report.get("status")),
                str(report.get("error") or ""),
                stdout,
                float(report.get("cpu_seconds") or 0.0),
                wall,
            )
        cpu = round(usage.ru_utime + usage.ru_stime, 3) if usage is not None else 0.0
        if timed_out:
            why = f"no end after {limits.wall_seconds:g} s of wall-clock time"
            return Verdict("timeout", why, stdout, cpu, wall)
        signum = -rc if rc < 0 else rc - 128 if rc > 128 else 0
        if signum in (signal.SIGXCPU, signal.SIGKILL) and cpu >= limits.cpu_seconds:
            return Verdict("timeout", "CPU time limit reached", stdout, cpu, wall)
        why = (
            f"its process ended by signal {signal.Signals(signum).name}"
            if signum in signal.Signals._value2member_map_
            else f"it ended its process itself (exit code {rc})"
        )
        tail = "\n".join(err.strip().splitlines()[-4:])
        return Verdict("runtime_error", f"{why}\n{tail}".strip(), stdout, cpu, wall)


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
    box.check()
    return box


def _collect(
    proc: subprocess.Popen[bytes], pipes: list[int], request: dict[str, Any], limits: Limits
) -> tuple[dict[Any, bytes], bool]:
    """Feed the request; read stdout, stderr and `pipes` as they come (capped) until all close
    or the wall-clock backstop passes (the process group is then killed). What each said
    (`stdout`, `stderr`, and by each pipe's fd), and whether the backstop ended it."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    feeder = threading.Thread(target=_feed, args=(proc.stdin, request), daemon=True)
    feeder.start()
    names: dict[int, Any] = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
    names |= {fd: fd for fd in pipes}
    caps = {"stdout": OUTPUT_BYTES, "stderr": ERROR_BYTES} | {fd: 1 << 20 for fd in pipes}
    got: dict[Any, bytearray] = {name: bytearray() for name in names.values()}
    deadline = time.monotonic() + limits.wall_seconds
    timed_out = False
    with selectors.DefaultSelector() as sel:
        for fd in names:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                _kill(proc)
                break
            for key, _ in sel.select(min(left, 1.0)):
                chunk = os.read(key.fd, 65536)
                name = names[key.fd]
                if not chunk:
                    sel.unregister(key.fd)
                elif len(got[name]) < caps[name]:
                    got[name] += chunk[: caps[name] - len(got[name])]
    feeder.join(timeout=5)  # it ended or met a closed pipe: never two threads on one stream
    return {name: bytes(data) for name, data in got.items()}, timed_out


def _feed(stdin: Any, request: dict[str, Any]) -> None:
    try:
        stdin.write(json.dumps(request).encode())
        stdin.close()
    except OSError:  # it ended before reading it all
        pass


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap and whatever is in its session
    except ProcessLookupError:
        pass


def _reap(proc: subprocess.Popen[bytes]) -> tuple[int, Any]:
    """Its exit status, and the CPU it and what it waited for used."""
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except ChildProcessError:
        return proc.wait(), None
    proc.returncode = os.waitstatus_to_exitcode(status)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            # stdin may hold a request it never read: closing flushes it into a closed pipe
            with contextlib.suppress(OSError):
                stream.close()
    return proc.returncode, usage
