"""Synchronous, one version ahead, and two versions ahead with partial rollouts in the reproducible and the
throughput stream modes (`rollout.stream.max_staleness` 0, 1 and 2 with `rollout.stream.partial_rollouts`,
`rollout.stream.mode`) on `vllm serve` replicas: the embedded default GRPO step, side by side,
each mode in a fresh process with its own servers. Reports the median step time of each mode, its ratio to
the synchronous step, and the overlap achieved: the share of generation time the step did not wait for
(1 − rollout_wait / rollout), next to the update time it could hide.

What two shared cores can show: whether generation leaves the step's critical path (the overlap). What they
cannot: a speed-up. The servers and the trainer share the same two cores, so generating beside the update
slows the update about as much as it saves, and the embedded default's 40-token answers have no long tail
for partial rollouts to cut (docs/servers.md).

    .venv/bin/python bench/staleness.py [--steps 8] [--replicas 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import embedded_module, median, prompt_batches, run_child, write  # noqa: E402

from rlvr_lightning.training.settings import ComputeSettings, OptimSettings

MODES = {  # name → the rollout stream's settings (`rollout.stream`)
    "sync": {"max_staleness": 0},
    "one-ahead": {"max_staleness": 1},
    "two-ahead-partial": {"max_staleness": 2, "partial_rollouts": True},
    "two-ahead-throughput": {"max_staleness": 2, "partial_rollouts": True, "mode": "throughput"},
}


def one(mode: str, steps: int, replicas: int) -> dict:
    from rlvr_lightning.algos import GRPO

    module = embedded_module(GRPO(kl_coef=0.001, optim=OptimSettings(lr=3e-5), compute=ComputeSettings(micro_batch_size=128)), engine="vllm-server",
                             servers={"replicas": replicas}, stream=MODES[mode])  # fmt: skip
    batches = prompt_batches(module)
    times, ahead = [], []
    try:
        for i in range(2 + steps):  # 2 warm-up steps: servers, allocator and optimizer state as in training
            result = module.train_on_batch(next(batches))
            module.rollout_batches += 1
            if i >= 2:
                times.append(result.times)
                ahead.append(result.metrics["staleness_max"])
    finally:
        module.teardown("fit")
    stage = lambda k: median([t.get(k, 0.0) for t in times])  # noqa: E731
    return {
        "step_s": stage("step"), "rollout_s": stage("rollout"), "rollout_wait_s": stage("rollout_wait"),
        "reward_s": stage("reward"), "update_s": stage("update"), "weight_sync_s": stage("weight_sync"),
        "staleness_max": sorted(set(ahead)),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--one", choices=list(MODES))
    p.add_argument("--out")
    args = p.parse_args()
    if args.one is not None:
        with open(args.out, "w") as f:
            json.dump(one(args.one, args.steps, args.replicas), f)
        return
    common = ("--steps", str(args.steps), "--replicas", str(args.replicas))
    runs: dict[str, list] = {m: [] for m in MODES}
    for mode in [*MODES, *reversed(MODES)]:  # A B C C B A: drift on a shared machine hits every mode alike
        result, err = run_child(__file__, "--one", mode, *common)
        if result is None:
            raise SystemExit(f"{mode} failed:\n{err}")
        runs[mode].append(result)
    summary = {m: {k: median([r[k] for r in rs]) for k in rs[0] if k != "staleness_max"} | {"staleness_max": rs[0]["staleness_max"]}
               for m, rs in runs.items()}  # fmt: skip
    sync = summary["sync"]["step_s"]
    write("staleness", {
        "workload": f"embedded default GRPO step (16 prompts × 8 samples, 40 tokens), {args.replicas} vllm serve "
                    f"replica(s) on this machine's cores, median of {args.steps} steps after 2 warm-up, 2 processes per mode",
        **summary,
        "step_time_over_sync": {m: s["step_s"] / sync for m, s in summary.items()},
        # What each step did not wait for, of its generation's own time.
        "overlap_of_generation": {m: (1 - s["rollout_wait_s"] / s["rollout_s"]) if s["rollout_s"] and m != "sync" else 0.0
                                  for m, s in summary.items()},  # fmt: skip
        "runs": runs,
    })  # fmt: skip


if __name__ == "__main__":
    main()
