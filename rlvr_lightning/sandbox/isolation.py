"""How a sandbox worker is started: inside bubblewrap (`bwrap`) namespaces, or, only when the user asks for it
by name, as a plain child process.

Bubblewrap gives the worker its own mount, PID, network, IPC and UTS namespaces: the file system it sees is
the system's libraries and the Python that runs it, read-only, and nothing else (no home, no repository, no
checkpoints); no network interface but loopback; only its own processes in /proc; an environment of a few
fixed variables. Each call then gets a world of its own inside it (`world.py`). Run as root, the worker keeps
only the capabilities that make a call's namespaces and mounts, drop the call to an unprivileged user id of
its own (`code_uid`), kill it and empty its bounding set (`ROOT_WORKER_CAPABILITIES`); run as a user,
bubblewrap maps it into a user namespace where it keeps those it still needs there (`WORKER_CAPABILITIES`).
The kernel's no-new-privileges flag is set, so no setuid program regains anything.

Containers would give the same and more, but need a daemon and privileges that a training machine or CI
runner often does not grant; bubblewrap is one small package and needs neither.
"""

from __future__ import annotations

import base64
import importlib.util
import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from rlvr_lightning.errors import ConfigError

WORKER = Path(__file__).with_name("worker.py")
WORKER_INSIDE = "/sandbox/worker.py"
# Bound beside the worker, which imports it: the per-call world (namespaces, mounts, privileges, seccomp).
WORLD = Path(__file__).with_name("world.py")
WORLD_INSIDE = "/sandbox/world.py"
CGROUP_INSIDE = "/sandbox/cgroup"  # the call cgroup's directories, one per controller, under this
# What the worker keeps (bubblewrap as root keeps every capability unless told to drop them): a call's
# namespaces and mounts (SYS_ADMIN) and emptying its bounding set (SETPCAP); as root also the call's user
# (SETUID, SETGID) and killing it at the time limit (KILL: it runs as that other user).
WORKER_CAPABILITIES = ("CAP_SYS_ADMIN", "CAP_SETPCAP")
ROOT_WORKER_CAPABILITIES = (*WORKER_CAPABILITIES, "CAP_SETUID", "CAP_SETGID", "CAP_KILL")
# Run as root, each worker's calls run as a user of their own: the process limit (RLIMIT_NPROC) counts a user's
# processes machine-wide, so calls sharing one user (`nobody`) would share one limit, and a call holding all of
# it would make its neighbours' threads and forks fail. The ids lie above the ranges that systems give accounts
# and containers (systemd's end at 1878982656) and below 2**31: no file outside the sandbox is theirs.
CODE_UID_BASE = 1_900_000_000
CODE_UIDS_PER_PROCESS = 4096
_next_code_uid = itertools.count()


def code_uid() -> int | None:
    """A user id no other worker of this machine's sandboxes runs calls as (None: not root, no user to drop to;
    an unprivileged sandbox's user namespace counts its processes on its own)."""
    if os.getuid() != 0:
        return None
    slot = (os.getpid() % 50_000) * CODE_UIDS_PER_PROCESS  # the largest id stays below 2**31
    return CODE_UID_BASE + slot + next(_next_code_uid) % CODE_UIDS_PER_PROCESS
# What a call's interpreter may read besides its own files: the system's libraries.
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin")
# The variables a call sees (the trainer's own environment, tokens included, never reaches it).
ENVIRONMENT = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
    "OPENBLAS_NUM_THREADS": "1",  # one core per call: calls run side by side
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # glibc gives each new thread an arena of 64 MiB of address space, which the call's memory limit (RLIMIT_AS)
    # counts: with 8 arenas a call under a 256 MiB limit could not start 8 threads. Two arenas serve any call.
    "MALLOC_ARENA_MAX": "2",
}
UNISOLATED_HINT = (
    "install bubblewrap (`apt-get install bubblewrap`; `make setup` does where it can), or set the sandbox's "
    "isolation to `none` to run model-written code as a plain process of this user (unsafe for untrusted code)"
)


class SandboxUnavailable(ConfigError):
    """Model-written code would run without isolation: refused unless the user asked for that."""


