"""Fault injection into real runs: a callback that marks each finished training step in a directory, and the
processes of a run (its launched `vllm serve` replicas and its trainer ranks, found under the CLI's process in
/proc) to kill or freeze.

The injector signals only processes it found under the run it started, never every process, and whatever it
froze is thawed (SIGCONT) and killed by `cleanup`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from lightning.pytorch.callbacks import Callback

SERVER_ENTRY = "vllm.entrypoints.launchers.api_server.entry"


class StepMarker(Callback):
    """Writes `<out>/step-<n>` when training step n (1-based) has finished."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / f"step-{trainer.global_step}").touch()


def marker_config(path: Path, out: Path) -> Path:
    """A config file adding `StepMarker(out)` to the trainer's callbacks."""
    path.write_text(
        f"trainer:\n  callbacks+:\n    - class_path: tests.support.faults.StepMarker\n      init_args: {{out: {out}}}\n"
    )
    return path


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (out / f"step-{step}").exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before step {step}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no step {step} within {timeout:.0f} s")
        time.sleep(0.2)


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def replica_groups(trainer_pid: int) -> list[int]:
    """The process groups of the `vllm serve` replicas the trainer launched (each leads its own group)."""
    return sorted({os.getpgid(p) for p in descendants(trainer_pid) if SERVER_ENTRY in cmdline(p) and _alive(p)})


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def rank_processes(trainer_pid: int) -> list[int]:
    """The trainer's other ranks: the processes Lightning launched under rank 0 running the same CLI."""
    return [p for p in descendants(trainer_pid) if "-m rlvr_lightning" in cmdline(p) and _alive(p)]


class RunFaults:
    """Signals to the replicas (their process groups) or the ranks of one run; `cleanup` thaws and kills
    whatever of theirs was frozen."""

    def __init__(self, trainer_pid: int) -> None:
        self.trainer_pid = trainer_pid
        self.frozen_groups: set[int] = set()
        self.frozen_pids: set[int] = set()

    def kill_replica(self) -> None:
        os.killpg(replica_groups(self.trainer_pid)[0], signal.SIGKILL)

    def freeze_replica(self) -> None:
        group = replica_groups(self.trainer_pid)[0]
        self.frozen_groups.add(group)
        os.killpg(group, signal.SIGSTOP)

    def freeze_replica_then_stop(self) -> None:
        """The replica frozen, then, once the step waits on it, SIGTERM to the trainer (a preemption mid-wait)."""
        self.freeze_replica()
        time.sleep(3)
        os.kill(self.trainer_pid, signal.SIGTERM)

    def kill_rank(self) -> None:
        os.kill(rank_processes(self.trainer_pid)[0], signal.SIGKILL)

    def freeze_rank(self) -> None:
        pid = rank_processes(self.trainer_pid)[0]
        self.frozen_pids.add(pid)
        os.kill(pid, signal.SIGSTOP)

    def cleanup(self) -> None:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            for group in self.frozen_groups:
                try:
                    os.killpg(group, sig)
                except ProcessLookupError:
                    pass
            for pid in self.frozen_pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass


@dataclass
class FaultedRun:
    """A CLI run with faults injected after given steps: its exit code, its output, and for each fault the
    seconds from the fault to the next finished step (None: none finished), and from the last fault to the
    run's end."""

    returncode: int
    output: str
    recovery_s: list[float | None] = field(default_factory=list)
    ended_s: float = 0.0
    left_running: list[int] = field(default_factory=list)  # processes it froze still there when the run ended


def run_with_faults(
    args: list[str], run_dir: Path, faults: list[tuple[int, str]], timeout: float = 900
) -> FaultedRun:
    """Start the CLI in `run_dir` with a `StepMarker`; after step s of each (s, action), do `action` (a method of
    `RunFaults`: `kill_replica`, `freeze_rank`, …); wait for the run to end. Whatever was frozen is killed."""
    from tests.support.cli import REPO

    marks = run_dir / "steps"
    args = [*args, "--config", str(marker_config(run_dir / "marker.yaml", marks))]
    args = [str(REPO / a) if a.startswith("configs/") else a for a in args]
    if not any(a.startswith("--plan.") for a in args):
        args.append("--plan.check=false")
    env = {**os.environ, "RLVR_CACHE_DIR": str(run_dir / "cache"), "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    env.pop("VLLM_LOGGING_LEVEL", None)
    log_path = run_dir / "run.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlvr_lightning", *args], cwd=run_dir, env=env, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
    injector, recovery = RunFaults(proc.pid), []
    try:
        deadline = time.monotonic() + timeout
        for step, action in faults:
            wait_for_step(marks, step, proc, deadline - time.monotonic())
            getattr(injector, action)()
            struck = time.monotonic()
            try:
                wait_for_step(marks, step + 1, proc, deadline - time.monotonic())
                recovery.append(time.monotonic() - struck)
            except AssertionError:
                recovery.append(None)
                break
        returncode = proc.wait(timeout=max(deadline - time.monotonic(), 1))
        ended = time.monotonic() - struck if faults else 0.0
        settle = time.monotonic() + 60  # what the run's sentinels kill as it ends
        while (left := [p for p in injector.frozen_pids if running(p)]) and time.monotonic() < settle:
            time.sleep(0.5)
    finally:
        injector.cleanup()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return FaultedRun(returncode, log_path.read_text(errors="replace"), recovery, ended, left)
