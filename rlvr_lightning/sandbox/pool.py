"""The sandbox's host side: a pool of pre-warmed workers (`worker.py`), each running one call at a time, so a
batch's calls run side by side and a slow one holds only its own worker. A worker that dies, stops answering,
answers what a worker never would, or reports that something of the call was left, is replaced; the call it
was running is reported as `crashed`, never retried.
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from rlvr_lightning.errors import ConfigError, check_choice
from rlvr_lightning.sandbox.cgroups import CallCgroup, make_call_cgroup, memory_bound
from rlvr_lightning.sandbox.isolation import (
    ENVIRONMENT,
    SandboxUnavailable,
    bwrap_command,
    check_isolation,
    code_uid,
    unisolated_command,
)
from rlvr_lightning.sandbox.seccomp_filter import seccomp_program
from rlvr_lightning.sandbox.worker import read_message, write_message

Status = Literal["ok", "error", "timeout", "output_limit", "crashed"]
STATUSES = ("ok", "error", "timeout", "output_limit")  # what a worker may answer; `crashed` is the host's
# A call's answer is at most its output (each byte at worst a 12-character JSON escape) and a few fields.
ANSWER_OVERHEAD_BYTES = 4096
# How long past `timeout_s` a call may take to come back, its kill and cleanup included (docs/sandbox.md).
RETURN_MARGIN_S = 1.0


@dataclass(frozen=True)
class SandboxSettings:
    """How model-written code runs (`docs/sandbox.md`).

    isolation: `bwrap` (bubblewrap namespaces; refused with a one-line error where the machine has none) or
        `none` (a plain process of this user: only for code you trust).
    workers: pre-warmed workers, i.e. calls that run at once.
    timeout_s: a call's wall-clock limit (its CPU time is limited to the same); then every process it started
        is killed.
    memory_mb: what a call's processes may hold together beyond the warm interpreter: its memory, shared
        memory and files in /tmp and /dev/shm, where a cgroup can be made (`memory_bound`); otherwise each
        process's address space.
    output_bytes: stdout and stderr together are read up to this; a call that prints more is stopped.
    file_mb: the largest file a call may write; tmp_mb: its private /tmp in all.
    processes: processes and threads a call may have at once (a fork bomb stops there).
    preload: modules each worker imports once, before any call (a call's own import of them is free).
    """

    isolation: Literal["bwrap", "none"] = "bwrap"
    workers: int = 4
    timeout_s: float = 5.0
    memory_mb: int = 1024
    output_bytes: int = 65536
    file_mb: int = 16
    tmp_mb: int = 64
    processes: int = 64
    preload: tuple[str, ...] = ("numpy", "sympy")

    def check(self) -> None:
        check_choice("sandbox.isolation", self.isolation, ("bwrap", "none"))
        for name in ("workers", "timeout_s", "memory_mb", "output_bytes", "file_mb", "tmp_mb", "processes"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"sandbox.{name}={getattr(self, name)!r} must be > 0")


def memory_line(settings) -> str:
    """Which bound holds a call's memory with these sandbox settings on this machine, in one line (the device
    block of `make train` and `make doctor`)."""
    if settings.isolation != "bwrap":
        return f"per process only: {settings.memory_mb} MiB of address space each (isolation none)"
    return memory_bound(settings.memory_mb, settings.processes)


@dataclass(frozen=True)
class Execution:
    """What one call did: its output as read (capped), how it ended, its wall time, and the most memory its
    processes held together (where a call cgroup counts it; None elsewhere)."""

    stdout: str
    stderr: str
    status: Status
    exit_code: int | None
    seconds: float
    memory_peak_mb: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


ANSWER_FIELDS = {"stdout": str, "stderr": str, "status": str, "seconds": (int, float), "clean": bool, "left": str}


def _is(value: object, kind) -> bool:
    """isinstance, where a bool is neither an int nor a float (JSON's `true` is not a number)."""
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def valid_answer(answer: object, output_bytes: int) -> bool:
    """Whether `answer` is what a worker answers: each field there, of its type, a status a worker gives, and
    the output within its cap (decoding replaces a bad byte with 3 bytes at most)."""
    return (
        isinstance(answer, dict)
        and all(_is(answer.get(name), kind) for name, kind in ANSWER_FIELDS.items())
        and (answer.get("exit_code") is None or _is(answer["exit_code"], int))
        and answer["status"] in STATUSES
        and len(answer["stdout"].encode()) + len(answer["stderr"].encode()) <= 3 * output_bytes
    )


class _Worker:
    def __init__(self, command: list[str], cgroup: CallCgroup | None = None, max_answer_bytes: int = 1 << 20) -> None:
        self.cgroup, self.max_answer_bytes = cgroup, max_answer_bytes
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=dict(ENVIRONMENT)
        )
        try:
            hello = read_message(self.proc.stdout, ANSWER_OVERHEAD_BYTES)
        except ValueError:
            hello = None
        if not hello or not hello.get("ready"):
            self.close()
            raise ConfigError(f"a sandbox worker did not start (exit code {self.proc.poll()}): {' '.join(command[:3])} …")
        self.privileges: dict = hello.get("privileges", {})

    def call(self, request: dict, wait_s: float) -> dict | None:
        """The worker's answer, or None when it died, did not answer within `wait_s`, or answered too much."""
        answer: list[dict | None] = [None]

        def exchange() -> None:
            try:
                write_message(self.proc.stdin, request)
                answer[0] = read_message(self.proc.stdout, self.max_answer_bytes)
            except (BrokenPipeError, OSError, ValueError):  # a JSON error is a ValueError too
                answer[0] = None

        thread = threading.Thread(target=exchange, daemon=True)
        thread.start()
        thread.join(wait_s)
        if thread.is_alive():  # the worker hangs: killing its sandbox ends the exchange
            self.close(wait_s=0)
            thread.join()
            return None
        return answer[0]

    def close(self, wait_s: float = 2.0) -> None:
        """End the worker: at the end of its input it stops (and removes its files); one that does not within
        `wait_s` is killed, and bubblewrap's namespace with it: every process of its calls."""
        try:
            self.proc.stdin.close()
            self.proc.wait(wait_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdout,):
            try:
                stream.close()
            except OSError:
                pass
        if self.cgroup is not None:
            self.cgroup.remove()


