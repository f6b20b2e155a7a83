"""`world.start_call` makes a call's process pid 1 of new PID, mount and IPC namespaces, by a raw clone(2) where
its calling convention is known and by fork, unshare and fork elsewhere (the relay): both report the call's
own end as its wait status, and killing the pid the worker holds ends the call with everything it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.unprivileged import REPOSITORY

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="new PID and mount namespaces need root outside a sandbox")

PROBE = """
import json, os, signal, sys, time
sys.path.insert(0, "rlvr_lightning/sandbox")
import world
if sys.argv[1] == "relay":
    world.SYS_CLONE = {}  # an architecture whose clone(2) the module does not know
def call(exit_code, w):
    os.write(w, f"{os.getpid()} {os.getppid()}".encode())
    if exit_code is None:  # a process of its own that would outlive it, then wait to be killed
        if os.fork() == 0:
            time.sleep(60)
        time.sleep(60)
    os._exit(exit_code)
def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""
mine = cmdline("self")  # the call's processes are forks of this one, with its command line
out = {}
for name, exit_code in (("ends", 3), ("killed", None)):
    r, w = os.pipe()
    pid = world.start_call(lambda: call(exit_code, w))
    os.close(w)
    seen = os.read(r, 64).decode()
    if exit_code is None:
        time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
    status = os.waitpid(pid, 0)[1]
    time.sleep(0.2)
    left = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid() and cmdline(p) == mine]
    out[name] = {"seen": seen, "status": os.waitstatus_to_exitcode(status), "children_left": left}
print(json.dumps(out))
"""


@pytest.mark.parametrize("path", ["clone", "relay"])
def test_a_call_is_pid_1_of_its_own_namespaces_and_ends_with_everything_it_started(path):
    proc = subprocess.run([sys.executable, "-c", PROBE, path], cwd=REPOSITORY, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["ends"]["seen"] == "1 0" and out["ends"]["status"] == 3, out  # pid 1, its parent outside
    assert out["killed"]["seen"] == "1 0" and out["killed"]["status"] == -9, out
    assert out["killed"]["children_left"] == [] and out["ends"]["children_left"] == [], out
