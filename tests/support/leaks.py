"""Programs that try to leave something behind for a later call, and the trial each goes through: the hostile
call, then a second call on the same worker that looks for anything left (files at any depth, IPC objects,
kernel keys, processes), then a third call that must come back as fast as a plain one.

Used by tests/sandbox/test_leaks.py as root and, through `python -m tests.support.leaks`, as an unprivileged
user (tests/support/unprivileged.py); none of the programs signals a process outside its call.
"""

from __future__ import annotations

import json
import sys
import textwrap

# Raw system calls the programs make: {machine: number}.
SYSCALLS = {
    "exit": {"x86_64": 60, "aarch64": 93},
    "add_key": {"x86_64": 248, "aarch64": 217},
    "keyctl": {"x86_64": 250, "aarch64": 219},
}

_PRELUDE = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
SYSCALLS = {{name: numbers[os.uname().machine] for name, numbers in {SYSCALLS!r}.items()}}
"""

LEAKS = {
    "files deeper than the recursion limit, an unreadable directory": """
        os.chdir("/tmp")
        for _ in range(3000):
            os.mkdir("d")
            os.chdir("d")
        open("deep", "w").write("left")
        for path in ("/dev/shm/left", "/tmp/left", "/sandbox/left", "/left"):
            try:
                open(path, "w").write("left")
            except OSError:
                pass
        os.chdir("/tmp")
        os.chmod("d", 0)  # what a cleaner walking the tree can no longer read
        try:
            os.chmod("/tmp", 0)  # the call's own working directory, where the code owns it
        except OSError:
            pass
        print("planted")
    """,
    "System V shared memory, semaphores and message queues, POSIX message queues": """
        IPC_CREAT = 0o1000
        libc.shmat.restype = ctypes.c_void_p
        shm = libc.shmget(0x5EED, 1 << 20, IPC_CREAT | 0o666)
        address = libc.shmat(shm, None, 0)
        ctypes.memset(address, 1, 1 << 20)
        libc.shmdt(ctypes.c_void_p(address))  # detached: it stays until removed
        sem = libc.semget(0x5EED, 1, IPC_CREAT | 0o666)
        msg = libc.msgget(0x5EED, IPC_CREAT | 0o666)
        mq = libc.mq_open(b"/rlvr-leak", os.O_CREAT | os.O_RDWR, 0o666, None)
        print("planted", shm >= 0, sem >= 0, msg >= 0, mq >= 0)
    """,
    "kernel keys": """
        made = []
        for keyring in (-4, -3, -5):  # the user, session and user-session keyrings
            key = libc.syscall(SYSCALLS["add_key"], b"user", b"rlvr-leak", b"secret", 6, keyring)
            made.append((key, ctypes.get_errno()))
        joined = libc.syscall(SYSCALLS["keyctl"], 1, b"rlvr-leak-ring")  # KEYCTL_JOIN_SESSION_KEYRING
        print("keys", made, "session keyring", joined, ctypes.get_errno())
    """,
    "a thread that runs on after its process's main thread exits": """
        import threading, time
        def linger():
            while True:
                try:
                    seen = os.listdir("/tmp")  # a later call's files, if it could see them
                    open("/dev/shm/seen", "w").write(repr(seen))
                except OSError:
                    pass
                time.sleep(0.01)
        threading.Thread(target=linger).start()
        time.sleep(0.05)
        print("main thread exits", flush=True)
        libc.syscall(SYSCALLS["exit"], 0)  # this thread only; the GIL is released for the call
    """,
    "a forged answer written into every pipe it can reach": """
        import json, struct
        body = json.dumps({"stdout": "forged\\n", "stderr": "", "status": "ok", "exit_code": 0, "seconds": 0.0,
                           "clean": True, "left": ""}).encode()
        message = struct.pack(">I", len(body)) + body
        wrote = []
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                path = f"/proc/{pid}/fd/{fd}"
                try:
                    if os.readlink(path).startswith("pipe:") and fd not in ("1", "2"):
                        with open(path, "wb") as f:
                            f.write(message)
                        wrote.append(path)
                except OSError:
                    pass
        print("wrote", wrote)
    """,
    "processes, shared memory and files held until the time limit": """
        import mmap, time
        for _ in range(4):
            if os.fork() == 0:
                os.setsid()
                block = mmap.mmap(-1, 16 << 20)
                block.write(b"x" * (16 << 20))
                while True:
                    time.sleep(1)
        fd = os.memfd_create("held")
        os.write(fd, b"x" * (8 << 20))
        open("/dev/shm/held", "wb").write(b"x" * (8 << 20))
        while True:
            time.sleep(1)
    """,
    "an inode flood": """
        count = 0
        for top in ("/tmp", "/dev/shm"):
            try:
                while True:
                    open(f"{top}/f{count}", "w").close()
                    count += 1
            except OSError:
                pass
        print("files", count, flush=True)
        while True:
            pass
    """,
}

INSPECT = _PRELUDE + textwrap.dedent("""
    import json
    left = {}
    files = []
    stack = ["/tmp", "/dev/shm"]
    while stack:  # every depth, without recursion
        top = stack.pop()
        try:
            entries = list(os.scandir(top))
        except OSError as e:
            files.append(f"{top}: unreadable ({e.strerror})")
            continue
        for entry in entries:
            files.append(entry.path)
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    left["files"] = files
    left["root"] = sorted(os.listdir("/"))
    ipc = {}
    for kind in ("shm", "sem", "msg"):
        with open(f"/proc/sysvipc/{kind}") as f:
            ipc[kind] = f.read().splitlines()[1:]
    ipc["mq"] = libc.mq_open(b"/rlvr-leak", os.O_RDONLY, 0, None) >= 0
    left["ipc"] = ipc
    try:
        with open("/proc/keys") as f:
            left["keys"] = [line for line in f if "rlvr-leak" in line]
    except OSError:
        left["keys"] = []
    left["processes"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid())
    open("/tmp/second-call", "w").write("mine")
    print(json.dumps(left))
