"""Hostile model-written programs in the sandbox: each is contained, nothing outside the sandbox changes, and
the sandbox goes on serving calls. No program here signals every process: one that tries to reach an outside
process is given that process's pid (a canary this test starts and kills)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import textwrap
import threading
import time

import pytest

from rlvr_lightning.sandbox import Sandbox, SandboxSettings
from rlvr_lightning.sandbox.isolation import CODE_UID_BASE, check_isolation

SECRET = "rlvr-secret-7f3a9c"
TIMEOUT_S = 2.0


# Only a machine without bubblewrap skips (`make setup` installs it where it can); a sandbox that bubblewrap
# cannot start here is a failure, not a skip.
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
pytestmark = needs_bwrap


def test_bubblewrap_starts_a_sandbox_here():
    check_isolation(("numpy", "sympy"))


@pytest.fixture(scope="module")
def box():
    os.environ["RLVR_TEST_SECRET_TOKEN"] = SECRET  # the trainer's environment: a call must never see it
    sandbox = Sandbox(SandboxSettings(workers=2, timeout_s=TIMEOUT_S, memory_mb=256, output_bytes=4096, file_mb=4, tmp_mb=16, processes=32))
    yield sandbox
    sandbox.close()
    os.environ.pop("RLVR_TEST_SECRET_TOKEN", None)


def run(box, code: str, timeout_s: float | None = None):
    return box.run(textwrap.dedent(code), timeout_s)


CLEAN_CHECK = """
import os, sys
pids = [p for p in os.listdir('/proc') if p.isdigit()]
prefix = sys.prefix.split('/')[2] if sys.prefix.startswith('/tmp/') else None  # a Python installed under /tmp
print(len(pids), sorted(set(os.listdir('/tmp')) - {prefix}), sorted(os.listdir('.')))
"""


def still_serving(box) -> None:
    """Every worker answers a plain call after the hostile one, with nothing left of it: only this call runs
    (its namespace's init), and /tmp is empty."""
    for result in box.run_many([CLEAN_CHECK] * 2):
        assert result.status == "ok", result
        assert result.stdout.strip() == "1 [] []", result.stdout


def test_a_plain_call_prints_its_output_or_its_last_value(box):
    assert run(box, "print(6 * 7)").stdout == "42\n"
    assert run(box, "x = 6\nx * 7").stdout == "42\n"
    assert run(box, "import sympy\nsympy.factorint(360)").stdout == "{2: 3, 3: 2, 5: 1}\n"
    error = run(box, "1 / 0")
    assert error.status == "error" and error.stderr.strip().splitlines()[-1] == "ZeroDivisionError: division by zero"
    assert "worker.py" not in error.stderr  # only the code's own frames


def test_network_is_unreachable_even_the_hosts_loopback(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = f"""
    import socket
    for address in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)]:
        s = socket.socket()
        s.settimeout(1)
        try:
            s.connect(address)
            print("connected", address)
        except OSError as e:
            print("refused", type(e).__name__)
    try:
        socket.getaddrinfo("pypi.org", 443)
        print("resolved")
    except OSError:
        print("no dns")
    """
    result = run(box, code)
    with pytest.raises(socket.timeout):
        server.accept()  # nothing reached the host's listener
    server.close()
    assert "connected" not in result.stdout and "resolved" not in result.stdout and "no dns" in result.stdout
    still_serving(box)


@pytest.fixture
def secret_in_home():
    """A secret in the user's home (not under /tmp, which the sandbox's own /tmp would hide anyway)."""
    import pathlib

    folder = pathlib.Path.home() / ".cache" / f"rlvr-sandbox-test-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "secret.txt"
    path.write_text(SECRET)
    path.chmod(0o600)
    yield path
    shutil.rmtree(folder)


def test_secrets_the_trainers_files_and_environment_are_out_of_sight(box, secret_in_home):
    secret_file = secret_in_home
    repo_file = os.path.abspath(__file__)
    code = f"""
    import os
    for path in [{str(secret_file)!r}, {repo_file!r}, "/etc/shadow", "/etc/passwd", "/root/.bashrc",
                 "/proc/1/environ", "/proc/self/environ"]:
        try:
            print(path, open(path, "rb").read()[:2000])
        except OSError as e:
            print(path, type(e).__name__)
    print(dict(os.environ))
    print(sorted(os.listdir("/")))
    """
    result = run(box, code)
    assert result.status == "ok", result
    assert SECRET not in result.stdout and "RLVR_TEST_SECRET_TOKEN" not in result.stdout
    assert f"{repo_file} FileNotFoundError" in result.stdout and f"{secret_file} FileNotFoundError" in result.stdout
    assert "/etc/shadow FileNotFoundError" in result.stdout  # /etc is not there at all
    still_serving(box)


def test_nothing_outside_the_sandbox_can_be_written(box, tmp_path):
    before = sorted(p.name for p in tmp_path.iterdir())
    target = tmp_path / "planted.txt"
    code = f"""
    import os
    for path in [{str(target)!r}, "/usr/planted", "/root/planted", "/planted", "/dev/planted",
                 "/proc/sys/kernel/hostname"]:
        try:
            with open(path, "w") as f:
                f.write("x")
            print("wrote", path)
        except OSError as e:
            print("denied", path, type(e).__name__)
    """
    result = run(box, code)
    assert "wrote" not in result.stdout, result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not target.exists()
    still_serving(box)


def test_a_fork_bomb_is_stopped_and_killed(box):
    start = time.monotonic()
    result = run(box, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert result.status == "timeout" and time.monotonic() - start < TIMEOUT_S + 5
    still_serving(box)


def test_a_memory_bomb_fails_inside_the_call(box):
    result = run(box, "x = bytearray(8 * 1024 ** 3)\nprint(len(x))")
    assert result.status == "error" and "MemoryError" in result.stderr
    result = run(box, "chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 1024 ** 2))")
    assert result.status == "error" and "MemoryError" in result.stderr
    still_serving(box)


def test_an_infinite_loop_and_a_long_sleep_end_at_the_time_limit(box):
    for code in ("while True:\n    pass", "import time\ntime.sleep(3600)"):
        start = time.monotonic()
        result = run(box, code, timeout_s=0.5)
        assert result.status == "timeout", result
        assert time.monotonic() - start < 3.0
    still_serving(box)


def test_an_output_flood_is_cut_while_it_is_read(box):
    start = time.monotonic()
    result = run(box, "while True:\n    print('x' * 1000)")
    assert result.status == "output_limit" and len(result.stdout) + len(result.stderr) <= 4096
    assert time.monotonic() - start < TIMEOUT_S  # stopped at the cap, not at the time limit
    still_serving(box)


def test_a_disk_flood_is_bounded_and_its_files_are_gone_after_the_call(box):
    code = """
    import os
    written = 0
    try:
        for i in range(1000):
            with open(f"/tmp/flood{i}", "wb") as f:
                for _ in range(64):
                    f.write(b"x" * 65536)
                    written += 65536
    except OSError as e:
        print(type(e).__name__, written // 2**20)
    """
    result = run(box, code)
    assert result.status in ("ok", "error"), result
    mib = int(result.stdout.split()[-1]) if result.stdout else 10**9
    assert mib <= 16  # the private /tmp's size
    still_serving(box)


def test_the_worker_is_out_of_the_calls_reach(box):
    """The call sees no process of the worker's: its parent is outside its PID namespace (pid 0), and what it
    signals (its process group, every pid it can see) is its own."""
    code = """
    import os, signal
    print("parent", os.getppid(), "visible", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
    for pid in {os.getppid(), 0, *(int(p) for p in os.listdir("/proc") if p.isdigit())}:
        for sig in (signal.SIGTERM, signal.SIGSTOP, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    print("still here")
    """
    pids = sorted(w.proc.pid for w in box._all)
    result = run(box, code)
    assert result.status == "ok" and "parent 0 visible [1]" in result.stdout, result
    assert sorted(w.proc.pid for w in box._all) == pids  # no worker was lost or replaced
    still_serving(box)


def test_outside_processes_cannot_be_signalled_or_seen(box):
    canary = subprocess.Popen(["sleep", "600"])
    try:
        code = f"""
        import os, signal
        try:
            os.kill({canary.pid}, signal.SIGKILL)
            print("signalled")
        except OSError as e:
            print("denied", type(e).__name__)
        print("canary visible", os.path.exists("/proc/{canary.pid}"), "trainer visible", os.path.exists("/proc/{os.getpid()}"))
        print("processes", len([p for p in os.listdir("/proc") if p.isdigit()]))
        """
        result = run(box, code)
        time.sleep(0.2)
        assert canary.poll() is None, "the canary was killed from inside the sandbox"
        assert "signalled" not in result.stdout
        if canary.pid > 1 and os.getpid() > 1:  # pids the call's own could not also have
            assert "canary visible False trainer visible False" in result.stdout
        assert "processes 1" in result.stdout  # itself, its namespace's init
    finally:
        canary.kill()
        canary.wait()


def test_processes_that_try_to_outlive_the_call_are_killed(box):
    code = """
    import os, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            for _ in range(100):
                with open("/tmp/still-here", "w") as f:
                    f.write(str(time.time()))
                time.sleep(0.05)
        os._exit(0)
    print("parent done")
    """
    result = run(box, code)
    assert result.status == "ok" and "parent done" in result.stdout
    time.sleep(0.3)
    still_serving(box)  # no daemon in /proc, nothing in /tmp


def test_privileges_cannot_be_regained(box):
    code = """
    import os, subprocess
    print("uid", os.getuid(), os.geteuid())
    for attempt in (lambda: os.setuid(0), lambda: os.setgid(0), lambda: os.chroot("/")):
        try:
            attempt()
            print("gained")
        except OSError as e:
            print("denied", type(e).__name__)
    for cmd in (["mount", "-t", "tmpfs", "none", "/usr"], ["su", "-c", "id"], ["chown", "0", "/tmp"]):
        try:
            out = subprocess.run(cmd, capture_output=True, timeout=1)
            print(cmd[0], out.returncode)
        except (OSError, subprocess.SubprocessError) as e:
            print(cmd[0], type(e).__name__)
    """
    result = run(box, code)
    assert "gained" not in result.stdout, result.stdout
    if os.getuid() == 0:  # as root the code runs as a user of its worker's own, which no account has
        (uid_line,) = [line.split() for line in result.stdout.splitlines() if line.startswith("uid ")]
        assert uid_line[1] == uid_line[2] and int(uid_line[1]) >= CODE_UID_BASE, uid_line
    for line in result.stdout.splitlines():
        if line.split()[0] in ("mount", "su", "chown"):
            assert line.split()[1] != "0", line  # none succeeded
    still_serving(box)


def test_devices_and_kernel_interfaces_are_not_there(box):
    code = """
    import os
    print(sorted(os.listdir("/dev")))
    for path in ("/dev/mem", "/dev/sda", "/dev/kmsg", "/sys/kernel", "/proc/kcore"):
        try:
            open(path, "rb").read(16)
            print("read", path)
        except OSError as e:
            print("denied", path, type(e).__name__)
    """
    result = run(box, code)
    assert "read " not in result.stdout, result.stdout
    still_serving(box)


def test_many_threads_and_processes_spinning_end_at_the_time_limit(box):
    code = """
    import os, threading
    def spin():
        while True:
            pass
    for _ in range(8):
        try:  # threads count against the process limit too: whichever hits it first is refused
            if os.fork() == 0:
                spin()
            threading.Thread(target=spin, daemon=True).start()
        except (OSError, RuntimeError):
            pass
    spin()
    """
    start = time.monotonic()
    result = run(box, code, timeout_s=1.0)
    assert result.status == "timeout" and time.monotonic() - start < 5
    still_serving(box)


def test_one_calls_processes_leave_another_calls_process_limit_alone(box):
    """A call that holds every process it may have (the limit counts a user's processes) must not make a
    neighbour's forks fail: each worker's calls run as a user of their own."""
    hog = """
    import os, time
    for _ in range(100):
        try:
            if os.fork() == 0:
                time.sleep(4)
                os._exit(0)
        except OSError:
            break
    print('holding')
    time.sleep(4)
    """
    neighbour = """
    import os, time
    time.sleep(1.0)  # the hog holds its processes by now
    children = []
    for _ in range(8):
        pid = os.fork()
        if pid == 0:
            time.sleep(0.05)
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    print('fine')
    """
    results = box.run_many([textwrap.dedent(hog), textwrap.dedent(neighbour)], timeout_s=5.0)
    assert "holding" in results[0].stdout, results[0]
    assert results[1].status == "ok" and results[1].stdout == "fine\n", results[1]
    still_serving(box)


def test_calls_run_side_by_side_and_a_slow_one_holds_only_its_worker(box):
    start = time.monotonic()
    results = box.run_many(["import time\ntime.sleep(1.5)", "print(1)", "print(2)", "print(3)"])
    assert [r.status for r in results] == ["ok"] * 4
    assert results[1].seconds < 1.0 and time.monotonic() - start < 3.0


def test_threads_calling_at_once_each_get_their_own_answer(box):
    answers: dict[int, str] = {}

    def call(i: int) -> None:
        answers[i] = box.run(f"print({i} * {i})").stdout.strip()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == {i: str(i * i) for i in range(12)}


def test_threads_start_under_a_tight_memory_limit(box):
    """The memory limit counts address space: threads must not spend it on malloc arenas (MALLOC_ARENA_MAX)."""
    code = """
    import threading
    go, results = threading.Event(), []
    def work():
        go.wait()  # every thread alive at once
        results.append(sum(range(10_000)))
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join()
    print(len(results))
    """
    result = run(box, code)
    assert result.status == "ok" and result.stdout == "8\n", result
