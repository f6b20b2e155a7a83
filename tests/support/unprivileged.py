"""Run a command of the project's as an unprivileged user (`nobody`), from a test that runs as root (CI does), to
test what only a user without privileges meets (the sandbox in a user namespace).

The user must reach the interpreter, the virtual environment and the repository, which may lie under a
directory only root may enter (`/root`, 0700). The command runs in a mount namespace of its own (bubblewrap
as root, with everything bound as it is) where each such directory is an empty, enterable one holding just
those paths; nothing outside that namespace changes.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

NOBODY = 65534
REPOSITORY = Path(__file__).resolve().parents[2]


def unavailable_reason() -> str | None:
    """Why a command cannot run as an unprivileged user here, or None."""
    if os.getuid() != 0:
        return "not root: the tests already run as an unprivileged user"
    for tool in ("bwrap", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        with open("/proc/sys/user/max_user_namespaces") as f:
            if int(f.read()) == 0:
                return "user namespaces are disabled (user.max_user_namespaces = 0)"
    except OSError:
        pass
    return None


def _closed_ancestor(path: Path) -> Path | None:
    """The outermost directory above `path` that others may not enter, if any."""
    for parent in reversed(path.parents):
        if parent != Path("/") and not os.stat(parent).st_mode & stat.S_IXOTH:
            return parent
    return None


def unprivileged_command(argv: list[str]) -> list[str]:
    """`argv` as `nobody`, with this interpreter, its environment and the repository within its reach."""
    needed = {Path(os.path.realpath(p)) for p in (sys.base_prefix, sys.prefix, sys.executable, REPOSITORY)}
    needed |= {Path(sys.prefix)}
    needed = {p for p in needed if not any(other in p.parents for other in needed)}  # one bind holds its insides
    cmd = ["bwrap", "--dev-bind", "/", "/"]
    closed: dict[Path, list[Path]] = {}
    for path in sorted(needed):
        ancestor = _closed_ancestor(path)
        if ancestor is not None:
            closed.setdefault(ancestor, []).append(path)
    for ancestor, paths in closed.items():
        cmd += ["--perms", "0755", "--tmpfs", str(ancestor)]
        made = {ancestor}
        for path in paths:
            for parent in reversed(path.parents):
                if parent not in made and ancestor in parent.parents:
                    cmd += ["--perms", "0755", "--dir", str(parent)]
                    made.add(parent)
            cmd += ["--ro-bind", str(path), str(path)]
    cmd += ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--"]  # fmt: skip
    return cmd + argv


def run_unprivileged(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run `argv` (a Python module's command line, say) as `nobody` in the repository, its output captured."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": str(REPOSITORY), "LANG": "C.UTF-8"}
    return subprocess.run(
        unprivileged_command(argv), cwd=REPOSITORY, env=env, capture_output=True, text=True, timeout=timeout_s
    )
