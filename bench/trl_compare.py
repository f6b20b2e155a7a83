"""The same RL workload through TRL's `GRPOTrainer` and through ours.

Workload, identical on both sides: the embedded warm-started policy, 16 embedded-task prompts × G = 8
completions per step, at most 40 new tokens, temperature 1, one update per step (on-policy), lr 3e-5,
k3 KL β = 0.001 to the initial policy, clip 0.2, std-scaled group advantages, seq-mean-token-mean loss
(TRL `loss_type="grpo"`, our `grpo` preset), reward = our math-verify pool on both sides. Rollouts by
vLLM (TRL `vllm_mode="colocate"`, ours in-process) and by HF `generate`. Each side runs in its own
process, one after the other, twice in alternating order (A B B A), so drift hits both; the median
seconds per step after one warm-up step is compared. Needs the `bench` extra (`pip install -e .[bench]`).

    .venv/bin/python bench/trl_compare.py [--steps 5] [--engines vllm,hf]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from common import embedded_module, median, peak_rss_mib, run_child, timed_steps, write  # noqa: E402
from trl_side import trl_grpo_steps  # noqa: E402

from rlvr_lightning.pieces.choices import PolicyLossChoice
from rlvr_lightning.training.settings import ComputeSettings, OptimSettings

B, G, MAX_TOKENS, LR, BETA = 16, 8, 40, 3e-5, 0.001
CLIP = PolicyLossChoice("ppo-clip", {"clip_eps_low": 0.2, "clip_eps_high": 0.2})  # TRL's epsilon 0.2, both sides


def ours(engine: str, steps: int) -> dict:
    from rlvr_lightning.algos import GRPO

    module = embedded_module(GRPO(kl_coef=BETA, policy_loss=CLIP, optim=OptimSettings(lr=LR), compute=ComputeSettings(micro_batch_size=128)),
                             engine=engine, batch_size=B, group_size=G, max_response_length=MAX_TOKENS)  # fmt: skip
    seconds = [result.times["step"] for result in timed_steps(module, steps)]
    return {"step_seconds": seconds}


def trl(engine: str, steps: int) -> dict:
    result = trl_grpo_steps(steps, prompts=B, group_size=G, max_tokens=MAX_TOKENS, lr=LR, kl_beta=BETA,
                            use_vllm=engine == "vllm")  # fmt: skip
    return {"step_seconds": result["step_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--engines", default="vllm,hf")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child process: "<side>:<engine>"
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        side, engine = args.one.split(":")
        result = (ours if side == "ours" else trl)(engine, args.steps)
        result["peak_rss_mib"] = peak_rss_mib()
        with open(args.out, "w") as fh:
            json.dump(result, fh)
        return

    runs: dict[str, list[float]] = {}
    errors, memory = {}, {}
    for engine in args.engines.split(","):
        for side in ("ours", "trl", "trl", "ours"):  # A B B A
            key = f"{side}:{engine}"
            result, error = run_child(__file__, "--one", key, "--steps", str(args.steps))
            if result is None:
                errors[key] = error
                print(f"{key} failed:\n{error}", flush=True)
                continue
            runs.setdefault(key, []).extend(result["step_seconds"])
            memory[key] = max(memory.get(key, 0.0), result["peak_rss_mib"])
            print(key, [round(s, 3) for s in result["step_seconds"]], flush=True)
    summary = {k: {"median_step_seconds": median(v), "steps": len(v), "peak_rss_mib": memory[k]} for k, v in runs.items()}
    ratios = {
        engine: summary[f"trl:{engine}"]["median_step_seconds"] / summary[f"ours:{engine}"]["median_step_seconds"]
        for engine in args.engines.split(",")
        if f"trl:{engine}" in summary and f"ours:{engine}" in summary
    }
    import trl as trl_pkg

    write("trl_compare", {
        "workload": {"model": "embedded warm start", "prompts": B, "group_size": G, "max_tokens": MAX_TOKENS,
                     "lr": LR, "kl_beta": BETA, "updates_per_step": 1, "trl": trl_pkg.__version__},
        "median": summary,
        "trl_step_over_ours": ratios,
        "target": ">= 1.5 (ours at least 1.5x faster)",
        "errors": errors,
    })  # fmt: skip


if __name__ == "__main__":
    main()
