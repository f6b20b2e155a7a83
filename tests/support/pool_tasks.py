"""Pool tasks whose worker process dies, for tests/rewards/test_verifier_failures.py: in a module of their own, which a
spawned worker imports in milliseconds (the test module imports torch and Lightning)."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def crash_once(marker: str, inner_timeout_s) -> bool:
    """The first time (no file `marker` yet), its worker dies as if OOM-killed; then True."""
    if not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def crash_always(answer: str, inner_timeout_s) -> bool:
    """Its worker dies whenever `answer` is "crash", which is then the task's own doing; True otherwise."""
    if answer == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def count_and_crash(path: str, inner_timeout_s) -> bool:
    """Appends a character to the file `path` (one per attempt) and kills its worker; for "fine", True."""
    if path == "fine":
        return True
    with open(path, "a") as f:
        f.write("x")
    os.kill(os.getpid(), signal.SIGKILL)
    return True
