"""A call's memory is bounded as a whole: its processes, detached System V shared memory, a memfd and a file in
/dev/shm together cannot hold more than `memory_mb`, though each alone stays under it. Where a call cgroup can
be made (root, cgroup v1 here) the kernel holds the total and the call's peak is read from it; where none can,
each process is held to `memory_mb` of address space (the test says which mode it ran in)."""

from __future__ import annotations

import shutil
import textwrap

import pytest

from rlvr_lightning.sandbox import Sandbox, SandboxSettings
from rlvr_lightning.sandbox.cgroups import CallCgroup, make_call_cgroup

MEMORY_MB = 192

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")

# Four processes of 64 MiB each, 48 MiB of detached shared memory, 48 MiB in a memfd and 48 MiB in /dev/shm:
# 400 MiB in all, each piece well under MEMORY_MB.
HOLD_TOGETHER = textwrap.dedent("""
    import ctypes, os, time
    MiB = 1 << 20
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    def touch(n):
        block = bytearray(n * MiB)
        for offset in range(0, len(block), 4096):
            block[offset] = 1
        return block
    ready = []
    for _ in range(4):
        r, w = os.pipe()
        if os.fork() == 0:
            held = touch(64)
            os.write(w, b"held")
            time.sleep(60)
        ready.append(r)
    shm = libc.shmget(0, 48 * MiB, 0o1000 | 0o600)
    address = libc.shmat(shm, None, 0)
    ctypes.memset(address, 1, 48 * MiB)
    libc.shmdt(ctypes.c_void_p(address))
    memfd = os.memfd_create("held")
    for _ in range(48):
        os.write(memfd, b"x" * MiB)
    with open("/dev/shm/held", "wb") as f:
        for _ in range(48):
            f.write(b"x" * MiB)
    print("held", sum(os.read(r, 4) == b"held" for r in ready), flush=True)
    time.sleep(60)
""")


def test_a_calls_processes_shared_memory_and_files_together_stay_within_memory_mb():
    cgroup = make_call_cgroup(MEMORY_MB, 64)
    per_call = isinstance(cgroup, CallCgroup)
    if per_call:
        cgroup.remove()
    settings = SandboxSettings(workers=1, timeout_s=4.0, memory_mb=MEMORY_MB, file_mb=64, tmp_mb=64, processes=64)
    with Sandbox(settings) as box:
        assert box.memory_bound.startswith("per call" if per_call else "per process only"), box.memory_bound
        workers = [w.proc.pid for w in box._all]
        result = box.run(HOLD_TOGETHER)
        after = box.run("print(1)")
        kept = [w.proc.pid for w in box._all] == workers  # the kernel stopped the call, not its worker
    mode = "per call (cgroup)" if per_call else "per process (address space)"
    print(f"memory bound: {mode}; the call: {result.status}, peak {result.memory_peak_mb} MiB")
    if per_call:
        assert result.memory_peak_mb is not None and result.memory_peak_mb <= MEMORY_MB, (mode, result)
        assert result.memory_peak_mb > MEMORY_MB / 2, (mode, result)  # it did push up to the limit
        assert "MemoryError: the call's processes together reached" in result.stderr, (mode, result)  # stopped
    else:  # each piece fits under its own process's limit: only the per-process bound holds
        assert result.memory_peak_mb is None, (mode, result)
    assert after.status == "ok" and after.stdout == "1\n"
    assert kept and result.status != "crashed", (mode, result)


def test_one_process_over_memory_mb_gets_a_memory_error():
    with Sandbox(SandboxSettings(workers=1, timeout_s=4.0, memory_mb=MEMORY_MB)) as box:
        result = box.run(f"x = bytearray({MEMORY_MB + 64} * 2**20)\nprint(len(x))")
    assert result.status == "error" and "MemoryError" in result.stderr, result


def test_a_call_that_holds_its_memory_in_files_is_stopped_and_its_worker_kept():
    """Files in /dev/shm belong to no process: at the limit the kernel must stop a process of the call, not the
    worker, which its warm pages make the cgroup's largest (the call's processes raise their OOM score)."""
    fill = textwrap.dedent("""
        import time
        for i in range(10):
            with open(f"/dev/shm/f{i}", "wb") as f:
                for _ in range(32):
                    f.write(b"x" * (1 << 20))
        time.sleep(30)
    """)
    settings = SandboxSettings(workers=1, timeout_s=4.0, memory_mb=MEMORY_MB, file_mb=64, tmp_mb=512)
    with Sandbox(settings) as box:
        if not box.memory_bound.startswith("per call"):
            pytest.skip(f"no call cgroup here: {box.memory_bound}")
        workers = [w.proc.pid for w in box._all]
        result = box.run(fill)
        assert [w.proc.pid for w in box._all] == workers, result  # the worker was not the one stopped
    assert result.status == "error" and "MemoryError: the call's processes together reached" in result.stderr, result
    assert result.memory_peak_mb <= MEMORY_MB, result
