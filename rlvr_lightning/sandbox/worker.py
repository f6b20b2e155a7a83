"""The process inside the sandbox: it imports the preloaded modules once (numpy, sympy), then runs each call
in a world of its own (`world.py`) forked from itself, so a call starts warm in milliseconds and leaves nothing.

Standard library only, and no import of `rlvr_lightning`: this file and `world.py` are the package's only
pieces the sandbox can see. The host talks to it over stdin/stdout, one length-prefixed JSON message per call
(`protocol`: {"code", "timeout_s", "memory_mb", "output_bytes", "file_mb", "processes"} in, the result out).

Inside bubblewrap (`--isolated`) each call's init is pid 1 of new PID, mount and IPC namespaces; it forks the
code's process, which drops every capability and privilege, sets its limits, loads the seccomp filter and runs
the code as `__main__` (when it prints nothing, its last expression's value is printed, as in a notebook
cell). The worker reads the code's output while it runs and stops at the cap; at the time limit or the cap it
kills the init, and the kernel every process of the call with it. Before answering it checks that nothing of
the call is left (a process, or a process in the call cgroup); an answer that says otherwise makes the host
replace the worker. Without bubblewrap (`isolation: none`, trusted code only) a call is a plain child in a
directory of its own, and its process group is killed.
"""

from __future__ import annotations

import argparse
import ast
import base64
import json
import os
import resource
import select
import signal
import struct
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # world.py beside it (-I leaves it out)
import world  # noqa: E402

HEADER = struct.Struct(">I")
NOT_STARTED = 125  # the exit code of a call whose code never ran (its world or its limits could not be made)


def read_message(stream, max_bytes: int | None = None) -> dict | None:
    """The next message, or None at the end of the stream; ValueError for one longer than `max_bytes`."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"a message of {size} bytes (at most {max_bytes})")
    return json.loads(stream.read(size))


def write_message(stream, message: dict) -> None:
    body = json.dumps(message).encode()
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


class _CountingWriter:
    """sys.stdout that remembers whether anything was printed (the last expression is shown only if not)."""

    def __init__(self, inner) -> None:
        self.inner, self.written = inner, False

    def write(self, text: str) -> int:
        self.written = self.written or bool(text)
        return self.inner.write(text)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run_code(code: str) -> None:
    """Run `code` as `__main__`; when it printed nothing, print its last expression's value (not None)."""
    out = _CountingWriter(sys.stdout)
    sys.stdout = out
    tree = ast.parse(code, "<code>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(tree, "<code>", "exec"), scope)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<code>", "eval"), scope)
        if value is not None and not out.written:
            print(repr(value))


def code_process(request: dict, out_fd: int, err_fd: int, cwd: str, code_uid: int | None, seccomp: bytes) -> None:
    """The code's process: standard streams on the worker's pipes, nothing else open, no privilege (the
    code's user where the worker is root), the limits, the seccomp filter, then the code. Never returns."""
    try:
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.closerange(3, 65536)  # nothing of the worker's (its pipes, the init's status pipe) stays open
        world.drop_privileges(code_uid)
        os.chdir(cwd)
        mib = 1 << 20
        cpu_s = int(request["timeout_s"]) + 1
        limits = {
            resource.RLIMIT_CPU: (cpu_s, cpu_s + 1),  # SIGXCPU (a time-out) before the hard limit's SIGKILL
            resource.RLIMIT_AS: _both(_address_space_bytes() + int(request["memory_mb"]) * mib),  # per process
            resource.RLIMIT_FSIZE: _both(int(request["file_mb"]) * mib),
            resource.RLIMIT_NPROC: _both(int(request["processes"])),
            resource.RLIMIT_NOFILE: _both(64),
            resource.RLIMIT_CORE: _both(0),
        }
        for kind, (soft, hard) in limits.items():
            resource.setrlimit(kind, (soft, hard))
        world.load_seccomp(seccomp)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        status = 0
        try:
            run_code(request["code"])
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:  # the model's error is the call's output; the worker's frames are not
            import traceback

            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
                tb = tb.tb_next
            traceback.print_exception(type(e), e, tb)
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    except BaseException as e:
        try:
            os.write(2, f"the sandbox could not start the call: {e}\n".encode())
        finally:
            os._exit(NOT_STARTED)


def _both(value: int) -> tuple[int, int]:
    return value, value


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


