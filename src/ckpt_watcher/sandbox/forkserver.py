"""What runs inside the sandbox and stays: a server that forks a child for each program, so
that a program costs a fork of a warm interpreter, not the start of one (the standard library
only; run as `python -s -P -c` with this file's text, one server per parallel slot).

Its arguments: the socket the host talks to it on, the programs' folder (the sandbox's /tmp;
unsandboxed, a folder of the host's, removed when the host is done), the seccomp filter (hex:
seccomp.py's; empty unsandboxed on an architecture it has none for) and `jail` or `host`. The
host sends the runner's source first (runner.py, kept as a module here), then for each program
one message with four file descriptors: the request to read, and where the program's stdout,
stderr and verdict go. The child takes them as 0, 1, 2 and 3, closes everything else of the
server's, starts a session of its own, dies with the server, installs the filter and runs the
runner's `main`. The server answers with how the child ended (its wait status and CPU time),
whether it got as far as the program (`setup`: else what failed), and whether this server is
still as it was (`clean`).

Nothing one program does may reach the next one's verdict. The filter keeps a program off the
server (no ptrace; scheduling, priorities and limits set on itself only) and from making what
outlives it (IPC objects, keys); the server is not dumpable (its memory and /proc files are
not the program's to read). After each program the server empties its folder and checks what
its children would inherit (`_state`: limits, priority, scheduling, its folder's mode and
attributes) and, in the sandbox, that no process is left. What it cannot put back it reports as
not `clean`, and the host ends it; where a program may start processes, the host ends the
server after it (the sandbox's pid namespace ends them all); a program that stops or kills the
server only costs the host a new one.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import resource
import signal
import socket
import stat
import sys
import types

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
FDS = 4  # request, stdout, stderr, verdict
LIMITS = tuple(getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_"))


class _Filter(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def serve(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    folder, code, jail = argv[1], bytes.fromhex(argv[2]), argv[3] == "jail"
    libc = ctypes.CDLL(None, use_errno=True)
    program = ctypes.create_string_buffer(code, len(code))
    fprog = _Filter(len(code) // 8, ctypes.cast(program, ctypes.c_void_p))
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no program may trace it or read its memory
    # the sandbox's pid 1 (bwrap --as-pid-1): a signal from inside reaches it only where it
    # has a handler, and it has none (SIGINT's is Python's: ignored here, its child's again)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runner = types.ModuleType("runner")
    exec(compile(_receive(sock), "<runner>", "exec"), runner.__dict__)  # noqa: S102
    runner.warm()
    os.chdir(folder)
    skeleton = _skeleton(folder)
    state = _state(folder, jail)
    sock.send(b'{"ready": true}')
    try:
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
                signal.signal(signal.SIGINT, signal.default_int_handler)
                sys.argv[:] = ["-c"]  # as a program run by `python -c` sees it
                runner.main()
                os._exit(0)
            for fd in (*fds, said_w):
                os.close(fd)
            status, cpu, stopped = _wait(pid)
            said = _read_all(said_r)
            clean = not stopped and _empty(folder, skeleton) and _state(folder, jail) == state
            if jail:  # nothing but this server (the sandbox's pid 1) is left in it
                clean = clean and set(_pids()) <= {1, os.getpid()}
            answer = {
                "status": status,
                "cpu": cpu,
                "setup": said == b"ok",
                "error": "" if said == b"ok" else said.decode(errors="replace"),
                "clean": clean,
            }
            sock.send(json.dumps(answer).encode())
    finally:
        if not jail:  # a folder of the host's: the sandbox's /tmp goes with the sandbox
            _empty(folder, skeleton)
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def _wait(pid: int) -> tuple[int, float, bool]:
    """The child's end: its wait status and CPU time, and whether it stopped first. A child
    that stops (one that made this server its tracer) is not at its end: it, and every thread
    it left, is killed, and this server is then not reused."""
    stopped = False
    while True:
        _, status, usage = os.wait4(pid, 0)
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            return status, round(usage.ru_utime + usage.ru_stime, 3), stopped
        stopped = True
        os.kill(pid, signal.SIGKILL)


def _state(folder: str, jail: bool) -> tuple[object, ...]:
    """What of this server a program could change for the programs after it: the limits,
    priority, scheduling and core dump filter its children inherit, its folder's mode, owner
    and extended attributes (ACLs too); in the sandbox also the space its /tmp holds (a file
    deleted, still open) and the sockets of its network namespace (a listener, a connection
    in TIME_WAIT, descriptors kept in flight in a socket that holds itself). The seccomp
    filter keeps a program from changing the server's; this is the check that it did not."""
    st = os.stat(folder)
    try:
        attrs = sorted((n, os.getxattr(folder, n)) for n in os.listxattr(folder))
    except OSError:
        attrs = []
    return (
        [resource.getrlimit(r) for r in LIMITS],
        os.getpriority(os.PRIO_PROCESS, 0),
        os.sched_getscheduler(0),
        os.sched_getparam(0).sched_priority,
        sorted(os.sched_getaffinity(0)),
        _text("/proc/self/oom_score_adj"),
        _text("/proc/self/coredump_filter"),
        _text("/proc/self/autogroup").split(" ", 1)[-1],  # its nice (its name has a counter)
        (st.st_mode, st.st_uid, st.st_gid),
        attrs,
        _held(folder) if jail else None,
    )


