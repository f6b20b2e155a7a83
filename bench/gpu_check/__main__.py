"""`python -m bench.gpu_check --out DIR` (`make gpu-check OUT=DIR`): every step of the GPU check, each in its
own process with its own time budget, one JSON per step under DIR plus environment.json (docs/gpu.md).

Without CUDA (or with --tiny) every step runs at tiny shapes: the CPU test of the same command. A step that
fails, raises or runs out of time records that in its JSON and the next step runs.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

STEPS = {  # JSON name → (module, budget in seconds on a GPU, with tiny shapes)
    "doctor": ("bench.gpu_check.doctor_rows", 50, 90),
    "planner": ("bench.gpu_check.planner_check", 160, 150),
    "throughput": ("bench.gpu_check.throughput", 80, 90),
    "fast_paths": ("bench.gpu_check.fast_paths", 200, 240),
    "engine": ("bench.gpu_check.engine_speed", 35, 60),
    "rl_runs": ("bench.gpu_check.rl_runs", 90, 420),
}
# 9 minutes on the GPU machine, inside a device call's 10: on an H200 the other five steps took 357 s (the
# planner's 12 updates about 150 s, most of it its own fake-tensor runs), so the last steps (engine, rl_runs)
# get what fast_paths leaves and are recorded as skipped when nothing is left; tiny shapes on a small shared
# CPU: mostly start-up, and compiling the fast paths' layers.
TOTAL_BUDGET_S = {False: 540.0, True: 1100.0}
STEP_ENV = {  # a step's process environment beyond this one's: set before CUDA is first used
    "fast_paths": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
}
START_GRACE_S = 45.0  # a step process's imports and start-up, beyond its own budget, before it is killed
PACKAGES = {  # distribution → module
    "torch": "torch", "transformers": "transformers", "lightning": "lightning", "peft": "peft", "torchmetrics": "torchmetrics",
    "triton": "triton", "jsonargparse": "jsonargparse", "pebble": "pebble", "math-verify": "math_verify",
    "latex2sympy2_extended": "latex2sympy2_extended", "antlr4-python3-runtime": "antlr4", "vllm": "vllm",
    "flash-attn": "flash_attn", "mlflow": "mlflow", "datasets": "datasets",
}  # fmt: skip


@dataclass
class Context:
    tiny: bool
    workdir: Path
    deadline: object  # record.Deadline


def problems(results: dict) -> list[str]:
    """What makes a step's result a failure: an `error` anywhere in it, a failed doctor row, a non-finite figure."""
    from bench.gpu_check.record import non_finite

    found: list[str] = []

    def walk(tree, path: str) -> None:
        if isinstance(tree, dict):
            if "error" in tree:
                found.append(f"{path or 'step'}: {tree['error']}")
            for key, value in tree.items():
                walk(value, f"{path}/{key}" if path else str(key))

    walk(results, "")
    found += [f"failed doctor row: {row}" for row in results.get("failed", [])]
    found += [f"not finite: {key}" for key in non_finite(results)]
    return found


def run_one(step: str, out: Path, tiny: bool, budget_s: float, workdir: Path) -> None:
    """One step in this process: its JSON, whatever happens."""
    from bench.gpu_check.record import Deadline, error_text, header, write

    t0 = time.perf_counter()
    ctx = Context(tiny, workdir, Deadline(budget_s))
    try:
        results = importlib.import_module(STEPS[step][0]).run(ctx)
    except Exception as err:  # noqa: BLE001 - the step's failure is its record
        results = {"error": error_text(err), "traceback": traceback.format_exc()[-3000:]}
    found = problems(results)
    write(out, step, {**header(tiny), "step": step, "status": "failed" if found else "ok", "problems": found,
                      "elapsed_s": round(time.perf_counter() - t0, 1), "budget_s": budget_s, **results})  # fmt: skip


