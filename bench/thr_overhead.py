"""THR attribution overhead on the GRPO step (issue 5, acceptance 4).

One GRPO module on the embedded default (B = 16 prompts × G = 8, vLLM engine); the THR callback is
switched on (p = 0.2) and off (p = 0: the callback returns at once, the base algorithm) on
alternating training steps (ABBA order, so drift cancels), each on fresh rollouts of the current
policy. Reports median step time and its parts for both, and their ratio.

    .venv/bin/python bench/thr_overhead.py [--pairs 10] [--engine vllm]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from common import close, embedded_module, median, prompt_batches, write  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--engine", default="vllm")
    parser.add_argument("--p", type=float, default=0.2)
    args = parser.parse_args()

    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.callbacks.attribution import THRAttribution

    thr = THRAttribution(p=0.0)
    module = embedded_module(GRPO(lr=3e-5, kl_coef=0.001, micro_batch_size=128), [thr], engine=args.engine)
    batches = prompt_batches(module)
    times = {"grpo": [], "thr": []}
    dominant = []
    order = ["grpo", "thr"] * args.warmup + [m for i in range(args.pairs) for m in (("grpo", "thr"), ("thr", "grpo"))[i % 2]]
    for i, mode in enumerate(order):
        thr.p = args.p if mode == "thr" else 0.0
        result = module.train_on_batch(next(batches))
        module.rollout_batches += 1
        if result is None or i < 2 * args.warmup:
            continue
        rollout, _, _, step_times = result
        times[mode].append(step_times)
        if mode == "thr":
            dominant.append(rollout.metrics.get("thr/dominant_frac", 0.0))
    close(module)

    parts = ["step", "rollout", "reward", "old_logprob", "attribution", "update", "weight_sync"]
    summary = {mode: {k: median([t.get(k, 0.0) for t in ts]) for k in parts} for mode, ts in times.items()}
    for mode in summary:
        summary[mode]["train_side"] = summary[mode]["step"] - summary[mode]["rollout"]
    write("thr_overhead", {
        "workload": {"model": "embedded", "batch_size": 16, "group_size": 8, "max_response_length": 40,
                     "engine": args.engine, "thr_p": args.p, "pairs": args.pairs},
        "median_seconds": summary,
        "thr_dominant_frac_median": median(dominant),
        "ratio_step_thr_over_grpo": summary["thr"]["step"] / summary["grpo"]["step"],
        "ratio_train_side_thr_over_grpo": summary["thr"]["train_side"] / summary["grpo"]["train_side"],
        "attribution_share_of_thr_step": summary["thr"]["attribution"] / summary["thr"]["step"],
    })  # fmt: skip


if __name__ == "__main__":
    main()