def python_dirs(preload: tuple[str, ...]) -> dict[str, str]:
    """The directories a worker's interpreter reads, as {path in the sandbox: path on the machine}: its
    installation, the environment's prefix (at the path Python knows it by, which may run through symbolic
    links: a virtual environment is recognised from where its interpreter is started), and where each
    preloaded module was installed."""
    dirs = {os.path.realpath(sys.base_prefix): os.path.realpath(sys.base_prefix), sys.prefix: os.path.realpath(sys.prefix)}
    for name in preload:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            raise ConfigError(f"sandbox preload: no module named {name!r} in this environment")
        origin = Path(spec.origin).resolve()
        package = str(origin.parent.parent if origin.name == "__init__.py" else origin.parent)
        dirs.setdefault(package, package)
    # A directory inside another (by either path) is there with it.
    inside = lambda d, o: d != o and d.startswith(o.rstrip("/") + "/")  # noqa: E731
    return {t: s for t, s in dirs.items() if not any(inside(t, o) or inside(s, dirs[o]) for o in dirs)}


def bwrap_command(
    preload: tuple[str, ...], tmp_mb: int, uid: int | None, seccomp: bytes = b"", cgroups: dict[str, str] | None = None
) -> list[str]:
    """The command that starts one worker inside bubblewrap, its calls run as `uid` (`code_uid()`), under the
    compiled `seccomp` filter, charged to the call cgroup `cgroups` ({controller: directory}, memory first)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(f"no sandbox for model-written code: bubblewrap (bwrap) is not installed; {UNISOLATED_HINT}")
    cmd = [bwrap, "--die-with-parent", "--new-session", "--clearenv"]
    cmd += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    if os.getuid() != 0:
        cmd += ["--unshare-user"]
    cmd += ["--cap-drop", "ALL"]
    for capability in ROOT_WORKER_CAPABILITIES if os.getuid() == 0 else WORKER_CAPABILITIES:
        cmd += ["--cap-add", capability]
    for key, value in ENVIRONMENT.items():
        cmd += ["--setenv", key, value]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            cmd += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            cmd += ["--ro-bind", path, path]
    cmd += ["--proc", "/proc", "--dev", "/dev"]
    cmd += ["--size", str(1 << 20), "--tmpfs", "/tmp"]  # only mount points: each call mounts its own over it
    binds = {t: s for t, s in python_dirs(preload).items() if not _under(t, SYSTEM_DIRS)}
    binds[WORKER_INSIDE] = str(WORKER)
    binds[WORLD_INSIDE] = str(WORLD)
    made = {"/", "/tmp", "/proc", "/dev", *SYSTEM_DIRS}
    for target in binds:
        for parent in map(str, reversed(Path(target).parents)):
            # bubblewrap makes a bind's missing parents 0700; the unprivileged call must traverse them
            if parent not in made and not _under(parent, SYSTEM_DIRS):
                cmd += ["--perms", "0755", "--dir", parent]
                made.add(parent)
    for target, source in binds.items():
        cmd += ["--ro-bind", source, target]
    cmd += ["--dir", "/sandbox/call-tmp"]  # where a call's /tmp is made when a Python lives under /tmp
    worker_args = ["--preload", ",".join(preload), "--isolated", "--tmp-mb", str(tmp_mb)]
    worker_args += ["--seccomp", base64.b64encode(seccomp).decode()]
    for controller, directory in (cgroups or {}).items():
        cmd += ["--bind", directory, f"{CGROUP_INSIDE}/{controller}"]
        worker_args += ["--cgroup", f"{CGROUP_INSIDE}/{controller}"]
    cmd += ["--remount-ro", "/", "--chdir", "/"]  # the worker's own root: nothing a call could leave there
    cmd += [sys.executable, "-I", WORKER_INSIDE, *worker_args]
    return cmd + (["--code-uid", str(uid)] if uid is not None else [])


def _under(path: str, dirs) -> bool:
    return any(path.startswith(d + "/") for d in dirs)


def unisolated_command(preload: tuple[str, ...], uid: int | None) -> list[str]:
    """A worker as a plain child process (`isolation: none`): limits and a private temporary directory, but the
    code sees this user's files, network and processes."""
    cmd = [sys.executable, "-I", str(WORKER), "--preload", ",".join(preload)]
    return cmd + (["--code-uid", str(uid)] if uid is not None else [])


def check_isolation(preload: tuple[str, ...] = ()) -> None:
    """Start a worker's sandbox once and run `true`-like Python in it; a one-line `SandboxUnavailable` if the
    machine cannot (no bubblewrap, or namespaces refused)."""
    cmd = bwrap_command(preload, tmp_mb=1, uid=code_uid())
    probe = cmd[: cmd.index(sys.executable)] + [sys.executable, "-I", "-c", "pass"]
    proc = subprocess.run(probe, capture_output=True, text=True, env=dict(ENVIRONMENT), timeout=60)
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SandboxUnavailable(f"no sandbox for model-written code: bubblewrap failed here ({reason}); {UNISOLATED_HINT}")
