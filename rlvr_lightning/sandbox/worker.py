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
            os._exit(125)


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
        status_r, status_w = os.pipe()
        if self.memory is not None:
            self.memory.start()
        start = time.monotonic()
        call_dir = None
        if self.isolated is not None:
            pid = world.start_init(lambda: self._init(request, out_w, err_w, status_r, status_w))
        else:
            call_dir = tempfile.mkdtemp(prefix="rlvr-sandbox-")
            if self.code_uid is not None:
                os.chown(call_dir, self.code_uid, self.code_uid)
            pid = os.fork()
            if pid == 0:
                os.setsid()
                code_process(request, out_w, err_w, call_dir, self.code_uid, b"")
        for fd in (out_w, err_w, status_w):
            os.close(fd)
        reason, chunks, status = self._read(request, start, pid, out_r, err_r, status_r)
        wait_status = self._end(pid, reaped=self.isolated is None and status is not None)
        for fd in (out_r, err_r, status_r):
            os.close(fd)
        clean, left = self._clean(call_dir)
        if status is None:  # killed at the limit or the cap; or an init that ended before the code did
            status = wait_status
            if self.isolated is not None and reason is None:
                clean, left = False, "the call's init ended before its code: " + b"".join(chunks[1]).decode(errors="replace")[-500:]
        answer = {
            "stdout": b"".join(chunks[0]).decode("utf-8", "replace"),
            "stderr": b"".join(chunks[1]).decode("utf-8", "replace"),
            "status": reason or ("ok" if status == 0 else ("timeout" if _hit_cpu_limit(status) else "error")),
            "exit_code": os.waitstatus_to_exitcode(status),
            "seconds": time.monotonic() - start,
            "clean": clean,
            "left": left,
        }
        if self.memory is not None:
            answer.update(self.memory.end())
        return answer

    def _init(self, request: dict, out_w: int, err_w: int, status_r: int, status_w: int) -> None:
        """The call's init (pid 1 of its namespaces): its mounts, the code's process, then its end, which the
        kernel makes the end of every process of the call."""
        iso = self.isolated
        os.close(status_r)
        try:
            world.default_signals()
            world.enter_call_mounts(iso.tmp_bytes, iso.tmp_inodes, iso.kept_in_tmp, iso.cgroups)
        except OSError as e:  # reported as the call's stderr; the worker is replaced (`_clean`)
            os.write(err_w, f"the call's world could not be made: {e}\n".encode())
            os._exit(125)
        pid = os.fork()
        if pid == 0:
            code_process(request, out_w, err_w, "/tmp", self.code_uid, iso.seccomp)
        os.close(out_w)
        os.close(err_w)
        world.clear_capabilities()  # the init needs none while it waits
        while True:  # orphans of the call are reaped here until the code's process ends
            done, status = os.waitpid(-1, 0)
            if done == pid:
                break
        os.write(status_w, world.STATUS.pack(status))
        os._exit(0)

    def _read(self, request, start, pid, out_r, err_r, status_r):
        """Read the call's output until its init reports the code's end, the time limit or the output cap."""
        cap, deadline = int(request["output_bytes"]), start + float(request["timeout_s"])
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        total, reason, status, status_bytes = 0, None, None, b""
        watched = {out_r, err_r} | ({status_r} if self.isolated is not None else set())
        while watched and reason is None:
            now = time.monotonic()
            if now >= deadline:
                reason = "timeout"
                break
            wait = min(deadline - now, 0.02 if self.isolated is None else deadline - now)
            ready, _, _ = select.select(list(watched), [], [], wait)
            for fd in ready:
                data = os.read(fd, 65536)
                if fd == status_r:
                    status_bytes += data
                    if not data:
                        watched.clear()  # the init has ended: so has every process of the call
                    continue
                if not data:
                    watched.discard(fd)
                    continue
                take = data[: max(0, cap - total)]
                chunks[fd].append(take)
                total += len(take)
                if len(take) < len(data):
                    reason = "output_limit"
            if self.isolated is None:  # a plain child: its end ends the call (its daemons may hold the pipes)
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = raw
                    reason = reason or self._drain(chunks, total, cap, watched, 0.05)
                    watched = set()
        if len(status_bytes) == world.STATUS.size:
            (status,) = world.STATUS.unpack(status_bytes)
        if reason is None and self.isolated is not None:
            reason = self._drain(chunks, total, cap, {out_r, err_r}, 0.2)  # what the code wrote last
        return reason, (chunks[out_r], chunks[err_r]), status

    @staticmethod
    def _drain(chunks, total, cap, fds, wait_s) -> str | None:
        deadline = time.monotonic() + wait_s
        fds = set(fds)
        while fds and time.monotonic() < deadline:
            ready, _, _ = select.select(list(fds), [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for fd in ready:
                data = os.read(fd, 65536)
                if not data:
                    fds.discard(fd)
                    continue
                take = data[: max(0, cap - total)]
                chunks[fd].append(take)
                total += len(take)
                if len(take) < len(data):
                    return "output_limit"
        return None

    def _end(self, pid: int, reaped: bool) -> int:
        """Kill what is left of the call (nothing, when it ended by itself) and reap it; its wait status."""
        if self.isolated is None:  # a plain child's process group: its daemons, if it left any
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return 0 if reaped else os.waitpid(pid, 0)[1]
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        try:
            os.kill(pid, signal.SIGKILL)  # the init: the kernel kills every process of its namespace
        except ProcessLookupError:
            pass
        return os.waitpid(pid, 0)[1]

    def _clean(self, call_dir: str | None) -> tuple[bool, str]:
        """Whether nothing of the call is left, and what is: a process in this worker's namespace (the worker
        and bubblewrap's init are the only ones between calls), a process in the call cgroup, a file."""
        if call_dir is not None:
            import shutil

            shutil.rmtree(call_dir, ignore_errors=True)  # a trusted call's directory; checked just below
            return (False, f"files under {call_dir}") if os.path.exists(call_dir) else (True, "")
        me = os.getpid()
        _reap()
        deadline = time.monotonic() + 1.0
        while True:
            others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
            cgroup = self.memory.processes() if self.memory is not None else []
            if not others and not cgroup:
                return True, ""
            if time.monotonic() > deadline:
                return False, f"processes {sorted(set(others) | set(cgroup))}"
            time.sleep(0.005)  # the kernel finishes a namespace's teardown


class CallMemory:
    """The call cgroup's memory (cgroup v1): its peak reset before each call, read after, with the kernel's
    out-of-memory kills of the call's processes."""

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
        return self._read("cgroup.procs").split()


def _reap() -> None:
    while True:
        try:
            done, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not done:
            return


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
