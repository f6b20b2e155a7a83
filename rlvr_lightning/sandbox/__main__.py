"""python -m rlvr_lightning.sandbox FILE: run a file in the sandbox and print what the model would read back
(the observation), then how the call ended. Debug a tool or a hostile program with it."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.sandbox.observation import observation
from rlvr_lightning.sandbox.pool import Sandbox, SandboxSettings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlvr_lightning.sandbox", description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="a Python file, or - for standard input")
    defaults = SandboxSettings()
    p.add_argument("--isolation", default=defaults.isolation, choices=["bwrap", "none"])
    p.add_argument("--timeout-s", type=float, default=defaults.timeout_s)
    p.add_argument("--memory-mb", type=int, default=defaults.memory_mb)
    p.add_argument("--max-chars", type=int, default=2048, help="the observation's length (head and tail kept)")
    p.add_argument("--stderr", action="store_true", help="also print the call's whole standard error")
    args = p.parse_args(argv)
    code = sys.stdin.read() if args.file == "-" else open(args.file).read()
    names = {f.name for f in fields(SandboxSettings)}
    settings = SandboxSettings(**{k: v for k, v in vars(args).items() if k in names} | {"workers": 1})
    try:
        with Sandbox(settings) as box:
            execution = box.run(code)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text, truncated = observation(execution, settings.timeout_s, args.max_chars)
    print(f"```output\n{text}\n```")
    if args.stderr and execution.stderr:
        print(execution.stderr, file=sys.stderr, end="")
    cut = ", truncated" if truncated else ""
    peak = f", {execution.memory_peak_mb:.0f} MiB at most" if execution.memory_peak_mb is not None else ""
    print(f"[{execution.status}, exit code {execution.exit_code}, {execution.seconds * 1000:.0f} ms{peak}{cut}]", file=sys.stderr)
    return 0 if execution.ok else 1


if __name__ == "__main__":
    sys.exit(main())
