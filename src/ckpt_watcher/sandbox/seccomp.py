"""The seccomp filter a sandboxed program runs under: it cannot start another process (where
its limits allow only itself), act on any process but itself, nor make what would outlive it.

Process creation is the one thing the kernel's limits cannot bound everywhere: RLIMIT_NPROC
counts a user's processes, and a watcher that runs as root maps the sandbox's user to root,
whom the kernel exempts. So the program may make threads (`clone` with CLONE_THREAD, which its
memory limit bounds) but not processes: `fork`, `vfork` and `clone` without CLONE_THREAD fail
with EPERM, `clone3` (whose flags a filter cannot read) with ENOSYS, so that glibc starts its
threads with `clone`. lm-eval's `code_eval` takes `os.fork` and `subprocess.Popen` away from the
programs it runs too (its `reliability_guard`), so no verdict changes for it.

A program runs in a child of the sandbox's server (forkserver.py), the same user as the server
and the programs after it, so the filter keeps it to itself: `ptrace` fails; the calls that set
a process's scheduling, priority, I/O priority or limits (`sched_set*`, `setpriority`,
`ioprio_set`, `prlimit64`) work on its own process only (pid 0, as Python's `os` and `resource`
call them for oneself). What outlives a process fails with EPERM: System V shared memory,
semaphores and message queues and POSIX message queues (they belong to the IPC namespace, which
the server keeps from one program to the next, and their memory is counted in no limit of the
program's), and keys in the kernel's keyrings. Python's standard library uses none of them
(multiprocessing's shared memory is POSIX, files under /dev/shm, which the sandbox mounts
read-only).

The filter is a classic BPF program (the bytes bubblewrap's `--seccomp FD` loads), for x86-64
and aarch64; a system call of any other architecture (x32's, i386's) kills the process.
"""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: nr at 0, arch at 4, args[] from 16 (each 64 bits; the low word first)
_NR, _ARCH, _ARG0 = 0, 4, 16
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL_PROCESS = 0x7FFF0000, 0x80000000
_ERRNO = 0x00050000
CLONE_THREAD = 0x00010000
X32_BIT = 0x40000000

# (audit arch, fork, vfork, clone, clone3): None where the architecture has no such call
_ARCHES = {
    "x86_64": (0xC000003E, 57, 58, 56, 435),
    "aarch64": (0xC00000B7, None, None, 220, 435),
}
# refused outright: System V IPC (shmget, semget, msgget), POSIX message queues (mq_open),
# keyrings (add_key, request_key, keyctl), ptrace
_REFUSED = {
    "x86_64": (29, 64, 68, 240, 248, 249, 250, 101),
    "aarch64": (194, 190, 186, 180, 217, 218, 219, 117),
}
# allowed on the program itself only, its pid (first argument) 0: sched_setparam,
# sched_setscheduler, sched_setaffinity, sched_setattr, prlimit64
_SELF_ONLY = {"x86_64": (142, 144, 203, 314, 302), "aarch64": (118, 119, 122, 274, 261)}
# allowed as (PRIO_PROCESS, 0) only: setpriority; as (IOPRIO_WHO_PROCESS, 0) only: ioprio_set
_PRIORITY = {"x86_64": (141, 251), "aarch64": (140, 30)}
_ARG1 = _ARG0 + 8


class Unsupported(Exception):
    """No filter for this machine's architecture."""


def program_filter(processes: bool = False, machine: str | None = None) -> bytes:
    """The filter, as a `struct sock_filter` array (what `PR_SET_SECCOMP` and bubblewrap's
    `--seccomp` read); `processes`: the program may start processes (its limits allow more than
    one), which then only its process limit bounds."""
    arch = machine or platform.machine()
    if arch not in _ARCHES:
        raise Unsupported(f"no seccomp filter for {arch} (x86_64 and aarch64 have one)")
    audit, fork, vfork, clone, clone3 = _ARCHES[arch]
    eperm, enosys = _ERRNO | errno.EPERM, _ERRNO | errno.ENOSYS
    # (opcode, k, true-target label, false-target label) or (label,): a tiny assembler
    prog: list[tuple] = [
        ("ld", _ARCH),
        ("jeq", audit, None, "kill"),
        ("ld", _NR),
    ]
    if arch == "x86_64":
        prog.append(("jge", X32_BIT, "eperm", None))
    prog += [("jeq", nr, "eperm", None) for nr in _REFUSED[arch]]
    prog += [("jeq", nr, "self", None) for nr in _SELF_ONLY[arch]]
    setpriority, ioprio_set = _PRIORITY[arch]
    prog += [("jeq", setpriority, "priority", None), ("jeq", ioprio_set, "ioprio", None)]
    if processes:
        prog.append(("ret", _ALLOW))
    for nr in (fork, vfork):
        if nr is not None:
            prog.append(("jeq", nr, "eperm", None))
    prog += [
        ("jeq", clone3, "enosys", None),
        ("jeq", clone, None, "allow"),
        ("ld", _ARG0),
        ("jset", CLONE_THREAD, "allow", "eperm"),
        ("label", "self"),
        ("ld", _ARG0),
        ("jeq", 0, "allow", "eperm"),
        ("label", "priority"),
        ("ld", _ARG0),
        ("jeq", 0, None, "eperm"),  # PRIO_PROCESS
        ("ld", _ARG1),
        ("jeq", 0, "allow", "eperm"),
        ("label", "ioprio"),
        ("ld", _ARG0),
        ("jeq", 1, None, "eperm"),  # IOPRIO_WHO_PROCESS
        ("ld", _ARG1),
        ("jeq", 0, "allow", "eperm"),
        ("label", "allow"),
        ("ret", _ALLOW),
        ("label", "eperm"),
        ("ret", eperm),
        ("label", "enosys"),
        ("ret", enosys),
        ("label", "kill"),
        ("ret", _KILL_PROCESS),
    ]
    return _assemble(prog)


def _assemble(prog: list[tuple]) -> bytes:
    at: dict[str, int] = {}
    n = 0
    for op in prog:
        if op[0] == "label":
            at[op[1]] = n
        else:
            n += 1
    out = b""
    i = 0
    for op in prog:
        if op[0] == "label":
            continue
        if op[0] == "ld":
            out += struct.pack("<HBBI", _LD_W_ABS, 0, 0, op[1])
        elif op[0] == "ret":
            out += struct.pack("<HBBI", _RET, 0, 0, op[1])
        else:
            code = {"jeq": _JEQ, "jge": _JGE, "jset": _JSET}[op[0]]
            jt = 0 if op[2] is None else at[op[2]] - i - 1
            jf = 0 if op[3] is None else at[op[3]] - i - 1
            out += struct.pack("<HBBI", code, jt, jf, op[1])
        i += 1
    return out
