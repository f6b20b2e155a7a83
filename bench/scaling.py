"""How GRPO's step cost grows with the group size G and the response length.

One process; for each setting a fresh module and engine on the embedded default (B = 16 prompts),
one warm-up step, then `--steps` timed steps. Reports median step, rollout and update seconds and
response tokens per second. The response-length sweep raises `max_response_length`; the embedded
policy usually stops on its own well before 80 tokens, so its table also shows the mean length.

    .venv/bin/python bench/scaling.py [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from common import embedded_module, median, timed_steps, write  # noqa: E402

from rlvr_lightning.training.settings import ComputeSettings, OptimSettings


def measure(group_size: int, max_response_length: int, steps: int) -> dict:
    from rlvr_lightning.algos import GRPO

    module = embedded_module(GRPO(kl_coef=0.001, optim=OptimSettings(lr=3e-5), compute=ComputeSettings(micro_batch_size=128)), group_size=group_size,
                             max_response_length=max_response_length)  # fmt: skip
    rows = []
    for result in timed_steps(module, steps):
        rollout, t = result.batch.rollout, result.times
        lengths = rollout.response_lengths.float()
        rows.append({"step": t["step"], "rollout": t["rollout"], "update": t["update"],
                     "tokens": lengths.sum().item(), "mean_length": lengths.mean().item()})  # fmt: skip
    out = {k: median([r[k] for r in rows]) for k in ("step", "rollout", "update", "mean_length")}
    out["response_tokens_per_s"] = median([r["tokens"] / r["step"] for r in rows])
    return {"group_size": group_size, "max_response_length": max_response_length, **out}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group-sizes", default="4,8,16")
    parser.add_argument("--lengths", default="20,40,80")
    args = parser.parse_args()
    by_g = [measure(int(g), 40, args.steps) for g in args.group_sizes.split(",")]
    by_len = [measure(8, int(n), args.steps) for n in args.lengths.split(",")]
    write("scaling", {
        "workload": {"model": "embedded", "batch_size": 16, "engine": "vllm", "steps": args.steps},
        "by_group_size": by_g,
        "by_response_length": by_len,
    })  # fmt: skip


if __name__ == "__main__":
    main()
