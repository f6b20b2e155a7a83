"""The world one call runs in, made new for every call inside the worker's sandbox and gone with the call.

A call's process is pid 1 of new PID, mount and IPC namespaces (`start_call`), born in the worker's call cgroup:
it mounts its own `/proc`, a size- and inode-limited `/tmp` and `/dev/shm`, then drops every capability,
becomes the worker's unprivileged user (as root), and loads a seccomp filter built by the host
(`seccomp_filter.py`) that refuses new namespaces, kernel keys, tracing, mounts and the rest of what math
never needs, before it runs the code. When it ends (or the worker kills it at the time limit), the kernel
kills every other process of the namespace, and the namespaces go with their last process: the call's files,
System V and POSIX IPC objects and processes cannot outlive it, whatever the code did.

As its namespace's init the code's process has two rules of the kernel's: a signal it sends itself with no
handler installed is ignored, and the processes it orphans are its children (they stay until the call ends,
counted against its processes). A separate init would cost a second fork of the warm interpreter per call.

Standard library only (`ctypes` over libc), like `worker.py`: this file is bound into the sandbox beside it.
Python has no binding for clone(2)'s namespace flags (`os.unshare` from 3.12 cannot put the caller itself in a
new PID namespace), and fork-then-unshare would cost one more fork of the warm interpreter per call
(about 4 ms here, the price of a whole call's fork), so the call is made by one raw clone(2) where its
calling convention is known, and by fork, unshare and fork elsewhere.
"""

from __future__ import annotations

import ctypes
import os
import signal

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID = 0x00020000, 0x08000000, 0x20000000
CALL_NAMESPACES = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWPID
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
MNT_DETACH = 2
ST_FLAGS_TO_MS = {os.ST_RDONLY: MS_RDONLY, os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 4, 22, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
SECCOMP_MODE_FILTER = 2
# clone(2) with no stack returns in the child like fork; where the arguments after `flags` are all zero their
# order (which differs between architectures) does not matter. s390 takes the stack first: not listed.
SYS_CLONE = {"x86_64": 56, "aarch64": 220, "riscv64": 220}
# Kernel interfaces of /proc that bubblewrap makes read-only; a new /proc mount would make them writable again.
PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus")
CALL_TMP_STAGING = "/sandbox/call-tmp"  # where the call's /tmp is made before it is moved over /tmp

_libc = ctypes.CDLL(None, use_errno=True)
# A raw clone must not release the GIL: the child comes back into the interpreter as its only thread (the worker
# runs one thread, so no other thread's state is copied half-way).
_libc_holding_gil = ctypes.PyDLL(None, use_errno=True)


def _check(result: int, what: str) -> int:
    if result == -1:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
    return result


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _prctl(option: int, arg: int = 0) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)), "prctl")


def make_undumpable() -> None:
    """The worker's /proc files become root's and it cannot be traced: nothing of its (its pipes to the host)
    is reachable by a process of the same user."""
    _prctl(PR_SET_DUMPABLE, 0)


def bound_to_effective() -> None:
    """Drop from the bounding set every capability the worker does not hold (bubblewrap as root leaves the
    bounding set whole), so that nothing it or a call starts can ever gain one."""
    with open("/proc/self/status") as f:
        effective = int(next(line for line in f if line.startswith("CapEff:")).split()[1], 16)
    for cap in range(_last_capability() + 1):
        if not effective >> cap & 1:
            _prctl(PR_CAPBSET_DROP, cap)