class Isolated:
    """What a worker inside bubblewrap runs its calls with: the seccomp filter, the call cgroup's directories
    (memory first), and the sizes of the call's /tmp."""

    def __init__(self, seccomp: bytes, cgroups: list[str], tmp_mb: int) -> None:
        self.seccomp, self.cgroups = seccomp, cgroups
        self.tmp_bytes = tmp_mb << 20
        self.tmp_inodes = max(1024, tmp_mb * 256)  # a flood of empty files ends here, and so does its teardown
        self.kept_in_tmp = sorted(os.listdir("/tmp"))  # bubblewrap's mount points there (a Python under /tmp)


class Worker:
    def __init__(self, code_uid: int | None, isolated: Isolated | None) -> None:
        self.code_uid, self.isolated = code_uid, isolated
        self.memory = CallMemory(isolated.cgroups[0]) if isolated and isolated.cgroups else None

    def call(self, request: dict) -> dict:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        made_r, made_w = os.pipe()  # one byte once the call's world is made (the code never holds this pipe)
        if self.memory is not None:
            self.memory.start()
        start = time.monotonic()
        call_dir = None
        if self.isolated is not None:
            pid = world.start_call(lambda: self._isolated_call(request, out_w, err_w, made_w))
        else:
            call_dir = tempfile.mkdtemp(prefix="rlvr-sandbox-")
            if self.code_uid is not None:
                os.chown(call_dir, self.code_uid, self.code_uid)
            os.write(made_w, b"1")
            pid = os.fork()
            if pid == 0:
                os.setsid()
                code_process(request, out_w, err_w, call_dir, self.code_uid, b"")
        for fd in (out_w, err_w, made_w):
            os.close(fd)
        reason, stdout, stderr, status = self._read(request, start, pid, out_r, err_r)
        made = os.read(made_r, 1)  # the call has ended: its byte is there, or the pipe is closed
        for fd in (out_r, err_r, made_r):
            os.close(fd)
        clean, left = self._clean(call_dir)
        if not made:  # the worker, not the code, failed: it is replaced
            clean, left = False, stderr.decode(errors="replace")[-500:]
        answer = {
            "stdout": stdout.decode("utf-8", "replace"),
            "stderr": stderr.decode("utf-8", "replace"),
            "status": reason or ("ok" if status == 0 else ("timeout" if _hit_cpu_limit(status) else "error")),
            "exit_code": os.waitstatus_to_exitcode(status),
            "seconds": time.monotonic() - start,
            "clean": clean,
            "left": left,
        }
        if self.memory is not None:
            answer.update(self.memory.end())
        return answer

    def _isolated_call(self, request: dict, out_w: int, err_w: int, made_w: int) -> None:
        """The call's process, pid 1 of its namespaces: its cgroup and mounts, then the code."""
        iso = self.isolated
        try:
            world.enter_call_mounts(iso.tmp_bytes, iso.tmp_inodes, iso.kept_in_tmp, iso.cgroups)
        except OSError as e:
            os.write(err_w, f"the call's world could not be made: {e}\n".encode())
            os._exit(NOT_STARTED)
        os.write(made_w, b"1")
        code_process(request, out_w, err_w, "/tmp", self.code_uid, iso.seccomp)

    def _read(self, request, start, pid, out_r, err_r) -> tuple[str | None, bytes, bytes, int]:
        """Read the call's output while it runs, until it ends, the time limit or the output cap; then end
        what is left of it. How it ended (None: by itself), its stdout and stderr, its wait status."""
        cap, deadline = int(request["output_bytes"]), start + float(request["timeout_s"])
        output = Output(cap, out_r, err_r)
        ended = os.pidfd_open(pid)  # readable once the call's process has ended (as an init: all of the call)
        reason = None
        try:
            while reason is None:
                now = time.monotonic()
                if now >= deadline:
                    reason = "timeout"
                    break
                ready, _, _ = select.select([*output.open, ended], [], [], deadline - now)
                if ended in ready:
                    break
                reason = output.read(ready)
        finally:
            os.close(ended)
        if reason is None:  # ended by itself; a plain child's daemons may still hold the pipes
            status = os.waitpid(pid, 0)[1]
            reason = output.drain(0.05)
            if self.isolated is None:
                _kill_group(pid)
            return reason, *output.text(), status
        if self.isolated is None:
            _kill_group(pid)
        else:
            os.kill(pid, signal.SIGKILL)  # the call's init: the kernel kills every process of its namespace
        return reason, *output.text(), os.waitpid(pid, 0)[1]

    def _clean(self, call_dir: str | None) -> tuple[bool, str]:
        """Whether nothing of the call is left, and what is: a process in this worker's namespace (the worker
        and bubblewrap's init are the only ones between calls), a process in the call cgroup, a file."""
        if call_dir is not None:
            import shutil

            shutil.rmtree(call_dir, ignore_errors=True)  # a trusted call's directory; checked just below
            return (False, f"files under {call_dir}") if os.path.exists(call_dir) else (True, "")
        me = os.getpid()
        deadline = time.monotonic() + 1.0
        while True:
            others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
            cgroup = self.memory.processes() if self.memory is not None else []
            if not others and not cgroup:
                return True, ""
            if time.monotonic() > deadline:
                return False, f"processes {sorted(set(others) | set(cgroup))}"
            time.sleep(0.005)  # the kernel finishes a namespace's teardown


