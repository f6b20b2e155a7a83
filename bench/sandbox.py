"""Sandboxed executions per second: pre-warmed workers against a fresh interpreter per call.

Both sides run the same calls under the same bubblewrap isolation and the same parallelism (`--workers`
at once): the warm side through `Sandbox` (a fork of a worker that imported numpy and sympy once), the
fresh side as one `bwrap … python -c CODE` process per call, which is what running each call in a new
sandboxed interpreter costs. Rounds alternate between the two sides, so the machine's load falls on both.

    .venv/bin/python bench/sandbox.py [--calls 64] [--rounds 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import median, write  # noqa: E402

WORKLOADS = {
    "print": "print(6 * 7)",
    "sympy": "import sympy\nx = sympy.symbols('x')\nprint(sympy.factorint(2**32 + 1), sympy.solve(x**2 - 5*x + 6, x))",
}


def fresh_call(command: list[str], code: str) -> float:
    from rlvr_lightning.sandbox.isolation import ENVIRONMENT

    t0 = time.perf_counter()
    proc = subprocess.run([*command, code], capture_output=True, text=True, env=dict(ENVIRONMENT), timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-500:])
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    from rlvr_lightning.sandbox import Sandbox, SandboxSettings
    from rlvr_lightning.sandbox.isolation import bwrap_command

    settings = SandboxSettings(workers=args.workers, timeout_s=60.0)
    command = bwrap_command(settings.preload, settings.tmp_mb)
    fresh = command[: command.index(sys.executable)] + [sys.executable, "-I", "-c"]  # same isolation, no worker
    t0 = time.perf_counter()
    box = Sandbox(settings)
    startup = time.perf_counter() - t0
    results = {}
    try:
        for name, code in WORKLOADS.items():
            warm_rates, fresh_rates, latencies = [], [], []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                runs = box.run_many([code] * args.calls)
                warm_rates.append(args.calls / (time.perf_counter() - t0))
                assert all(r.ok for r in runs), runs[0]
                latencies += sorted(r.seconds for r in runs)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(args.workers) as pool:
                    list(pool.map(fresh_call, [fresh] * args.calls, [code] * args.calls))
                fresh_rates.append(args.calls / (time.perf_counter() - t0))
            latencies.sort()
            results[name] = {
                "warm_calls_per_s": median(warm_rates),
                "fresh_calls_per_s": median(fresh_rates),
                "warm_over_fresh": median(warm_rates) / median(fresh_rates),
                "warm_call_ms_p50": 1000 * latencies[len(latencies) // 2],
                "warm_call_ms_p95": 1000 * latencies[int(0.95 * (len(latencies) - 1))],
            }
    finally:
        box.close()
    write("sandbox", {"workers": args.workers, "calls": args.calls, "rounds": args.rounds, "pool_startup_s": startup,
                      "preload": list(settings.preload), "workloads": results})  # fmt: skip


if __name__ == "__main__":
    main()
