"""What runs inside the sandbox and stays: a server that forks a child for each program, so
that a program costs a fork of a warm interpreter, not the start of one (the standard library
only; run as `python -s -P -c` with this file's text, one server per parallel slot).

The host (launch.py) talks to it over a socket (file descriptor `argv[1]`): first the runner's
source (runner.py, kept as a module here), then for each program one message with four file
descriptors: the request to read, and where the program's stdout, stderr and verdict go. The
child takes them as 0, 1, 2 and 3, closes everything else of the server's, installs the seccomp
filter (`argv[3]`, hex: seccomp.py's; none unsandboxed on an architecture it has none for)
and runs the runner's `main`. The server answers with how the child ended (its wait
status and CPU time), whether it got as far as the program (`setup`: else what failed), and
whether this server is still as it was (`clean`).

Nothing one program does may reach the next one's verdict. Between programs the server empties
its folder (`argv[2]`: the sandbox's /tmp); the server is not dumpable, so a program can neither
trace it nor read its memory; where a program may start processes the host ends this server
after it (the sandbox's pid namespace ends them all). What the server cannot put back (its
folder, its own limits changed by `prlimit`) it reports as not `clean`, and the host ends it; a
program that stops or kills the server only costs the host a new one.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import resource
import socket
import stat
import sys
import types

PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 4, 38, 22, 2
FDS = 4  # request, stdout, stderr, verdict
LIMITS = tuple(getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_"))


class _Filter(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def serve(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    folder, code = argv[1], bytes.fromhex(argv[2])
    libc = ctypes.CDLL(None, use_errno=True)
    program = ctypes.create_string_buffer(code, len(code))
    fprog = _Filter(len(code) // 8, ctypes.cast(program, ctypes.c_void_p))
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no program may trace it or read its memory
    runner = types.ModuleType("runner")
    exec(compile(_receive(sock), "<runner>", "exec"), runner.__dict__)  # noqa: S102
    runner.warm()
    limits = _limits()
    os.chdir(folder)
    sock.send(b'{"ready": true}')
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 16, FDS)
        except OSError:
            return
        if not message:  # the host closed: it is gone or done with us
            return
        said_r, said_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _child(sock, fds, said_w, bool(code), libc, fprog)
            runner.main()
            os._exit(0)
        for fd in (*fds, said_w):
            os.close(fd)
        _, status, usage = os.wait4(pid, 0)
        said = _read_all(said_r)
        clean = _empty(folder) and _limits() == limits
        answer = {
            "status": status,
            "cpu": round(usage.ru_utime + usage.ru_stime, 3),
            "setup": said == b"ok",
            "error": "" if said == b"ok" else said.decode(errors="replace"),
            "clean": clean,
        }
        sock.send(json.dumps(answer).encode())


def _child(
    sock: socket.socket,
    fds: list[int],
    said_w: int,
    seccomp: bool,
    libc: ctypes.CDLL,
    fprog: _Filter,
) -> None:
    """The program's process, up to its runner: its four descriptors as 0-3, nothing else of
    the server's, dumpable again (its own /proc), the filter; "ok" on `said_w` once done, else
    what failed (and it ends: nothing of the program ran)."""
    said = said_w
    try:
        # above every one of them first, so that no dup2 below closes one still to be moved
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 256) for fd in (*fds, said_w)]
        for i, fd in enumerate(high):
            os.dup2(fd, i)  # inheritable
        said = FDS
        sock.detach()
        os.closerange(FDS + 1, max(os.sysconf("SC_OPEN_MAX"), 1 << 16))  # the server's, all
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        if seccomp:
            if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
            if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
        os.write(said, b"ok")
        os.close(said)
    except BaseException as e:
        os.write(said, repr(e).encode()[:2000])
        os._exit(70)


def _receive(sock: socket.socket) -> str:
    """The runner's source: its length, then its text."""
    size = int(sock.recv(64))
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 16))
        if not chunk:
            raise SystemExit("the host closed before sending the runner")
        data += chunk
    return data.decode()


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    os.close(fd)
    return data


def _limits() -> list[tuple[int, int]]:
    return [resource.getrlimit(r) for r in LIMITS]


def _empty(folder: str) -> bool:
    """Everything a program left in `folder` removed (a folder it made unreadable too)."""
    try:
        for name in os.listdir(folder):
            _remove(os.path.join(folder, name))
        return not os.listdir(folder)
    except (OSError, RecursionError):
        return False


def _remove(path: str) -> None:
    if stat.S_ISDIR(os.lstat(path).st_mode):
        os.chmod(path, 0o700)
        for name in os.listdir(path):
            _remove(os.path.join(path, name))
        os.rmdir(path)
    else:
        os.unlink(path)


if __name__ == "__main__":  # `python -c` with this text: the host's launch
    serve(sys.argv[1:])
