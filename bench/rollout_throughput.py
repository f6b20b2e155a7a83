"""Rollout throughput: the vLLM engine against the HF `generate` engine (issue 9 item 1).

Same prompts, same sampling (n = G, temperature 1, max tokens), same policy weights; the two engines
alternate round by round (warm-up round first, not counted) so machine drift hits both alike. Reports
generated tokens per second and completions per second, median over rounds, and their ratio.

    .venv/bin/python bench/rollout_throughput.py [--rounds 5] [--prompts 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from common import close, embedded_module, median, write  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()

    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.rollout.hf_engine import HFGenerateEngine
    from rlvr_lightning.rollout.vllm_engine import VLLMEngine

    module = embedded_module(GRPO(), batch_size=args.prompts, group_size=args.group_size,
                             max_response_length=args.max_tokens)  # fmt: skip
    dm = module.datamodule
    tok = dm.tokenizer
    batch = next(iter(dm.train_dataloader()))
    prompts = [tok(p, add_special_tokens=False).input_ids for p in batch.prompts]
    engines = {
        "vllm": VLLMEngine(dm.policy_path, max_model_len=dm.max_model_len(), dtype="float32", seed=0),
        "hf": HFGenerateEngine(module.policy, tok.pad_token_id, tok.eos_token_id),
    }
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.rounds + 1):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            sampling = dm.sampling(n=args.group_size, max_tokens=args.max_tokens, seed=r)
            t0 = time.perf_counter()
            groups = engines[name].generate(prompts, sampling)
            seconds = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for g in groups for c in g)
            if r > 0:  # round 0 warms both up
                runs[name].append({"seconds": seconds, "tokens": tokens, "completions": sum(len(g) for g in groups)})
    engines["vllm"].close()
    close(module)

    summary = {
        name: {"tokens_per_s": median([x["tokens"] / x["seconds"] for x in xs]),
               "completions_per_s": median([x["completions"] / x["seconds"] for x in xs]),
               "seconds": median([x["seconds"] for x in xs]), "mean_tokens_per_completion":
               sum(x["tokens"] for x in xs) / sum(x["completions"] for x in xs)}  # fmt: skip
        for name, xs in runs.items()
    }
    write("rollout_throughput", {
        "workload": {"model": "embedded", "prompts": args.prompts, "group_size": args.group_size,
                     "max_tokens": args.max_tokens, "temperature": 1.0, "rounds": args.rounds},
        "median": summary,
        "vllm_over_hf_tokens_per_s": summary["vllm"]["tokens_per_s"] / summary["hf"]["tokens_per_s"],
        "target": ">= 3x",
    })  # fmt: skip


if __name__ == "__main__":
    main()
