"""The process inside the sandbox: it imports the preloaded modules once (numpy, sympy), then runs each call
in a child forked from itself, so a call starts warm and clean in milliseconds instead of an interpreter start.

Standard library only, and no import of `rlvr_lightning`: this file is the one piece of the package the
sandbox can see. The host talks to it over stdin/stdout, one length-prefixed JSON message per call
(`protocol`: {"code", "timeout_s", "memory_mb", "output_bytes", "file_mb", "processes"} in, the result out).

A call's child drops to the unprivileged `--code-uid` where the worker can (it started as root inside its own
namespaces, with only the capabilities to do that and to kill), sets its resource limits, and runs the code
as `__main__`; when it prints nothing, its last expression's value is printed, as in a notebook cell. The
worker reads the child's output while it runs and stops at the cap; at the time limit, the output cap or the
child's end it kills every other process of its PID namespace (`--own-pid-namespace`), so nothing the code
started outlives the call, and it empties the private /tmp.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import resource
import select
import signal
import struct
import sys
import time

HEADER = struct.Struct(">I")


def read_message(stream) -> dict | None:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
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


def child(request: dict, out_fd: int, err_fd: int, code_uid: int | None, call_dir: str) -> None:
    """The forked child: its own session, the unprivileged user, the limits, then the code. Never returns."""
    try:
        os.setsid()
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.closerange(3, 65536)  # nothing of the worker's (its pipes to the host) stays open in the call
        if code_uid is not None:
            os.setgroups([])
            os.setgid(code_uid)
            os.setuid(code_uid)
        os.makedirs(call_dir, exist_ok=True)
        os.chdir(call_dir)
        mib = 1 << 20
        vm = _address_space_bytes()
        cpu_s = int(request["timeout_s"]) + 1
        limits = {
            resource.RLIMIT_CPU: (cpu_s, cpu_s + 1),  # SIGXCPU (a time-out) before the hard limit's SIGKILL
            resource.RLIMIT_AS: _both(vm + int(request["memory_mb"]) * mib),  # beyond the warm interpreter's own
            resource.RLIMIT_FSIZE: _both(int(request["file_mb"]) * mib),
            resource.RLIMIT_NPROC: _both(int(request["processes"])),
            resource.RLIMIT_NOFILE: _both(64),
            resource.RLIMIT_CORE: _both(0),
        }
        for kind, (soft, hard) in limits.items():
            resource.setrlimit(kind, (soft, hard))
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
    except BaseException:
        os._exit(125)


def _both(value: int) -> tuple[int, int]:
    return value, value


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


class Worker:
    def __init__(self, code_uid: int | None, own_pid_namespace: bool) -> None:
        self.code_uid = code_uid
        self.own_pid_namespace = own_pid_namespace
        # Inside the sandbox /tmp is its own; without one, a private directory (never the machine's /tmp).
        if own_pid_namespace:
            self.tmp = "/tmp"
        else:
            import tempfile

            self.tmp = tempfile.mkdtemp(prefix="rlvr-sandbox-")
            os.chmod(self.tmp, 0o1777)
        self.fixed = set(os.listdir(self.tmp))  # mount points of the sandbox's own (a Python installed under /tmp)

    def call(self, request: dict) -> dict:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(out_r)
            os.close(err_r)
            child(request, out_w, err_w, self.code_uid, os.path.join(self.tmp, "call"))
        os.close(out_w)
        os.close(err_w)
        cap, deadline = int(request["output_bytes"]), start + float(request["timeout_s"])
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        total, reason, status, open_fds = 0, None, None, {out_r, err_r}
        # Read while the child runs; a process it left behind may hold the pipes open, so the child's end (and
        # a short drain) ends the call, not the pipes' end.
        child_done_at = None
        while open_fds and reason is None:
            now = time.monotonic()
            if now >= deadline:
                reason = "timeout"
                break
            if child_done_at is not None and now - child_done_at > 0.05:
                break
            ready, _, _ = select.select(list(open_fds), [], [], min(deadline - now, 0.02))
            for fd in ready:
                data = os.read(fd, 65536)
                if not data:
                    open_fds.discard(fd)
                    continue
                take = data[: max(0, cap - total)]
                chunks[fd].append(take)
                total += len(take)
                if len(take) < len(data):
                    reason = "output_limit"
            if status is None:
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    status, child_done_at = raw, time.monotonic()
        while status is None and reason is None and time.monotonic() < deadline:  # the pipes closed first
            done, raw = os.waitpid(pid, os.WNOHANG)
            status = raw if done else time.sleep(0.002)
        if status is None:
            reason = reason or "timeout"
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
        self._kill_call(pid)
        for fd in (out_r, err_r):
            os.close(fd)
        self._clean_tmp()
        if reason is None:
            reason = "ok" if status == 0 else ("timeout" if _hit_cpu_limit(status) else "error")
        return {
            "stdout": b"".join(chunks[out_r]).decode("utf-8", "replace"),
            "stderr": b"".join(chunks[err_r]).decode("utf-8", "replace"),
            "status": reason,
            "exit_code": os.waitstatus_to_exitcode(status),
            "seconds": time.monotonic() - start,
        }

    def _kill_call(self, pid: int) -> None:
        """Kill the call's processes: in this worker's own PID namespace every process but the worker and the
        namespace's init (repeated while a fork bomb still spawns); without one, the child's process group."""
        if not self.own_pid_namespace:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return
        me = os.getpid()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            others = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
            alive = [pid for pid in others if not _is_zombie(pid)]
            if not others:
                return
            for other in alive:  # repeated while a fork bomb still spawns
                try:
                    os.kill(other, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            _reap()  # the worker's own children; the namespace's init reaps the orphans
            time.sleep(0.001)

    def _clean_tmp(self) -> None:
        """Empty the private temporary directory as the code's user (its files are the code's own)."""
        if not set(os.listdir(self.tmp)) - self.fixed:
            return
        pid = os.fork()
        if pid == 0:
            try:
                if self.code_uid is not None:
                    os.setgroups([])
                    os.setgid(self.code_uid)
                    os.setuid(self.code_uid)
                import shutil

                for name in set(os.listdir(self.tmp)) - self.fixed:
                    path = os.path.join(self.tmp, name)
                    try:
                        if os.path.isdir(path) and not os.path.islink(path):
                            shutil.rmtree(path, ignore_errors=True)
                        else:
                            os.unlink(path)
                    except OSError:
                        pass
            finally:
                os._exit(0)
        os.waitpid(pid, 0)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True  # gone already


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preload", default="")
    p.add_argument("--code-uid", type=int, default=None)
    p.add_argument("--own-pid-namespace", action="store_true")
    args = p.parse_args()
    for name in filter(None, args.preload.split(",")):
        __import__(name)
    # A root worker (inside its namespaces) keeps the right to drop each call to the code's user and to kill it;
    # a non-root one runs the code as itself.
    code_uid = args.code_uid if os.getuid() == 0 else None
    worker = Worker(code_uid, args.own_pid_namespace)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints of an import must not corrupt the protocol
    write_message(stdout, {"ready": True, "preloaded": args.preload})
    while (request := read_message(stdin)) is not None:
        write_message(stdout, worker.call(request))
    if not args.own_pid_namespace:  # the private directory outside a sandbox is this worker's to remove
        import shutil

        shutil.rmtree(worker.tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