# socket tables of the network namespace, each cheap to read (tcp's walks the host's table)
NET = ("unix", "udp", "udp6", "raw", "raw6", "packet", "netlink")
GLOBAL_COUNTS = {"orphan", "alloc", "mem", "memory"}  # sockstat's figures of the whole host


def _held(folder: str) -> tuple[object, ...]:
    """The sandbox's space in use and its sockets: each table's lines past its header, and
    sockstat's counts of this namespace (TCP's in use and in TIME_WAIT among them)."""
    fs = os.statvfs(folder)
    sockets = [_text(f"/proc/self/net/{name}").splitlines()[1:] for name in NET]
    counts = []
    for name in ("sockstat", "sockstat6"):
        for line in _text(f"/proc/self/net/{name}").splitlines():
            what, _, figures = line.partition(":")
            pairs = figures.split()
            counts += [
                (what, key, value)
                for key, value in zip(pairs[::2], pairs[1::2], strict=False)
                if key not in GLOBAL_COUNTS
            ]
    return (fs.f_bfree, fs.f_ffree, sockets, counts)


def _text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


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
        os.setsid()  # its own session: its autogroup's nice is not the server's
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # it ends with the server
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


def _skeleton(folder: str) -> dict[str, int]:
    """What the folder holds before any program, each path with its mode: the folders bwrap
    made there to mount the interpreter's on (a virtualenv under /tmp: the sandbox's /tmp then
    holds its path), and those mounts, whose insides are not the folder's."""
    device = os.lstat(folder).st_dev
    found = {}
    for root, dirs, files in os.walk(folder):
        found[root] = os.lstat(root).st_mode
        for name in [*dirs, *files]:
            st = os.lstat(os.path.join(root, name))
            found[os.path.join(root, name)] = st.st_mode
            if st.st_dev != device and name in dirs:
                dirs.remove(name)  # a mount: not entered
    return found


def _empty(folder: str, skeleton: dict[str, int]) -> bool:
    """Everything a program left in `folder` removed (a folder it made unreadable too), and the
    skeleton's folders as they were (their modes put back); False where that failed."""
    try:
        os.chmod(folder, stat.S_IMODE(skeleton[folder]))  # a program may have locked it
        _clear(folder, skeleton, os.lstat(folder).st_dev)
        return all(os.lstat(path).st_mode == mode for path, mode in skeleton.items())
    except (OSError, RecursionError):
        return False


def _clear(folder: str, skeleton: dict[str, int], device: int) -> None:
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if path not in skeleton:
            _remove(path)
            continue
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_dev == device:  # a folder of the skeleton's
            os.chmod(path, stat.S_IMODE(skeleton[path]))
            _clear(path, skeleton, device)


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
