"""Synchronous vs one-step-off-policy rollouts (`rollout.batches_ahead` 0 vs 1) on `vllm serve` replicas:
the embedded default GRPO step, side by side, each mode in a fresh process with its own servers. Reports
the median step time of each mode, their ratio, and the overlap achieved: the share of generation time
the asynchronous step did not wait for (1 − rollout_wait / rollout), next to the update time it could hide.

    .venv/bin/python bench/rollouts_ahead.py [--steps 8] [--replicas 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import embedded_module, median, prompt_batches, run_child, write  # noqa: E402


def one(batches_ahead: int, steps: int, replicas: int) -> dict:
    from rlvr_lightning.algos import GRPO

    module = embedded_module(GRPO(lr=3e-5, kl_coef=0.001, micro_batch_size=128), engine="vllm-server",
                             batches_ahead=batches_ahead, server_replicas=replicas)  # fmt: skip
    batches = prompt_batches(module)
    times, ahead = [], []
    try:
        for i in range(2 + steps):  # 2 warm-up steps: servers, allocator and optimizer state as in training
            result = module.train_on_batch(next(batches))
            module.rollout_batches += 1
            if i >= 2:
                times.append(result.times)
                ahead.append(result.metrics["batches_ahead"])
    finally:
        module.teardown("fit")
    stage = lambda k: median([t.get(k, 0.0) for t in times])  # noqa: E731
    return {
        "step_s": stage("step"), "rollout_s": stage("rollout"), "rollout_wait_s": stage("rollout_wait"),
        "reward_s": stage("reward"), "update_s": stage("update"), "weight_sync_s": stage("weight_sync"),
        "batches_ahead": sorted(set(ahead)),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--one", type=int, choices=[0, 1])
    p.add_argument("--out")
    args = p.parse_args()
    if args.one is not None:
        with open(args.out, "w") as f:
            json.dump(one(args.one, args.steps, args.replicas), f)
        return
    common = ("--steps", str(args.steps), "--replicas", str(args.replicas))
    runs = {0: [], 1: []}
    for mode in (0, 1, 1, 0):  # A B B A: drift on a shared machine hits both modes alike
        result, err = run_child(__file__, "--one", str(mode), *common)
        if result is None:
            raise SystemExit(f"batches_ahead={mode} failed:\n{err}")
        runs[mode].append(result)
    summary = {m: {k: median([r[k] for r in rs]) for k in rs[0] if k != "batches_ahead"} | {"batches_ahead": rs[0]["batches_ahead"]}
               for m, rs in runs.items()}  # fmt: skip
    sync, asyn = summary[0], summary[1]
    write("rollouts_ahead", {
        "workload": f"embedded default GRPO step (16 prompts × 8 samples, 40 tokens), {args.replicas} vllm serve "
                    f"replica(s) on this machine's cores, median of {args.steps} steps after 2 warm-up, 2 processes per mode",
        "sync": sync, "async": asyn,
        "async_over_sync_step_time": asyn["step_s"] / sync["step_s"],
        # What the asynchronous step did not wait for, of its generation's own time.
        "overlap_of_generation": 1 - asyn["rollout_wait_s"] / asyn["rollout_s"] if asyn["rollout_s"] else None,
        "runs": runs,
    })  # fmt: skip


if __name__ == "__main__":
    main()
