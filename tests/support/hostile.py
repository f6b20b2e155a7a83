"""The Python tool whose every call runs a hostile program, for a real training run whose answers call it (the
embedded model cannot be made to write such programs, so each call's code is swapped for the next of them): the
run must go on, and nothing outside the sandbox may change. The programs aim at what the test watches: a file it
wrote (`RLVR_HOSTILE_CANARY_FILE`) and a process it started (`RLVR_HOSTILE_CANARY_PID`); none signals every
process, and none would do lasting harm if the sandbox failed. The programs of tests/support/leaks.py, which try
to leave files, IPC objects, kernel keys or processes for a later call, run among them."""

from __future__ import annotations

import itertools
import os
import textwrap

from rlvr_lightning.environments.python_tool import PythonTool, PythonToolSettings
from rlvr_lightning.sandbox import SandboxSettings
from tests.support.leaks import LEAKS, program


def hostile_programs(canary_file: str, canary_pid: int) -> dict[str, str]:
    programs = {
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "memory bomb": "chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 1024 ** 2))",
        "infinite loop": "while True:\n    pass",
        "output flood": "while True:\n    print('x' * 1000)",
        "disk flood": "with open('/tmp/flood', 'wb') as f:\n    while True:\n        f.write(b'x' * 65536)",
        "overwrite a file outside": f"open({canary_file!r}, 'w').write('overwritten')",
        "kill an outside process": f"import os, signal\nos.kill({canary_pid}, signal.SIGKILL)",
        "kill the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
        "network": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=0.5)",
        "secrets": "import os\nprint(os.environ.get('RLVR_TEST_SECRET_TOKEN'), open('/etc/shadow').read())",
        "other processes": f"import os\nprint(open('/proc/{canary_pid}/cmdline').read())",
        "outlive the call": """
            import os, time
            if os.fork() == 0:
                os.setsid()
                while True:
                    time.sleep(0.05)
            print("parent done")
            """,
    }
    programs = {name: textwrap.dedent(code).strip() for name, code in programs.items()}
    return programs | {name: program(name) for name in LEAKS}  # those that try to leave something for a later call


class HostileCalls(PythonTool):
    """Every boxed answer is a call (the tests' warm start boxes its answers), whose code is the next hostile
    program, in turn."""

    def __init__(self) -> None:
        sandbox = SandboxSettings(workers=2, timeout_s=1.0, memory_mb=256, output_bytes=4096, tmp_mb=16, processes=32)
        super().__init__(PythonToolSettings(max_calls=2, timeout_s=1.0, code_start="\\boxed{", code_end="}", sandbox=sandbox))
        env = os.environ
        programs = hostile_programs(env["RLVR_HOSTILE_CANARY_FILE"], int(env["RLVR_HOSTILE_CANARY_PID"]))
        self.programs = itertools.cycle(programs.values())

    def code_of(self, text: str) -> str | None:
        return None if super().code_of(text) is None else next(self.programs)
