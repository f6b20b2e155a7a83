"""One process per run, and one at a time creating a tracking store.

A run's checkpoint directory is locked for the life of the process that trains it (`hold_run_directory`):
a second process on the same run (the same checkpoint resumed twice at once, a requeued job whose first
instance still runs) is refused in one line naming the holder's pid and host, before it logs or writes
anything. The lock is the kernel's (`flock`), so it is released when its holder dies, however it dies: a
killed run leaves nothing to clean up. Only the global rank 0 process takes it (ranks of one run share it).

A new SQLite tracking store is created by MLflow's schema migration, which two processes cannot run at
once (the second dies with "table _alembic_tmp_metrics already exists"); `serialised` makes them take
turns, so concurrent first runs both start.

Written on `fcntl` rather than the `filelock` package: the refusal names the holder, which the lock file
itself records, and `filelock` truncates the lock file on every attempt.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlvr_lightning.errors import ConfigError

LOCK_NAME = "run.lock"
_held: dict[Path, int] = {}  # directory → the open lock file this process holds (a second flock on it would fail)


class RunInUse(ConfigError):
    """Another process trains this run: the message names it."""


def hold_run_directory(directory: str | os.PathLike, what: str = "run") -> None:
    """Lock `directory` (created if missing) for this process's life, or raise RunInUse naming the holder."""
    where = Path(directory).resolve()
    if where in _held:
        return
    where.mkdir(parents=True, exist_ok=True)
    fd = os.open(where / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RunInUse(
            f"{what} {where} is in use by process {holder.get('pid', '?')} on {holder.get('host', '?')} "
            f"(since {holder.get('since', '?')}): one process trains a run at a time; wait for it to end or stop "
            "it (SIGTERM checkpoints it), then resume"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_me()).encode(), 0)
    _held[where] = fd


def release_run_directory(directory: str | os.PathLike | None = None) -> None:
    """Give a run's lock back (every one this process holds, given None) when its run ends before the process
    does: a run called from Python, the next run in the same process."""
    for where in [Path(directory).resolve()] if directory is not None else list(_held):
        fd = _held.pop(where, None)
        if fd is not None:
            os.close(fd)


@contextmanager
def serialised(path: str | os.PathLike) -> Iterator[None]:
    """Hold `<path>.lock` (blocking) while the body runs: one process at a time."""
    lock = Path(f"{path}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _me() -> dict:
    from datetime import datetime, timezone

    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