def spawn(step: str, out: Path, tiny: bool, budget_s: float, workdir: Path) -> dict:
    """The step in a child process, its output passed through; killed past its budget and the start-up grace.
    (status, elapsed) from the JSON it wrote, or a JSON written here for a step that died or was killed."""
    from bench.gpu_check.record import REPO, header, write

    cmd = [sys.executable, "-m", "bench.gpu_check", "--one", step, "--out", str(out), "--budget", str(budget_s),
           "--workdir", str(workdir), "--tiny" if tiny else "--no-tiny"]  # fmt: skip
    t0, tail = time.perf_counter(), collections.deque(maxlen=40)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {"TQDM_DISABLE": "1", **os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **STEP_ENV.get(step, {})}  # no progress bars
    # The step's working directory is its scratch folder: whatever a library writes to "." stays out of the checkout.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=workdir)
    killed = False
    try:
        for line in _lines_until(proc, t0 + budget_s + START_GRACE_S):
            print(line, end="", flush=True)
            tail.append(line)
    except TimeoutError:
        proc.kill()
        killed = True
    proc.wait()
    elapsed = round(time.perf_counter() - t0, 1)
    path = out / f"{step}.json"
    if killed or proc.returncode != 0 or not path.exists():
        why = f"killed after {elapsed:.0f} s (budget {budget_s:.0f} s)" if killed else f"exit code {proc.returncode}"
        write(out, step, {**header(tiny), "step": step, "status": "failed", "problems": [f"step: {why}"],
                          "elapsed_s": elapsed, "budget_s": budget_s, "error": why, "output_tail": "".join(tail)[-4000:]})  # fmt: skip
    import json

    return {"status": json.loads(path.read_text())["status"], "elapsed_s": elapsed}


def _lines_until(proc, deadline: float):
    """The process's output lines; TimeoutError once `deadline` (time.perf_counter) passes. A reader thread,
    so that a child that prints nothing is still stopped on time."""
    import queue
    import threading

    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in iter(proc.stdout.readline, "")] + [lines.put(None)],
                     daemon=True).start()  # fmt: skip
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.perf_counter()))
        except queue.Empty:
            raise TimeoutError from None
        if line is None:
            return
        yield line


def environment(tiny: bool, steps: dict) -> dict:
    import torch

    from bench.gpu_check.record import header

    versions = {}  # None: not importable here
    for name, module in PACKAGES.items():
        try:
            versions[name] = importlib.metadata.version(name) if importlib.util.find_spec(module) else None
        except (importlib.metadata.PackageNotFoundError, ValueError):
            versions[name] = None
    env = {**header(tiny), "python": sys.version.split()[0], "packages": versions,
           "wheels_installed": os.environ.get("GPU_CHECK_WHEELS", "none"), "steps": steps}  # fmt: skip
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu_memory_gib": round(props.total_memory / 2**30, 1), "multiprocessors": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}"}  # fmt: skip
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON files (at most 8)")
    p.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=None,
                   help="tiny shapes (default: when there is no CUDA device)")  # fmt: skip
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of: {', '.join(STEPS)}")
    p.add_argument("--workdir", type=Path, help="scratch folder (default: a new temporary one); never under --out")
    p.add_argument("--one", choices=list(STEPS), help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    tiny = (not torch.cuda.is_available()) if args.tiny is None else args.tiny
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        run_one(args.one, out, tiny, args.budget, args.workdir)
        return 0
    from bench.gpu_check.record import write

    unknown = [s for s in args.steps.split(",") if s not in STEPS]
    if unknown:
        p.error(f"unknown steps {unknown}; valid: {', '.join(STEPS)}")
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="gpu-check-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    end = time.perf_counter() + TOTAL_BUDGET_S[tiny]
    summary: dict = {}
    print(f"gpu-check: {'tiny shapes' if tiny else 'full shapes'} on {environment(tiny, {})['card']}; JSON in {out}", flush=True)
    for step in args.steps.split(","):
        _, gpu_budget, tiny_budget = STEPS[step]
        budget = min(tiny_budget if tiny else gpu_budget, end - time.perf_counter())
        if budget < 5:
            summary[step] = {"status": "skipped: the check's total time budget is spent"}
            continue
        print(f"gpu-check: {step} (budget {budget:.0f} s) …", flush=True)
        step_dir = workdir / step
        step_dir.mkdir(exist_ok=True)
        summary[step] = spawn(step, out, tiny, budget, step_dir)
        print(f"gpu-check: {step}: {summary[step]['status']} in {summary[step]['elapsed_s']:.0f} s", flush=True)
    write(out, "environment", environment(tiny, summary))
    failed = [s for s, r in summary.items() if r["status"] != "ok"]
    print(f"gpu-check: {len(summary) - len(failed)} of {len(summary)} steps ok{'; not ok: ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
