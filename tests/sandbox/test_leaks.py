"""Nothing a call does outlives it, in both of the sandbox's modes: as root (each call as a user of its worker's
own) and as an unprivileged user (the sandbox in a user namespace; these tests drop to `nobody` for it). Each
program of tests/support/leaks.py tries to leave something for the next call on its worker; that call must find
what it found before the program ran, and a plain call after it must come back as fast as ever. Inside a call
the code holds no capability and runs under the seccomp filter, which refuses what it lists."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from rlvr_lightning.sandbox.cgroups import CallCgroup, make_call_cgroup
from rlvr_lightning.sandbox.isolation import ROOT_WORKER_CAPABILITIES, WORKER_CAPABILITIES
from rlvr_lightning.sandbox.pool import RETURN_MARGIN_S
from tests.support.leaks import LEAKS, NOTHING, REFUSED_CALLS, trials
from tests.support.unprivileged import run_unprivileged, unavailable_reason

TIMEOUT_S = 2.0
# A plain call takes about 10 ms; one that waited out a leftover process's kill took a second or more.
PLAIN_CALL_S = 0.5
CAPABILITY_BITS = {"CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_KILL": 5, "CAP_SYS_ADMIN": 21}

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


@pytest.fixture(scope="module", params=["root", "user"])
def mode(request):
    """Every program's trial in one mode: this process's own where it is that mode, `nobody` otherwise."""
    as_root = os.getuid() == 0
    if (request.param == "root") == as_root:
        return request.param, trials(TIMEOUT_S)
    if request.param == "root":
        pytest.skip("the tests run as a user: root's mode cannot be tried")
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no unprivileged user to try the user mode with: {reason}")
    proc = run_unprivileged([sys.executable, "-m", "tests.support.leaks", str(TIMEOUT_S)], timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return request.param, json.loads(proc.stdout)


@pytest.mark.parametrize("name", list(LEAKS))
def test_nothing_a_call_leaves_reaches_the_next(mode, name):
    which, results = mode
    trial = results["trials"][name]
    found = {k: v for k, v in trial["found"].items() if k != "root"}
    assert found == NOTHING, (which, trial)
    assert trial["found"] == trial["before"], (which, trial)  # nor anything new in the read-only root
    assert trial["plain"]["status"] == "ok" and trial["plain"]["stdout"] == "1\n", (which, trial)
    assert trial["plain"]["seconds"] < PLAIN_CALL_S, (which, trial)
    assert trial["hostile"]["seconds"] <= TIMEOUT_S + RETURN_MARGIN_S, (which, trial)  # its cleanup included


def test_each_program_did_what_it_tried(mode):
    """The programs really made what the next call looks for (a program that fails early proves nothing)."""
    which, results = mode
    hostile = {name: t["hostile"] for name, t in results["trials"].items()}
    assert hostile["files deeper than the recursion limit, an unreadable directory"]["stdout"] == "planted\n"
    ipc = hostile["System V shared memory, semaphores and message queues, POSIX message queues"]
    assert ipc["stdout"] == "planted True True True True\n", (which, ipc)
    thread = hostile["a thread that runs on after its process's main thread exits"]
    assert thread["status"] == "timeout" and thread["stdout"] == "main thread exits\n", (which, thread)
    assert hostile["processes, shared memory and files held until the time limit"]["status"] == "timeout"
    flood = hostile["an inode flood"]
    assert flood["status"] == "timeout" and int(flood["stdout"].split()[1]) > 1000, (which, flood)


def test_keys_are_refused_and_no_answer_can_be_forged(mode):
    which, results = mode
    keys = results["trials"]["kernel keys"]["hostile"]["stdout"]
    assert keys == "keys [(-1, 1), (-1, 1), (-1, 1)] session keyring -1 1\n", (which, keys)  # EPERM, each
    forged = results["trials"]["a forged answer written into every pipe it can reach"]
    assert forged["hostile"]["status"] == "ok" and forged["hostile"]["stdout"] == "wrote []\n", (which, forged)


def test_the_code_holds_no_privilege_and_runs_under_the_filter(mode):
    which, results = mode
    call = results["call"]
    assert call["status"] == {"CapInh": "0" * 16, "CapPrm": "0" * 16, "CapEff": "0" * 16, "CapBnd": "0" * 16,
                              "CapAmb": "0" * 16, "NoNewPrivs": "1", "Seccomp": "2"}, (which, call)  # fmt: skip
    assert call["refused"] == {name: [-1, 1] for name in REFUSED_CALLS}, (which, call["refused"])  # EPERM
    assert call["clone3"] == [-1, 38] and call["fork"] == 7, (which, call)  # ENOSYS: the C library uses clone


def test_the_worker_keeps_only_what_it_uses(mode):
    which, results = mode
    kept = ROOT_WORKER_CAPABILITIES if which == "root" else WORKER_CAPABILITIES
    expected = f"{sum(1 << CAPABILITY_BITS[c] for c in kept):016x}"
    worker = results["worker"]
    assert worker["CapEff"] == worker["CapPrm"] == worker["CapBnd"] == expected, (which, worker)
    assert worker["NoNewPrivs"] == "1", (which, worker)


def test_the_mode_says_which_memory_bound_holds(mode):
    which, results = mode
    if which == "user":  # cgroup v1 directories are root's here
        assert results["memory_bound"].startswith("per process only: 256 MiB of address space each"), results
    else:  # per call wherever a cgroup can be made here
        cgroup = make_call_cgroup(256, 32)
        if isinstance(cgroup, CallCgroup):
            cgroup.remove()
        expected = "per call: a cgroup" if isinstance(cgroup, CallCgroup) else "per process only"
        assert results["memory_bound"].startswith(expected), (results["memory_bound"], cgroup)


PYTHON_UNDER_TMP = """
import json
from rlvr_lightning.sandbox import Sandbox, SandboxSettings
write = "import sys, os\\nfor d in (sys.prefix, os.path.dirname(sys.prefix)):\\n    try:\\n        open(d + '/left', 'w').write('x')\\n        print('wrote', d)\\n    except OSError as e:\\n        print('refused', e.errno)"
look = "import sys, os\\nprint(sys.prefix, any(os.path.exists(d + '/left') for d in (sys.prefix, os.path.dirname(sys.prefix))))"
with Sandbox(SandboxSettings(workers=1)) as box:
    print(json.dumps([box.run(write).stdout, box.run(look).stdout]))