class Output:
    """A call's stdout and stderr as read, to `cap` bytes together."""

    def __init__(self, cap: int, out_r: int, err_r: int) -> None:
        self.cap, self.total = cap, 0
        self.fds = (out_r, err_r)
        self.chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        self.open = {out_r, err_r}

    def read(self, ready) -> str | None:
        """Read what `ready` holds; "output_limit" once the cap is passed."""
        for fd in ready:
            if fd not in self.open:
                continue
            data = os.read(fd, 65536)
            if not data:
                self.open.discard(fd)
                continue
            take = data[: max(0, self.cap - self.total)]
            self.chunks[fd].append(take)
            self.total += len(take)
            if len(take) < len(data):
                return "output_limit"
        return None

    def drain(self, wait_s: float) -> str | None:
        """What is left in the pipes after the call's end (at once: their writers are gone)."""
        deadline = time.monotonic() + wait_s
        while self.open and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(list(self.open), [], [], left)
            if not ready:
                return None
            if (reason := self.read(ready)) is not None:
                return reason
        return None

    def text(self) -> tuple[bytes, bytes]:
        return b"".join(self.chunks[self.fds[0]]), b"".join(self.chunks[self.fds[1]])


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class CallMemory:
    """The call cgroup's memory (cgroup v1): its peak reset before each call, read after, with the kernel's
    out-of-memory kills of the call's processes. The worker is in the cgroup too: what it allocated since it
    joined (its messages, a few MiB) counts in the peak, within the cgroup's margin for it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.kills_before = 0

    def _read(self, name: str) -> str:
        with open(os.path.join(self.directory, name)) as f:
            return f.read()

    def _kills(self) -> int:
        for line in self._read("memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def start(self) -> None:
        with open(os.path.join(self.directory, "memory.max_usage_in_bytes"), "w") as f:
            f.write("0")
        self.kills_before = self._kills()

    def end(self) -> dict:
        return {
            "memory_peak_mb": int(self._read("memory.max_usage_in_bytes")) / (1 << 20),
            "memory_kills": self._kills() - self.kills_before,
        }

    def processes(self) -> list[str]:
        """The call cgroup's processes but the worker's own."""
        return [p for p in self._read("cgroup.procs").split() if int(p) != os.getpid()]


def _hit_cpu_limit(status: int) -> bool:
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU


def privileges() -> dict:
    """This process's capability sets, no-new-privileges flag and seccomp mode, as /proc shows them."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    keys = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
    return {k: fields[k].strip() for k in keys if k in fields}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preload", default="")
    p.add_argument("--code-uid", type=int, default=None)
    p.add_argument("--isolated", action="store_true", help="inside bubblewrap: each call in a world of its own")
    p.add_argument("--seccomp", default="", help="the compiled seccomp filter, base64")
    p.add_argument("--cgroup", action="append", default=[], help="a call cgroup's directory (memory first)")
    p.add_argument("--tmp-mb", type=int, default=64)
    args = p.parse_args()
    for name in filter(None, args.preload.split(",")):
        __import__(name)
    world.make_undumpable()
    isolated = None
    code_uid = None
    if args.isolated:
        # A root worker (inside its namespaces) keeps the right to drop each call to the code's user; a
        # non-root one runs the code as itself.
        code_uid = args.code_uid if os.getuid() == 0 else None
        isolated = Isolated(base64.b64decode(args.seccomp), args.cgroup, args.tmp_mb)
        world.bound_to_effective()
        for directory in args.cgroup:  # after the preload, whose pages stay charged where they were
            with open(os.path.join(directory, "cgroup.procs"), "w") as f:
                f.write("0")  # every call is born here: no move per call (a move waits out an RCU grace period)
    else:
        code_uid = args.code_uid
    worker = Worker(code_uid, isolated)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints of an import must not corrupt the protocol
    write_message(stdout, {"ready": True, "preloaded": args.preload, "privileges": privileges()})
    while (request := read_message(stdin)) is not None:
        write_message(stdout, worker.call(request))


if __name__ == "__main__":
    main()
