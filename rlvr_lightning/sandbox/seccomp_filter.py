"""The seccomp filter a sandboxed call runs under: the system calls that model-written math never needs and
that would let it reach past its call (new namespaces, kernel keys, other processes' memory, mounts, kernel
code and tracing) fail with EPERM; everything else is allowed.

Built on the host with libseccomp (its own Python binding `seccomp` where installed, else `pyseccomp`, the
same API over the system's libseccomp through ctypes) and handed to the worker as the compiled BPF program,
which the code's process loads last (`world.load_seccomp`): the worker itself still makes each call's
namespaces, so bubblewrap's `--seccomp`, which would filter the worker too, does not fit.
"""

from __future__ import annotations

import errno
import functools
import tempfile

from rlvr_lightning.sandbox.isolation import SandboxUnavailable

# What each refused call would give the code.
REFUSED = {
    "new namespaces (a world the call's limits and cleanup do not see)": ("unshare", "setns"),
    "kernel keys (they outlive the call, on the host too)": ("keyctl", "add_key", "request_key"),
    "other processes' memory and tracing": ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp"),
    "mounts": ("mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
               "move_mount", "open_tree", "mount_setattr"),  # fmt: skip
    "kernel programs, performance counters and page-fault handling": ("bpf", "perf_event_open", "userfaultfd"),
    "kernel modules and kexec": ("init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load"),
    "file handles that bypass path permissions": ("open_by_handle_at", "name_to_handle_at"),
    "io_uring (its own path around the filter)": ("io_uring_setup", "io_uring_enter", "io_uring_register"),
    "the system's own switches": ("swapon", "swapoff", "reboot", "syslog", "acct", "quotactl", "lookup_dcookie"),
}
# clone's flags that make namespaces: each refused alone (a rule matches one masked value).
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWTIME": 0x00000080,
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
# Terminal ioctls that type into another program's input (TIOCSTI) or reach the console (TIOCLINUX).
REFUSED_IOCTLS = {"TIOCSTI": 0x5412, "TIOCLINUX": 0x541C}


def _binding():
    try:
        import seccomp  # libseccomp's own binding, where the system has it
    except ImportError:
        try:
            import pyseccomp as seccomp
        except ImportError as e:
            raise SandboxUnavailable(f"no seccomp for the sandbox: {e} (`pip install pyseccomp`)") from e
    return seccomp


@functools.lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The compiled filter (a struct sock_filter array for this machine's architecture)."""
    seccomp = _binding()
    try:
        f = seccomp.SyscallFilter(seccomp.ALLOW)
        refuse = seccomp.ERRNO(errno.EPERM)
        for names in REFUSED.values():
            for name in names:  # a call this architecture lacks is a pseudo-number libseccomp leaves out
                f.add_rule(refuse, name)
        for flag in CLONE_NAMESPACE_FLAGS.values():
            f.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
        # clone3 passes its flags in memory a filter cannot read: refused as "not implemented", so the C
        # library falls back to clone, whose flags are checked above.
        f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        for request in REFUSED_IOCTLS.values():
            f.add_rule(refuse, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, request))
        with tempfile.TemporaryFile() as out:
            f.export_bpf(out)
            out.seek(0)
            return out.read()
    except (OSError, RuntimeError, ValueError) as e:
        raise SandboxUnavailable(f"no seccomp filter for the sandbox: libseccomp failed ({e})") from e