"""


@pytest.mark.parametrize("which", ["root", "user"])
def test_a_python_installed_under_tmp_stays_read_only_to_calls(which):
    """Where the interpreter lives under /tmp (a CI checkout, say), bubblewrap makes the directories above it in
    the worker's own /tmp (the user's own, in a user namespace) and each call's /tmp binds them back in:
    read-only, so that nothing a call writes there reaches the next call."""
    import subprocess
    import tempfile
    from pathlib import Path

    from tests.support.unprivileged import REPOSITORY

    if which == "root" and os.getuid() != 0:
        pytest.skip("the tests run as a user: root's mode cannot be tried")
    if which == "user" and os.getuid() == 0 and (reason := unavailable_reason()) is not None:
        pytest.skip(f"no unprivileged user to try the user mode with: {reason}")
    top = Path(tempfile.mkdtemp(prefix="rlvr-venv-", dir="/tmp"))
    top.chmod(0o755)
    venv = top / "nested" / "venv"  # its parents are the directories bubblewrap makes
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        (site,) = venv.glob("lib/python*/site-packages")
        outer = [os.path.realpath(p) for p in sys.path if p.endswith("site-packages")]  # where numpy and sympy are
        (site / "outer.pth").write_text("\n".join(outer) + "\n")
        argv = [str(venv / "bin" / "python"), "-c", PYTHON_UNDER_TMP]
        if which == "user" and os.getuid() == 0:
            proc = run_unprivileged(argv, timeout_s=120)
        else:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
        assert proc.returncode == 0, proc.stderr[-2000:]
        wrote, seen = json.loads(proc.stdout.strip().splitlines()[-1])
        assert "wrote" not in wrote and wrote.count("refused") == 2, (which, wrote)
        assert seen == f"{venv} False\n", (which, seen)  # it ran from under /tmp, and nothing was left
    finally:
        shutil.rmtree(top)
