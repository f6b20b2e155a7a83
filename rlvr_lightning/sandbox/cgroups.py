"""A call's memory and processes bounded as a whole: one cgroup per sandbox worker, which the worker joins once
warm (its preloaded pages stay charged where they were) and every call is born in, so everything the call
holds (its processes' memory, shared memory, memfds, its /tmp and /dev/shm) counts against `memory_mb`, and
its processes and threads against `processes`. The worker's own allocations since it joined (its messages,
1-2 MiB) count within `memory_mb`. Joining per call instead would cost each call an RCU grace period (the
kernel's cgroup move waits for one: 30-100 ms measured here on a busy machine).

cgroup v1's memory and pids controllers, where this process may make a cgroup beside its own (as root on a
machine that mounts them, as this one does; the v2 hierarchy there is mounted without controllers). Where no
cgroup can be made, each process is still held to `memory_mb` of address space and the code's user to
`processes` processes: up to `processes × memory_mb` in all (`memory_bound` says which holds).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass

CONTROLLERS = ("memory", "pids")  # memory first: the worker reads its peak and out-of-memory kills there
PREFIX = "rlvr-sandbox-"
_names = itertools.count()


def _mount_points() -> dict[str, tuple[str, str]]:
    """{controller: (the hierarchy's mount point, the root it mounts)} of the cgroup v1 hierarchies."""
    found = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, tail = left.split(), right.split()
                if len(tail) < 3 or tail[0] != "cgroup":
                    continue
                for controller in CONTROLLERS:
                    if controller in tail[2].split(","):
                        found[controller] = (fields[4], fields[3])
    except OSError:
        pass
    return found


def _own_paths() -> dict[str, str]:
    """{controller: this process's cgroup path} in the v1 hierarchies."""
    paths = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for controller in controllers.split(","):
                    paths[controller] = path
    except OSError:
        pass
    return paths


def _parent_directories() -> dict[str, str] | str:
    """{controller: the directory to make call cgroups in}, or why there is none."""
    mounts, own = _mount_points(), _own_paths()
    missing = [c for c in CONTROLLERS if c not in mounts or c not in own]
    if missing:
        return f"no cgroup v1 {' and '.join(missing)} controller mounted"
    parents = {}
    for controller in CONTROLLERS:
        mount_point, root = mounts[controller]
        path = own[controller]
        relative = path[len(root) :] if root != "/" and path.startswith(root) else path
        directory = os.path.join(mount_point, relative.lstrip("/"))
        if not os.access(directory, os.W_OK):
            return f"{directory} is not writable by this user"
        parents[controller] = directory
    return parents


@dataclass
class CallCgroup:
    """One worker's call cgroup: {controller: directory}."""

    directories: dict[str, str]

    def processes(self) -> list[int]:
        pids: set[int] = set()
        for directory in self.directories.values():
            try:
                with open(os.path.join(directory, "cgroup.procs")) as f:
                    pids |= {int(p) for p in f.read().split()}
            except OSError:
                pass
        return sorted(pids)

    def remove(self) -> None:
        """Kill what is left in it (nothing, after a clean call) and remove it."""
        deadline = time.monotonic() + 5.0
        while (pids := self.processes()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        for directory in self.directories.values():
            try:
                os.rmdir(directory)
            except OSError:
                pass  # still busy: its owner's pid in the name lets a later sandbox remove it (`_remove_stale`)


def make_call_cgroup(memory_mb: int, processes: int) -> CallCgroup | str:
    """A new call cgroup holding a call to `memory_mb` (swap included where it is counted) and `processes`
    tasks, or why none could be made."""
    parents = _parent_directories()
    if isinstance(parents, str):
        return parents
    name = f"{PREFIX}{os.getpid()}-{next(_names)}"
    made: dict[str, str] = {}
    try:
        for controller, parent in parents.items():
            _remove_stale(parent)
            made[controller] = os.path.join(parent, name)
            os.mkdir(made[controller])
        memory, limit = made["memory"], str(memory_mb << 20)
        _write(memory, "memory.limit_in_bytes", limit)
        if os.path.exists(os.path.join(memory, "memory.memsw.limit_in_bytes")):
            _write(memory, "memory.memsw.limit_in_bytes", limit)  # swap counted: no way round the limit
        try:
            _write(memory, "memory.swappiness", "0")  # nor through swap where it is not counted
        except OSError:
            pass  # a kernel without per-cgroup swappiness: swap, where there is any, is the margin
        _write(made["pids"], "pids.max", str(processes + 1))  # the worker is there too
    except OSError as e:
        CallCgroup(made).remove()
        return f"a cgroup could not be made ({e})"
    return CallCgroup(made)


def _write(directory: str, name: str, value: str) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(value)


def _remove_stale(parent: str) -> None:
    """Remove the empty call cgroups of sandboxes whose process is gone (a trainer that was killed)."""
    for entry in os.listdir(parent):
        if not entry.startswith(PREFIX):
            continue
        owner = entry[len(PREFIX) :].split("-")[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            try:
                os.rmdir(os.path.join(parent, entry))
            except OSError:
                pass


def memory_bound(memory_mb: int, processes: int, cgroup: CallCgroup | str | None = None) -> str:
    """Which bound holds a call's memory, in one line (`make doctor`, the sandbox's start): the cgroup made, or
    the reason none could be (`cgroup`: what `make_call_cgroup` gave; None: try one now)."""
    if cgroup is None:
        cgroup = make_call_cgroup(memory_mb, processes)
        if isinstance(cgroup, CallCgroup):
            cgroup.remove()
    if isinstance(cgroup, str):
        return (f"per process only: {memory_mb} MiB of address space each and {processes} processes, so up to "
                f"{processes * memory_mb} MiB a call ({cgroup})")  # fmt: skip
    return f"per call: a cgroup holds its processes, shared memory and files to {memory_mb} MiB and {processes} tasks"