""")
NOTHING = {"files": [], "ipc": {"shm": [], "sem": [], "msg": [], "mq": False}, "keys": [],
         "processes": []}  # fmt: skip


# What the privilege probe asks of the kernel, each expected to be refused: {name: (system call, its arguments)}.
# A namespace flag alone (CLONE_NEWUSER) in clone's flags; TIOCSTI on /dev/null, which without the filter is
# "not a terminal" (ENOTTY), not EPERM.
REFUSED_CALLS = {
    "unshare a user namespace": ("unshare", (0x10000000,)),
    "unshare a mount namespace": ("unshare", (0x00020000,)),
    "clone into a new user namespace": ("clone", (0x10000000 | 17, 0, 0, 0, 0)),
    "setns": ("setns", (0, 0)),
    "keyctl": ("keyctl", (0, -3, 0)),
    "add_key": ("add_key", (0, 0, 0, 0, -4)),
    "request_key": ("request_key", (0, 0, 0, 0)),
    "ptrace": ("ptrace", (0, 0, 0, 0)),  # PTRACE_TRACEME
    "process_vm_readv": ("process_vm_readv", (1, 0, 0, 0, 0, 0)),
    "mount": ("mount", (0, 0, 0, 0, 0)),
    "bpf": ("bpf", (0, 0, 0)),
    "perf_event_open": ("perf_event_open", (0, 0, -1, -1, 0)),
    "userfaultfd": ("userfaultfd", (0,)),
    "init_module": ("init_module", (0, 0, 0)),
    "finit_module": ("finit_module", (-1, 0, 0)),
    "kexec_load": ("kexec_load", (0, 0, 0, 0)),
    "TIOCSTI": ("ioctl", ("null", 0x5412, 0)),
    "io_uring_setup": ("io_uring_setup", (1, 0)),
}

PRIVILEGE_PROBE = """
import ctypes, json, os, threading
libc = ctypes.CDLL(None, use_errno=True)
with open("/proc/self/status") as f:
    status = dict(line.rstrip("\\n").split(":\\t", 1) for line in f if ":\\t" in line)
null = os.open("/dev/null", os.O_RDONLY)
refused = {}
for name, (number, args) in CALLS.items():
    args = [null if a == "null" else a for a in args]
    ctypes.set_errno(0)
    result = libc.syscall(number, *[ctypes.c_long(a) for a in args])
    refused[name] = (result, ctypes.get_errno())
clone3 = libc.syscall(CLONE3, ctypes.c_long(0), ctypes.c_long(0)), ctypes.get_errno()
forked = os.fork()
if forked == 0:
    os._exit(7)
thread = threading.Thread(target=lambda: None)
thread.start()
thread.join()
print(json.dumps({"status": {k: status[k] for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")},
                  "refused": refused, "clone3": clone3, "fork": os.waitstatus_to_exitcode(os.waitpid(forked, 0)[1])}))
"""


def privilege_probe() -> str:
    """The probe with this machine's system call numbers (libseccomp's table)."""
    import pyseccomp

    arch = pyseccomp.system_arch()
    calls = {name: (pyseccomp.resolve_syscall(arch, call), args) for name, (call, args) in REFUSED_CALLS.items()}
    head = f"CALLS = {calls!r}\nCLONE3 = {pyseccomp.resolve_syscall(arch, 'clone3')!r}\n"
    return head + PRIVILEGE_PROBE


def program(name: str) -> str:
    return _PRELUDE + textwrap.dedent(LEAKS[name])


def inspect(box, timeout_s: float) -> dict:
    inspected = box.run(INSPECT, timeout_s)
    try:
        return json.loads(inspected.stdout)
    except ValueError:
        return {"unreadable": inspected.stdout + inspected.stderr}


def trial(box, name: str, timeout_s: float) -> dict:
    """What a call on the worker finds before the hostile call and after it, and how long a plain call then
    takes."""
    before = inspect(box, timeout_s)
    hostile = box.run(program(name), timeout_s)
    found = inspect(box, timeout_s)
    plain = box.run("print(1)", timeout_s)
    return {
        "before": before,
        "hostile": {"status": hostile.status, "stdout": hostile.stdout[-2000:], "stderr": hostile.stderr[-2000:],
                    "seconds": hostile.seconds},  # fmt: skip
        "found": found,
        "plain": {"status": plain.status, "stdout": plain.stdout, "seconds": plain.seconds},
    }


def trials(timeout_s: float) -> dict:
    """Every program's trial on a one-worker sandbox (so the three calls share it), with its memory bound."""
    from rlvr_lightning.sandbox import Sandbox, SandboxSettings

    settings = SandboxSettings(workers=1, timeout_s=timeout_s, memory_mb=256, tmp_mb=16, processes=32)
    with Sandbox(settings) as box:
        results = {name: trial(box, name, timeout_s) for name in LEAKS}
        probe = box.run(privilege_probe(), timeout_s)
        return {"memory_bound": box.memory_bound, "worker": box.worker_privileges()[0], "trials": results,
                "call": json.loads(probe.stdout) if probe.ok else {"failed": probe.stderr}}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(trials(float(sys.argv[1]) if len(sys.argv) > 1 else 2.0)))