class Sandbox:
    """Run model-written Python, isolated. Thread-safe; `run_many` runs a batch on every worker at once.

        with Sandbox(SandboxSettings(workers=2)) as box:
            box.run("print(2 ** 10)").stdout   # '1024\\n'
    """

    def __init__(self, settings: SandboxSettings = SandboxSettings()) -> None:
        settings.check()
        self.settings = settings
        preload = tuple(settings.preload)
        #: which bound holds a call's memory here (`memory_line`)
        self.memory_bound = memory_line(settings) if settings.isolation != "bwrap" else ""
        if settings.isolation == "bwrap":
            check_isolation(preload)  # fail closed, in one line, before any model code exists
            seccomp = seccomp_program()
            made: list[CallCgroup | str] = []

            def start() -> _Worker:
                cgroup = make_call_cgroup(settings.memory_mb, settings.processes)
                made.append(cgroup)
                held = cgroup if isinstance(cgroup, CallCgroup) else None
                dirs = held.directories if held is not None else None
                return _Worker(bwrap_command(preload, settings.tmp_mb, code_uid(), seccomp, dirs), held, self._max_answer)
        else:

            def start() -> _Worker:
                return _Worker(unisolated_command(preload, code_uid()), None, self._max_answer)

        self._start = start
        self._max_answer = 12 * settings.output_bytes + ANSWER_OVERHEAD_BYTES
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        # Workers are started from threads that live as long as the sandbox: bubblewrap's --die-with-parent
        # follows the thread that started it, and a worker started from a finished thread would die with it.
        self._spawner = ThreadPoolExecutor(settings.workers, thread_name_prefix="sandbox-spawn")
        for worker in [self._spawner.submit(start) for _ in range(settings.workers)]:
            self._add(worker.result())  # warmed side by side
        if settings.isolation == "bwrap":
            self.memory_bound = memory_bound(settings.memory_mb, settings.processes, made[0])
        first = self.run("print(1)")
        if first.stdout != "1\n":  # fail closed: a machine that cannot make a call's world
            self.close()
            raise SandboxUnavailable(f"the sandbox could not run a call here: {first.stderr.strip()[-300:]}")

    def _add(self, worker: _Worker) -> None:
        with self._lock:
            self._all.append(worker)
        self._idle.put(worker)

    def _replace(self, worker: _Worker) -> None:
        worker.close()
        with self._lock:
            self._all.remove(worker)
            closed = self._closed
        if not closed:
            self._add(self._spawner.submit(self._start).result())

    def run(self, code: str, timeout_s: float | None = None) -> Execution:
        """Run `code` in a fresh, warm interpreter; never raises for anything the code does."""
        s = self.settings
        timeout = s.timeout_s if timeout_s is None else timeout_s
        request = dict(code=code, timeout_s=timeout, memory_mb=s.memory_mb, output_bytes=s.output_bytes,
                       file_mb=s.file_mb, processes=s.processes)  # fmt: skip
        if self._closed:
            raise RuntimeError("this sandbox is closed")
        start = time.monotonic()
        worker = self._idle.get()
        answer = worker.call(request, wait_s=timeout + 10.0)  # the worker's own kill comes first
        if answer is None or worker.proc.poll() is not None or not valid_answer(answer, s.output_bytes):
            self._replace(worker)
            return Execution("", "the sandbox worker died during the call", "crashed", None, time.monotonic() - start)
        if not answer["clean"]:  # the call's answer stands; the worker it ran on does not serve another
            self._replace(worker)
        else:
            self._idle.put(worker)
        status, stderr = answer["status"], answer["stderr"]
        kills = answer.get("memory_kills")
        if isinstance(kills, int) and kills > 0:  # the kernel stopped a process of the call at the call's limit
            status = "error" if status == "ok" else status
            stderr += f"\nMemoryError: the call's processes together reached the sandbox's {s.memory_mb} MiB\n"
        peak = answer.get("memory_peak_mb")
        peak = float(peak) if isinstance(peak, (int, float)) and not isinstance(peak, bool) else None
        return Execution(answer["stdout"], stderr, status, answer["exit_code"], answer["seconds"], peak)

    def run_many(self, codes: list[str], timeout_s: float | None = None) -> list[Execution]:
        """Run each of `codes`, as many at once as there are workers; results in order."""
        if not codes:
            return []
        with ThreadPoolExecutor(min(len(codes), self.settings.workers)) as pool:
            return list(pool.map(lambda code: self.run(code, timeout_s), codes))

    def worker_privileges(self) -> list[dict]:
        """Each worker's capability sets, no-new-privileges flag and seccomp mode, as its /proc showed them."""
        with self._lock:
            return [dict(w.privileges) for w in self._all]

    def describe(self) -> str:
        """Its workers, busy and idle, for the watchdog's report."""
        with self._lock:
            total = len(self._all)
        idle = self._idle.qsize()
        return f"sandbox: {total} workers, {total - idle} running a call, {self.settings.timeout_s:g} s per call"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._all)
        for worker in workers:
            worker.close()
        self._spawner.shutdown()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