def start_call(call) -> int:
    """Run `call()` (which must not return) as pid 1 of new PID, mount and IPC namespaces: the call's
    process, whose end the kernel makes the end of every process it started. Its pid, to wait for and kill."""
    number = SYS_CLONE.get(os.uname().machine)
    if number is not None:
        zero = ctypes.c_void_p(0)
        flags = ctypes.c_ulong(CALL_NAMESPACES | signal.SIGCHLD)
        pid = _libc_holding_gil.syscall(ctypes.c_long(number), flags, zero, zero, zero, zero)
        if pid == 0:
            _run_child(call)
        return _check(pid, "clone")
    relay = os.fork()  # unshare, then the first fork is the namespace's pid 1, whose end this process relays
    if relay == 0:
        try:
            _check(_libc.unshare(CALL_NAMESPACES), "unshare")
            pid = os.fork()
            if pid == 0:
                _run_child(call)
            status = os.waitpid(pid, 0)[1]
            if os.WIFSIGNALED(status):  # end as it ended, so the worker reads the same wait status
                signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
                os.kill(os.getpid(), os.WTERMSIG(status))
            os._exit(os.waitstatus_to_exitcode(status))
        finally:
            os._exit(125)
    return relay


def _run_child(call) -> None:
    try:
        die_with_parent()
        call()
    finally:
        os._exit(125)


def die_with_parent() -> None:
    """The worker (or the relay) gone, the call goes (a change of user clears it: set again after one)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def enter_call_mounts(tmp_bytes: int, tmp_inodes: int, kept_in_tmp: list[str], cgroups: list[str]) -> None:
    """In the call's process, first: mount the call's own /proc, /tmp and /dev/shm (the entries of
    `kept_in_tmp`, a Python installed under /tmp, bound back in), make /dev read-only and hide the call
    cgroup's files (the worker is in that cgroup, and so is every process a call starts)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the worker
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if cgroups:  # at the call's limit the kernel stops a process of the call, never the worker, whose warm pages
        _prctl(PR_SET_DUMPABLE, 1)  # make it the cgroup's largest (its /proc files are its own again for this)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # the call's processes inherit it and cannot lower it
    for name in PROC_READ_ONLY:
        path = f"/proc/{name}"
        if os.path.exists(path):
            _mount(path, path, None, MS_BIND | MS_REC)
            _read_only(path)
    options = f"size={tmp_bytes},nr_inodes={tmp_inodes},mode=1777"
    if kept_in_tmp:
        _mount("tmpfs", CALL_TMP_STAGING, "tmpfs", MS_NOSUID | MS_NODEV, options)
        for name in kept_in_tmp:  # read-only: they are the worker's own /tmp, which a call must not write
            kept = os.path.join(CALL_TMP_STAGING, name)
            os.mkdir(kept)
            _mount(os.path.join("/tmp", name), kept, None, MS_BIND | MS_REC)
            _read_only(kept)
        _mount(CALL_TMP_STAGING, "/tmp", None, MS_MOVE)
    else:
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, options)
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, options)
    _read_only("/dev")
    for directory in cgroups:
        _check(_libc.umount2(directory.encode(), MNT_DETACH), f"umount {directory}")


def _read_only(path: str) -> None:
    """Remount a mount point read-only, keeping its other flags (a user namespace refuses to clear them)."""
    kept = os.statvfs(path).f_flag
    flags = sum(ms for st, ms in ST_FLAGS_TO_MS.items() if kept & st)
    _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)


def drop_privileges(code_uid: int | None) -> None:
    """In the code's process: no capability left in any set, the unprivileged user where the worker is root,
    and no way back (no-new-privileges)."""
    last = _last_capability()
    for cap in range(last + 1):  # the bounding set, while this process still may (CAP_SETPCAP)
        if _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)):
            break  # not permitted: a worker that kept no CAP_SETPCAP
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    if code_uid is not None:
        os.setgroups([])
        os.setgid(code_uid)
        os.setuid(code_uid)
    clear_capabilities()
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_DUMPABLE, 1)  # its own /proc files are its own again (a uid change made them root's)
    die_with_parent()


def clear_capabilities() -> None:
    """Empty the effective, permitted and inheritable sets (capset(2), version 3: two 32-bit words each)."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(header, data), "capset")


def _last_capability() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return 63


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp(program: bytes) -> None:
    """Load a compiled seccomp filter (struct sock_filter[], as libseccomp exports it) for this process and
    every process it starts."""
    if not program:
        return
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _check(
        _libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog), ctypes.c_ulong(0), ctypes.c_ulong(0)),
        "seccomp",
    )
