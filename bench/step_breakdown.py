"""Where step time goes, per algorithm preset.

Each preset (`configs/algo/<name>.yaml`: its module, shapers included, and its callbacks) runs in its own
process on the embedded default workload (B = 16 prompts × G = 8, max 40 tokens, vLLM engine):
one warm-up step, then `--steps` timed steps through the real training step (`train_on_batch`). Reports
the median seconds of each part (rollout, reward = verifier, old log-probs, attribution, update,
weight sync), response tokens per second, the verifier's and the weight sync's share of the step,
the process's peak memory (RSS, engine included), and each preset's step time over GRPO's.

    .venv/bin/python bench/step_breakdown.py [--steps 6] [--presets grpo,dapo,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from common import embedded_module, median, peak_rss_mib, preset, run_child, timed_steps, write  # noqa: E402

PARTS = ["step", "rollout", "reward", "old_logprob", "attribution", "update", "weight_sync"]
PRESETS = "grpo,dr-grpo,dapo,gspo,real,thr,oar-g,oar-p"


def run_one(name: str, steps: int) -> dict:
    module, callbacks = preset(name)
    module = embedded_module(module, callbacks)
    timed = timed_steps(module, steps)
    times = [t for _, _, _, t in timed]
    tokens = [int(rollout.response_lengths.sum()) for rollout, _, _, _ in timed]
    parts = {k: median([t.get(k, 0.0) for t in times]) for k in PARTS}
    parts["other"] = parts["step"] - sum(parts[k] for k in PARTS[1:])  # advantages, layout, logging
    return {
        "median_seconds": parts,
        "response_tokens_per_s": median([n / t["step"] for n, t in zip(tokens, times)]),
        "verifier_share": parts["reward"] / parts["step"],
        "weight_sync_share": parts["weight_sync"] / parts["step"],
        "peak_rss_mib": peak_rss_mib(),
        "steps_timed": len(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--presets", default=PRESETS)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child process: one preset
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        with open(args.out, "w") as fh:
            json.dump(run_one(args.one, args.steps), fh)
        return

    results = {}
    for name in args.presets.split(","):
        result, error = run_child(__file__, "--one", name, "--steps", str(args.steps), tail=2000)
        if result is None:
            results[name] = {"error": error}
            continue
        results[name] = result
        print(name, json.dumps(results[name]["median_seconds"]), flush=True)
    grpo = results.get("grpo", {}).get("median_seconds", {}).get("step")
    for r in results.values():
        if grpo and "median_seconds" in r:
            r["step_over_grpo"] = r["median_seconds"]["step"] / grpo
    write("step_breakdown", {
        "workload": {"model": "embedded", "batch_size": 16, "group_size": 8, "max_response_length": 40,
                     "engine": "vllm", "steps": args.steps, "process": "one per preset"},
        "presets": results,
        "targets": {"weight_sync_share": "<= 0.02", "verifier_share": "<= 0.10"},
    })  # fmt: skip


if __name__ == "__main__":
    main()
