"""Rollout throughput: the vLLM engine against the HF `generate` engine.

Same prompts (embedded-task problems), same sampling (n = 8, temperature 1, 40 new tokens), same
weights, on two models: the embedded default (1.1M parameters, warm-started, stops at EOS after ~26
tokens) and the same architecture scaled to 6.4M parameters (hidden 256, 6 layers; random weights,
so every completion runs to the token limit). The engines alternate round by round (a warm-up round
first, not counted) so machine drift hits both; median tokens/s and the ratio are reported, for 16
prompts (one training batch, 128 sequences) and 64 prompts (512 sequences).

    .venv/bin/python bench/rollout_throughput.py [--rounds 5] [--compiled --name rollout_compiled]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from common import median, write  # noqa: E402

G, MAX_TOKENS = 8, 40


def models(tmp: str) -> dict[str, str]:
    from rlvr_lightning.models.embedded import TinyQwen2Spec, build_char_tokenizer, build_tiny_qwen2, save_policy
    from rlvr_lightning.models.warm_start import embedded_policy_path

    tok = build_char_tokenizer()
    spec = TinyQwen2Spec(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=1024)  # fmt: skip
    scaled = save_policy(build_tiny_qwen2(tok, spec, seed=0), tok, os.path.join(tmp, "scaled"))
    return {"embedded 1.1M (warm start)": str(embedded_policy_path()), "scaled 6.4M (random)": str(scaled)}


def measure(path: str, prompts: int, rounds: int, compiled: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlvr_lightning.data.sources import embedded_records
    from rlvr_lightning.models.forward import sequence_logprobs
    from rlvr_lightning.rollout.hf_engine import HFGenerateEngine
    from rlvr_lightning.rollout.types import SamplingConfig
    from rlvr_lightning.rollout.vllm_engine import VLLMEngine

    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok(r.problem, add_special_tokens=False).input_ids for r in embedded_records("train")[:prompts]]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engines = {
        "vllm": VLLMEngine(path, max_model_len=32 + MAX_TOKENS, dtype="float32", seed=0),
        "hf": HFGenerateEngine(model, tok.pad_token_id, tok.eos_token_id, partial(sequence_logprobs, model)),
    }
    if compiled:  # vLLM's compiled model (rollout.enforce_eager=false): start-up cost printed, not in tokens/s
        t0 = time.perf_counter()
        engines["vllm_compiled"] = VLLMEngine(path, max_model_len=32 + MAX_TOKENS, dtype="float32", seed=0, enforce_eager=False)
        print(f"vllm_compiled start-up {time.perf_counter() - t0:.1f} s", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    lengths: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds + 1):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            t0 = time.perf_counter()
            groups = engines[name].generate(
                ids, SamplingConfig(group_size=G, temperature=1.0, max_tokens=MAX_TOKENS, seed=r)
            )
            seconds = time.perf_counter() - t0
            tokens = [len(c.token_ids) for g in groups for c in g]
            if r > 0:  # round 0 warms both up
                rates[name].append(sum(tokens) / seconds)
                lengths[name].append(sum(tokens) / len(tokens))
    for name in engines:
        if name.startswith("vllm"):
            engines[name].close()
    out = {name: {"tokens_per_s": median(v), "mean_tokens_per_completion": median(lengths[name])} for name, v in rates.items()}
    out["vllm_over_hf"] = out["vllm"]["tokens_per_s"] / out["hf"]["tokens_per_s"]
    if compiled:
        out["vllm_compiled_over_hf"] = out["vllm_compiled"]["tokens_per_s"] / out["hf"]["tokens_per_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", default="16,64")
    parser.add_argument("--compiled", action="store_true", help="also vLLM with enforce_eager=False (compiled model)")
    parser.add_argument("--name", default="rollout_throughput", help="results/<name>.json")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in models(tmp).items():
            for prompts in map(int, args.prompts.split(",")):
                key = f"{label}, {prompts} prompts x {G}"
                results[key] = measure(path, prompts, args.rounds, args.compiled)
                print(key, results[key], flush=True)
    write(args.name, {
        "workload": {"group_size": G, "max_tokens": MAX_TOKENS, "temperature": 1.0, "rounds": args.rounds,
                     "hf_engine": "one batched generate call with KV cache", "vllm": "in-process, enforce_eager"},
        "results": results,
        "target": "vllm_over_hf >= 3",
    })  # fmt: skip


if __name__ == "__main__":
    main()
