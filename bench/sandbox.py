"""Sandboxed executions per second: pre-warmed workers against a fresh interpreter per call; and the tool's
share of a training step.

Both sides run the same calls under the same bubblewrap isolation and the same parallelism (`--workers`
at once): the warm side through `Sandbox` (a fork of a worker that imported numpy and sympy once), the
fresh side as one `bwrap … python -c CODE` process per call, which is what running each call in a new
sandboxed interpreter costs. Rounds alternate between the two sides, so the machine's load falls on both.

The share: a GRPO run on the embedded default (`--step-batches` rollout batches; 0: none) whose warm start's
boxed answers are run as tool calls (the tool's markers set to `\boxed{` and `}`), each batch's wall time in
the tool (`train/environment_seconds`) over its whole step (`time/step`).

Against another commit (`--against REF`): the same warm calls through this tree's `Sandbox` and through a
checkout of REF's (a git worktree), in alternating rounds, each round a process of its own with that tree on
its path: warm calls per second of each, and this tree's over REF's.

    .venv/bin/python bench/sandbox.py [--calls 64] [--rounds 3] [--workers 2] [--step-batches 4] [--against REF]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import median, write  # noqa: E402

WORKLOADS = {
    "print": "print(6 * 7)",
    "sympy": "import sympy\nx = sympy.symbols('x')\nprint(sympy.factorint(2**32 + 1), sympy.solve(x**2 - 5*x + 6, x))",
}


# One round of warm calls through the `Sandbox` of whichever tree is first on the path (only its public API, so
# that an older commit's tree runs it too): {workload: calls per second}.
WARM_ROUND = """
import json, sys, time
from rlvr_lightning.sandbox import Sandbox, SandboxSettings
workloads, calls, workers = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rates = {}
with Sandbox(SandboxSettings(workers=workers, timeout_s=60.0)) as box:
    box.run_many(["print(0)"] * workers)
    for name, code in workloads.items():
        t0 = time.perf_counter()
        runs = box.run_many([code] * calls)
        rates[name] = calls / (time.perf_counter() - t0)
        assert all(r.ok for r in runs), runs[0]
print(json.dumps(rates))
"""


def warm_round(tree: Path, calls: int, workers: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", WARM_ROUND, json.dumps(WORKLOADS), str(calls), str(workers)],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def against(ref: str, calls: int, rounds: int, workers: int) -> dict:
    """Warm calls per second of this tree and of `ref`'s, in alternating rounds (ratios: this over ref)."""
    repo = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "rev-parse", ref], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="rlvr-bench-ref-") as tmp:
        other = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(other), commit], cwd=repo, check=True, capture_output=True)
        try:
            rates: dict[str, dict[str, list[float]]] = {"this": {}, "ref": {}}
            for _ in range(rounds):
                for side, tree in (("ref", other), ("this", repo)):
                    for name, rate in warm_round(tree, calls, workers).items():
                        rates[side].setdefault(name, []).append(rate)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=repo, capture_output=True)
    return {
        "ref": ref,
        "ref_commit": commit,
        "warm_calls_per_s": {side: {name: median(r) for name, r in by.items()} for side, by in rates.items()},
        "this_over_ref": {name: median(rates["this"][name]) / median(rates["ref"][name]) for name in WORKLOADS},
        "rounds": rates,
    }


def fresh_call(command: list[str], code: str) -> float:
    from rlvr_lightning.sandbox.isolation import ENVIRONMENT

    t0 = time.perf_counter()
    proc = subprocess.run([*command, code], capture_output=True, text=True, env=dict(ENVIRONMENT), timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-500:])
    return time.perf_counter() - t0


def tool_share_of_step(batches: int, workers: int) -> dict:
    """The tool's wall time over the step's, per rollout batch, in a GRPO run whose boxed answers are calls."""
    from mlflow.tracking import MlflowClient

    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        cmd = [sys.executable, "-m", "rlvr_lightning", "fit", "--config", str(repo / "configs/base.yaml"),
               "--config", str(repo / "configs/algo/grpo.yaml"), "--rollout_batches", str(batches),
               "--trainer.logger.init_args.tracking_uri", uri, "--trainer.logger.init_args.artifact_location", tmp,
               "--plan.check=false", "--data.val_data", "null", "--data.tool.max_calls", "2",
               "--data.tool.code_start", "\\boxed{", "--data.tool.code_end", "}",
               "--data.tool.sandbox.workers", str(workers)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(repo)}
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        client = MlflowClient(tracking_uri=uri)
        (run,) = client.search_runs([client.get_experiment_by_name("rlvr_lightning").experiment_id])
        history = lambda key: [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]  # noqa: E731
        tool, step, calls = history("train/environment_seconds"), history("time/step"), history("train/tool_calls_per_answer")
    shares = [t / s for t, s in zip(tool, step)]
    return {"rollout_batches": batches, "tool_share_of_step_median": median(shares), "tool_share_of_step": shares,
            "tool_seconds": tool, "step_seconds": step, "tool_calls_per_answer": calls}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--step-batches", type=int, default=4, help="0: no training run")
    parser.add_argument("--against", default=None, help="a commit to compare warm calls with, side by side")
    args = parser.parse_args()
    from rlvr_lightning.sandbox import Sandbox, SandboxSettings
    from rlvr_lightning.sandbox.isolation import bwrap_command, code_uid

    settings = SandboxSettings(workers=args.workers, timeout_s=60.0)
    command = bwrap_command(settings.preload, settings.tmp_mb, code_uid())
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
    step = tool_share_of_step(args.step_batches, args.workers) if args.step_batches else None
    compared = against(args.against, args.calls, args.rounds, args.workers) if args.against else None
    write("sandbox", {"workers": args.workers, "calls": args.calls, "rounds": args.rounds, "pool_startup_s": startup,
                      "memory_bound": box.memory_bound, "preload": list(settings.preload), "workloads": results,
                      "training_step": step, "against": compared})  # fmt: skip


if __name__ == "__main__":
    main()
