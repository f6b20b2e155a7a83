"""Attribution overhead on the GRPO step: THR, OAR-G and OAR-P.

One GRPO module on the embedded default (B = 16 prompts × G = 8, max 40 tokens, vLLM engine). Each
training step runs with one of: no shaper (GRPO), THR (p = 0.2), OAR-G or OAR-P (the module's `shapers`
section, the step rebuilt for each); the modes rotate step by step (each round in a different order, so drift
and warm-up cancel), each on fresh rollouts of the current policy.
Reports median step time and its parts per mode, and each mode's ratio to GRPO: over the whole
step, and over the trainer side (step − rollout), where attribution lives.

    .venv/bin/python bench/attribution_overhead.py [--rounds 8] [--modes grpo,thr,oar-g,oar-p]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from common import close, embedded_module, median, prompt_batches, write  # noqa: E402

from rlvr_lightning.shapers.settings import OARSettings, ShaperSettings, THRSettings  # noqa: E402
from rlvr_lightning.training.settings import ComputeSettings, OptimSettings  # noqa: E402
from rlvr_lightning.training.step_metrics import StepResult  # noqa: E402

PARTS = ["step", "rollout", "reward", "old_logprob", "attribution", "update", "weight_sync"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--engine", default="vllm")
    parser.add_argument("--modes", default="grpo,thr,oar-g,oar-p")
    args = parser.parse_args()

    from rlvr_lightning.algos import GRPO

    shapers = {
        "grpo": ShaperSettings(),
        "thr": ShaperSettings(thr=THRSettings(p=0.2)),
        # as configs/algo/oar-g.yaml and oar-p.yaml
        "oar-g": ShaperSettings(oar=OARSettings(method="gradient", chunk_size=128, conclude_template="\\boxed{")),
        "oar-p": ShaperSettings(oar=OARSettings(method="perturbation", conclude_template="\\boxed{")),
    }
    modes = args.modes.split(",")
    module = embedded_module(GRPO(kl_coef=0.0, optim=OptimSettings(lr=3e-5), compute=ComputeSettings(micro_batch_size=128)), engine=args.engine)
    batches = prompt_batches(module)
    times = {m: [] for m in modes}
    for r in range(args.warmup + args.rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            module.settings = dataclasses.replace(module.settings, shapers=shapers[mode])
            module.drop_step()  # the next batch builds the step with this mode's shapers
            result = module.train_on_batch(next(batches))
            module.rollout_batches += 1
            if isinstance(result, StepResult) and r >= args.warmup:  # not a skipped batch
                times[mode].append(result[3])
    close(module)

    summary = {m: {k: median([t.get(k, 0.0) for t in ts]) for k in PARTS} for m, ts in times.items()}
    for s in summary.values():
        s["train_side"] = s["step"] - s["rollout"]
    base = summary.get("grpo")
    ratios = {
        m: {"step": s["step"] / base["step"], "train_side": s["train_side"] / base["train_side"],
            "attribution_share_of_step": s["attribution"] / s["step"]}  # fmt: skip
        for m, s in summary.items()
        if base and m != "grpo"
    }
    write("attribution_overhead", {
        "workload": {"model": "embedded", "batch_size": 16, "group_size": 8, "max_response_length": 40,
                     "engine": args.engine, "rounds": args.rounds, "modes": modes},
        "median_seconds": summary,
        "ratio_to_grpo": ratios,
    })  # fmt: skip


if __name__ == "__main__":
    main()
