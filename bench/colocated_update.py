"""Does the in-process vLLM engine slow the trainer down? The same GRPO update (one rollout batch of the
embedded default, repeated 8 times on the same tensors) in a process whose rollout engine is vLLM and in
one whose engine is HF `generate`; processes alternate A B B A. Reports the median update seconds, the
CPU time of the process's threads during the updates, and minor page faults per update.

    .venv/bin/python bench/colocated_update.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from common import close, embedded_module, median, prompt_batches, run_child, write  # noqa: E402

from rlvr_lightning.algos import wiring
from rlvr_lightning.training.settings import ComputeSettings, OptimSettings

REPEATS = 8


def _thread_cpu_seconds() -> float:
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
        except OSError:
            pass
    return total / os.sysconf("SC_CLK_TCK")


def one(engine: str) -> dict:
    import torch

    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.training.behaviour import FromUpdateForward
    from rlvr_lightning.training.generation import generate_and_score
    from rlvr_lightning.training.step_metrics import StageTimer

    module = embedded_module(GRPO(kl_coef=0.001, optim=OptimSettings(lr=3e-5), compute=ComputeSettings(micro_batch_size=128)), engine=engine)
    batches = prompt_batches(module)
    for _ in range(2):  # warm-up steps: engine, allocator and optimizer state as in training
        module.train_on_batch(next(batches))
        module.rollout_batches += 1
    torch.manual_seed(0)
    step = module.step_context()
    rollout = generate_and_score(step, next(batches), StageTimer())
    inputs = module.rlvr_step.prepare(step, rollout)[1]
    seconds = []
    cpu0, faults0 = _thread_cpu_seconds(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(REPEATS):
        # A fresh θ_old recorder each time: every repeat reads θ_old from its own forward, as in training.
        again = inputs.with_behaviour(FromUpdateForward(inputs.tensors.response_mask.shape, module.device))
        t0 = time.perf_counter()
        module.rlvr_step.update.run(step, again, len(rollout.batch), wiring.optimization(module))
        seconds.append(time.perf_counter() - t0)
    cpu, faults = _thread_cpu_seconds() - cpu0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    close(module)
    return {"update_seconds": seconds, "cpu_seconds_per_update": cpu / REPEATS, "minor_faults_per_update": faults / REPEATS,
            "shape": list(inputs.tensors.input_ids.shape)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        with open(args.out, "w") as fh:
            json.dump(one(args.one), fh)
        return
    runs: dict[str, list[dict]] = {"hf": [], "vllm": []}
    for engine in ("hf", "vllm", "vllm", "hf"):
        result, error = run_child(__file__, "--one", engine)
        if result is None:
            raise RuntimeError(f"the {engine} process failed:\n{error}")
        runs[engine].append(result)
        print(engine, runs[engine][-1], flush=True)
    summary = {
        engine: {
            "median_update_seconds": median([s for r in rs for s in r["update_seconds"]]),
            "cpu_seconds_per_update": median([r["cpu_seconds_per_update"] for r in rs]),
            "minor_faults_per_update": median([r["minor_faults_per_update"] for r in rs]),
            "shapes": [r["shape"] for r in rs],
        }
        for engine, rs in runs.items()
    }
    write("colocated_update", {
        "workload": {"model": "embedded", "prompts": 16, "group_size": 8, "repeats": REPEATS, "order": "A B B A"},
        "engines": summary,
        "vllm_over_hf_update": summary["vllm"]["median_update_seconds"] / summary["hf"]["median_update_seconds"],
        "runs": runs,
    })  # fmt: skip


if __name__ == "__main__":
    main()
